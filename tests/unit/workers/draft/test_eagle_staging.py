"""EAGLE under the pipelined seam: staged branches are forks of the head's own chain, and speculation
through the stager (as the draft service runs it, in process) stays lossless."""

from __future__ import annotations

import pytest
import torch

from runtime.messages import SamplingParams
from tests.support.eagle_heads import H, write_eagle3
from tests.unit.workers.draft.test_eagle import _head_chain, target_dir  # noqa: F401
from tests.unit.workers.engine.test_spec_engine import CFG, VOCAB, plain, prompts
from workers.draft.eagle import load_eagle, load_target_parts
from workers.draft.eagle_proposer import EagleProposer
from tests.support.draft_pool import FixedPool
from tests.support.serving import serve_through
from tests.unit.workers.draft.loopback import draft_on_loopback
from workers.draft.service import DraftService
from workers.draft.drafter import Branch
from workers.draft.stager import Stager
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model
from workers.speculation.payloads import DraftInput
from workers.target.step_loop import StepLoop

pytestmark = pytest.mark.unit


@pytest.fixture()
def head(target_dir, tmp_path):  # noqa: F811
    write_eagle3(tmp_path, seed=5)
    embed, lm_head, tcfg = load_target_parts(target_dir)
    return load_eagle(tmp_path, embed, lm_head, tcfg, 512)


@pytest.mark.parametrize("graphs", [False, True])
def test_branches_continue_the_heads_own_chain_after_the_tokens_they_assume(head, graphs):
    """A branch that assumes the first a tokens of the chain the synchronous seam drafts (features of
    those positions: the head's own, as in that chain) drafts the rest of that chain; one that
    assumes another token drafts what the head gives after it (the reference chain); alternatives are
    the head's next likeliest tokens. The prompt's last block is partly filled, so forks copy it."""
    head, layers = head
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (11,), generator=gen).tolist()
    hidden = [torch.randn(len(tokens) - 1, H, generator=gen) for _ in layers]
    sync = EagleProposer(head, layers, num_blocks=64, block_size=4)
    (chain,) = sync.propose([DraftInput("s", 0, tokens, 6, hidden_states=hidden)])
    assert len(chain.token_ids) == 6

    staged = EagleProposer(head, layers, num_blocks=64, block_size=4, cuda_graphs=graphs)
    assert staged.caps.stages and (staged.graphs is not None) == graphs
    staged.commit("s", tokens, hidden)
    x = chain.token_ids
    feats = head.project(hidden)
    other = next(t for t in _head_chain(head, feats, tokens, [])[0].topk(3).indices.tolist() if t != x[0])
    branches = [Branch("s", tuple(x[:a]), 6 - a, 2) for a in range(4)] + [Branch("s", (other,), 3, 2)]
    free = staged.blocks.num_free_blocks
    for _ in range(3):  # again: from the root kept in the cache, and forking the forks kept from before
        out = staged.draft(branches)
        for a in range(4):
            assert out[a].tokens == x[a:], f"a = {a}"
            assert len(out[a].alternatives) == len(out[a].tokens) and len(out[a].confidence) == len(out[a].tokens)
        ref = _head_chain(head, feats, tokens, [other] + out[4].tokens)
        assert out[4].tokens == [int(ref[1 + j].argmax()) for j in range(3)]
        for j, alts in enumerate(out[4].alternatives):  # the head's 2nd and 3rd likeliest at each depth
            assert alts == ref[1 + j].topk(3).indices.tolist()[1:]
        conf = out[0].confidence
        assert all(0 < c <= 1 for c in conf) and conf == sorted(conf, reverse=True)
        # what stays: the committed pairs and the forks of the last calls (for forks of them)
        seq = staged.seqs["s"]
        kept = sum(len(f.own) for call in seq.kept for f in call)
        assert len(seq.kept) <= 2 and staged.blocks.num_free_blocks == free - len(seq.blocks) - kept
    staged.release(["s"])
    assert len(staged) == 0 and staged.blocks.num_free_blocks == free


def test_pipelined_eagle_speculation_in_process_equals_plain_decoding(target_dir, tmp_path):  # noqa: F811
    """The engine under the pipelined seam, fed by the stager over an EAGLE-3 proposer the way the
    draft service drives it (commits with their hidden rows, verdicts, answers and staged branches),
    emits what plain decoding does, verifying staged proposals; greedy and sampled requests alike
    finish, and the head's cache is empty at the end."""
    write_eagle3(tmp_path)
    embed, lm_head, tcfg = load_target_parts(target_dir)
    head, layers = load_eagle(tmp_path, embed, lm_head, tcfg, 512)
    batch = prompts(8, seed=43)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = plain(target_dir, batch, params)
    engine = Engine(load_model(target_dir), CFG, num_speculative_tokens=3, hidden_layers=tuple(layers),
                    adaptive=False)
    engine.spec.pipelined = True
    proposer = EagleProposer(head, layers, num_blocks=512, block_size=4)
    stager = Stager(proposer, alternatives=1)
    got = {rid: [] for rid in batch}
    for rid, tokens in batch.items():
        engine.add_request(rid, tokens, params)
    sampled = SamplingParams(temperature=0.8, max_tokens=16, ignore_eos=True, seed=3)
    engine.add_request("sampled", next(iter(batch.values())), sampled)
    got["sampled"] = []
    while engine.has_work():
        for rid, delta in engine.step():
            got[rid].extend(delta.token_ids)
        stager.verified(engine.take_verdicts())
        stager.release(engine.take_released())
        inputs = engine.draft_inputs()
        for d in inputs:
            stager.commit(d.seq_id, d.round, list(d.new_tokens), d.chain_budget, d.hidden_states, d.sampling)
        answers, asked = stager.answer_and_stage([d.seq_id for d in inputs])
        engine.offer(answers + stager.stage(asked))
    assert len(got.pop("sampled")) == 16
    assert got == want
    counters = engine.counters[""]
    assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0 and stager.staged > 0
    assert engine.spec.num_bad_proposals == 0
    assert not any(s.broken for s in proposer.seqs.values())
    assert len(proposer) == 0 and proposer.blocks.num_free_blocks == proposer.blocks.num_blocks



async def test_pipelined_eagle3_over_grpc_with_the_real_step_loop_equals_plain_decoding():
    """The demo model and its bundled EAGLE-3 head (a head that predicts its target: a random one
    is so rarely right about the token the target commits while its proposal is on the way that
    nothing would be verified), the real step loop and draft service over loopback gRPC, hidden
    rows inline with the commits and verdicts: greedy output equals plain decoding, the loop never
    waits for the draft, and staged EAGLE proposals are verified and accepted."""
    from workers.demo_model import DEMO_HEAD, demo_model_dir

    path = demo_model_dir()
    embed, lm_head, tcfg = load_target_parts(path)
    head, layers = load_eagle(DEMO_HEAD, embed, lm_head, tcfg, 1024)
    model = load_model(path)
    cfg = EngineConfig(block_size=16, num_blocks=256, max_num_seqs=4)
    # a chat-shaped prompt in the demo vocabulary
    batch = {"a": [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 30, 2, 198, 1, 4093, 198, 7306, 1001, 260, 1345,
                   282, 4397, 47, 2, 198, 1, 520, 9531, 198]}
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = Engine(model, cfg).generate(batch, params)
    service = DraftService(EagleProposer(head, layers, num_blocks=256, block_size=16), "d1", 8)
    async with draft_on_loopback(service, hidden_layers=layers, pipelined=True, vocab_size=tcfg.vocab_size) as client:
        assert client.seam.pipelined and client.method == "eagle3"
        engine = Engine(model, cfg, num_speculative_tokens=3, hidden_layers=tuple(layers), adaptive=False)
        loop = StepLoop(engine, FixedPool(client))
        loop.start()
        try:
            got = await serve_through(loop, batch, params, timeout=60)
        finally:
            await loop.stop()
    assert got == want
    assert loop.drafting.wait_seconds == 0.0  # the pipelined loop awaits no proposal
    counters = engine.counters["d1"]
    assert service.stager.staged > 0 and counters.num_drafts > 0 and counters.num_accepted_tokens > 0, counters
    assert engine.spec.num_bad_proposals == 0


def test_branches_stop_at_the_heads_last_position(head):
    """Near the end of the context the head has positions for, branches are cut there (an EAGLE
    head's rotary tables end where the target's context does) instead of failing the batch."""
    head, layers = head
    limit = head.rotary.cos.shape[0]
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, VOCAB, (limit - 3,), generator=gen).tolist()
    proposer = EagleProposer(head, layers, num_blocks=256, block_size=4)
    proposer.commit("s", tokens, [torch.randn(len(tokens) - 1, H, generator=gen) for _ in layers])
    out = proposer.draft([Branch("s", (), 8, 1), Branch("s", (5,), 8, 1), Branch("s", (5, 6, 7), 8, 1)])
    assert [len(o.tokens) for o in out] == [3, 2, 0]  # up to position limit - 1


def test_a_staged_chains_confidence_never_exceeds_one():
    """A peaked head's float32 log_softmax can round its top value a hair above 0; the confidence
    streamed with a staged chain (cumulative, per token) stays a probability."""
    import torch

    from workers.draft.eagle_staging import _Fork

    fork = _Fork(0, 0, [], 3, 2, torch.zeros(1))
    for logp in (2.4e-7, -0.1, 1e-7):
        fork.take([5, 6], [logp, -3.0])
    assert all(0.0 <= c <= 1.0 for c in fork.confidence) and fork.confidence[0] == 1.0


def test_branches_are_ready_before_the_heads_last_pass(head):
    """``ready`` comes once, before the last head pass, with every chain holding all its tokens but
    the last (which only guesses what follows): a prefix of the chain the call returns."""
    head, layers = head
    gen = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, VOCAB, (11,), generator=gen).tolist()
    proposer = EagleProposer(head, layers, num_blocks=64, block_size=4)
    proposer.commit("s", tokens, [torch.randn(len(tokens) - 1, H, generator=gen) for _ in layers])
    branches = [Branch("s", (), 4, 1), Branch("s", (7,), 3, 1), Branch("s", (7, 8), 2, 1)]
    seen = []
    out = proposer.draft(branches, seen.append)
    assert len(seen) == 1
    for br, partial, whole in zip(branches, seen[0], out):
        assert len(whole.tokens) == br.num_tokens and len(partial.tokens) == br.num_tokens - 1
        assert partial.tokens == whole.tokens[:-1] and partial.alternatives == whole.alternatives[:-1]
    hidden = [torch.randn(len(tokens) - 1, H, generator=gen) for _ in layers]
    plain, called = (EagleProposer(head, layers, num_blocks=64, block_size=4) for _ in range(2))
    for p in (plain, called):
        p.commit("s", tokens, hidden)
    assert [c.tokens for c in called.draft(branches, seen.append)] == [
        c.tokens for c in plain.draft(branches)]
    seen.clear()
    called.draft([Branch("s", (), 1, 1)], seen.append)  # the root's token only: no pass to come
    assert seen == []
