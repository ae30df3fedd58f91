"""Prefill/decode handoff inside the engine, with real NIXL transfers between two engines' caches.

A prefill engine computes a prompt and parks its blocks; a decode engine takes its own cached prefix,
pulls the rest (keys, values and the hidden rows drafts read) with one-sided NIXL READs, and decodes
on: greedy output must equal one engine doing it all, with and without speculation."""

from __future__ import annotations

import asyncio

import msgspec
import pytest
import torch

from runtime.messages import SamplingParams
from tests.unit.workers.engine.conftest import _one_torch_thread  # noqa: F401 (autouse: one torch thread)
from tests.support.tiny_models import tiny_model_fixture
from workers.draft.draft_model import DraftModelProposer
from workers.draft.ngram import NgramProposer
from workers.engine.engine import HANDOFF, Engine, EngineConfig
from workers.engine.weights import load_model
from workers.target.kv_transfer import KvAgent, TransferFailed, block_runs, incompatibility, kv_regions, layout_of

pytestmark = pytest.mark.unit

VOCAB = 96
CFG = EngineConfig(block_size=4, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=64)
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


target_dir = tiny_model_fixture(seed=1, vocab=VOCAB, layers=2)


def engine_of(target_dir, cfg: EngineConfig = CFG) -> Engine:
    return Engine(load_model(target_dir), cfg, "w", eos_token_ids=(), hidden_layers=(1, 2))


@pytest.fixture(scope="module")
def pair(target_dir):
    """A prefill and a decode engine, each with its cache registered with a NIXL agent."""
    prefill, decode = engine_of(target_dir), engine_of(target_dir)
    a = KvAgent("prefill-test", kv_regions(prefill), layout_of(prefill, "tiny"))
    b = KvAgent("decode-test", kv_regions(decode), layout_of(decode, "tiny"))
    yield prefill, a, decode, b
    a.close()
    b.close()


def prefill_one(engine: Engine, rid: str, prompt: list[int], params=GREEDY):
    engine.add_request(rid, prompt, params, prefill_only=True)
    outputs = []
    while engine.has_work():
        outputs.extend(engine.step())
    [(got, delta)] = outputs
    assert got == rid
    return delta, engine.handoffs.take().get(rid)


def decode_rest(engine: Engine, rid: str, proposer=None, usage: list | None = None) -> list[int]:
    """Run ``engine`` to the end the way the step loop does: each cycle steps with the proposals
    asked for at the end of the cycle before, then asks for the next round."""
    tokens, proposals = [], {}
    while engine.has_work():
        for got, delta in engine.step(proposals):
            assert got == rid
            tokens.extend(delta.token_ids)
            if delta.usage is not None and usage is not None:
                usage.append(delta.usage)
        proposals = {}
        if proposer is not None:
            proposer.verified(engine.take_verdicts())
            proposer.release(engine.take_released())
            inputs = engine.draft_inputs()
            proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
    return tokens


def rest_of(params: SamplingParams) -> SamplingParams:
    """What the frontend sends the decode worker: the budget left after the first token."""
    return msgspec.structs.replace(params, max_tokens=params.max_tokens - 1)


def hand_over(pair, rid: str, prompt: list[int], params=GREEDY, proposer=None, timeout: float = 5.0,
              usage: list | None = None):
    prefill, a, decode, b = pair
    delta, handoff = prefill_one(prefill, rid, prompt, params)
    assert delta.finish_reason == HANDOFF and len(delta.token_ids) == 1
    assert handoff.num_tokens == len(prompt) and rid in prefill.handoffs.parked
    receiving = decode.receive(rid, prompt, rest_of(params), delta.token_ids, handoff)
    assert receiving is not None
    pulled = None
    if receiving.local:
        pulled = asyncio.run(b.pull(a.record("p"), receiving.local, receiving.remote, timeout))
    decode.finish_receive(rid, True)
    assert prefill.handoffs.release([handoff.handoff_id]) == 1
    return delta.token_ids + decode_rest(decode, rid, proposer, usage), receiving, pulled


def test_block_runs_merge_blocks_consecutive_on_both_sides():
    assert block_runs([4, 5, 6, 9, 10], [7, 8, 9, 10, 11]) == [(4, 7, 3), (9, 10, 2)]
    assert block_runs([1, 2, 3], [5, 4, 3]) == [(1, 5, 1), (2, 4, 1), (3, 3, 1)]
    assert block_runs([], []) == []


def test_layouts_that_do_not_fit_are_refused(pair):
    prefill, a, _, _ = pair
    mine = layout_of(prefill, "tiny")
    assert incompatibility(mine, mine) is None
    assert "block_size" in incompatibility(mine, msgspec.structs.replace(mine, block_size=8))
    assert "model" in incompatibility(mine, msgspec.structs.replace(mine, model="other"))
    assert "hidden layers" in incompatibility(mine, msgspec.structs.replace(mine, hidden_layers=[2]))


def test_handed_off_prompt_decodes_to_the_same_tokens_as_one_engine(pair, target_dir):
    prompt = [(7 * i + 3) % VOCAB for i in range(23)]  # 23 tokens: 5 full blocks and a partial one
    reference = engine_of(target_dir).generate({"r": prompt}, GREEDY)["r"]
    tokens, receiving, pulled = hand_over(pair, "r1", prompt)
    assert tokens == reference
    # every block was pulled (a fresh decode cache); the layers' blocks merged into few descriptors
    assert receiving.first_block == 0 and len(receiving.local) == 6
    regions = len(layout_of(pair[2], "tiny").block_bytes)
    assert pulled.descriptors <= regions * len(block_runs(receiving.local, receiving.remote))
    assert pulled.bytes == sum(layout_of(pair[2], "tiny").block_bytes) * 6


def test_decode_side_prefix_hits_are_not_pulled_again(pair, target_dir):
    prompt = [(5 * i + 1) % VOCAB for i in range(20)]
    reference = engine_of(target_dir).generate({"r": prompt + [9, 9]}, GREEDY)["r"]
    hand_over(pair, "warm", prompt)  # the decode engine now caches prompt's full blocks
    tokens, receiving, _ = hand_over(pair, "again", prompt + [9, 9])
    assert tokens == reference
    assert receiving.first_block == 5 and len(receiving.local) == 1  # 20 cached tokens; only block 5 moved


def test_speculation_after_a_handoff_gets_the_prompts_hidden_rows_and_stays_lossless(pair, target_dir):
    prompt = [(11 * i + 2) % VOCAB for i in range(18)]
    reference = engine_of(target_dir).generate({"r": prompt}, GREEDY)["r"]
    self_draft = DraftModelProposer(load_model(target_dir), num_blocks=256, block_size=4)
    tokens, _, _ = hand_over(pair, "spec", prompt, proposer=self_draft)
    assert tokens == reference
    assert pair[2].counters  # it did speculate
    # the draft's first request carried a hidden row for every prompt position, equal to one engine's
    prefill, a, decode, b = pair
    delta, handoff = prefill_one(prefill, "rows", prompt)
    receiving = decode.receive("rows", prompt, rest_of(GREEDY), delta.token_ids, handoff)
    if receiving.local:
        asyncio.run(b.pull(a.record("p"), receiving.local, receiving.remote, 5.0))
    decode.finish_receive("rows", True)
    prefill.handoffs.release(["rows"])
    assert decode.draft_inputs() == [] and decode.step() == []  # it joins the batch after a step, like after
    [inp] = decode.draft_inputs()  # a local prefill step: a draft is asked for before it decodes
    fresh = engine_of(target_dir)
    fresh.add_request("rows", prompt, GREEDY)
    fresh.step()
    [ref] = fresh.draft_inputs()
    assert inp.new_tokens == ref.new_tokens and len(inp.hidden_states[0]) == len(prompt)
    for got, want in zip(inp.hidden_states, ref.hidden_states):
        torch.testing.assert_close(got, want)
    decode.abort("rows")


def test_a_draft_after_a_handoff_runs_the_same_rounds_as_after_a_local_prefill(pair, target_dir):
    """Acceptance is not just close but the same: the draft sees the same tokens and hidden rows at
    the same steps, so every round drafts and accepts what it would in one engine."""
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    motif = [5, 17, 33, 2, 41]
    prompt = motif * 3 + [9, 60] + motif  # repeats, so prompt lookup drafts; some of it is accepted
    ref, ref_usage = engine_of(target_dir), []
    ref.add_request("a", prompt, params)
    want = decode_rest(ref, "a", NgramProposer(1, 3), ref_usage)
    usage = []
    tokens, _, _ = hand_over(pair, "b", prompt, params, NgramProposer(1, 3), usage=usage)
    assert tokens == want
    [got], [expected] = [u.spec for u in usage], [u.spec for u in ref_usage]
    assert expected.num_drafts > 0 and expected.num_accepted_tokens > 0
    assert got == expected  # drafts, accepted per position, and every plain step and why


def test_a_failed_pull_prefills_on_the_decode_engine_with_the_same_output(pair, target_dir):
    prefill, a, decode, b = pair
    prompt = [(3 * i + 8) % VOCAB for i in range(21)]
    reference = engine_of(target_dir).generate({"r": prompt}, GREEDY)["r"]
    delta, handoff = prefill_one(prefill, "fail", prompt)
    receiving = decode.receive("fail", prompt, rest_of(GREEDY), delta.token_ids, handoff)
    bad = [b_ + 10_000 for b_ in receiving.remote]  # blocks the prefill worker does not have
    with pytest.raises(TransferFailed):
        asyncio.run(b.pull(a.record("p"), receiving.local, bad, 5.0))
    free_before = decode.blocks.num_free_blocks
    decode.finish_receive("fail", False)
    assert decode.blocks.num_free_blocks == free_before + len(receiving.local)
    assert delta.token_ids + decode_rest(decode, "fail") == reference
    prefill.handoffs.release(["fail"])


def test_abort_while_pulling_frees_the_blocks_only_when_the_pull_ends(pair):
    prefill, a, decode, b = pair
    prompt = list(range(30, 47))
    delta, handoff = prefill_one(prefill, "gone", prompt)
    free = decode.blocks.num_free_blocks
    receiving = decode.receive("gone", prompt, GREEDY, delta.token_ids, handoff)
    held = len(receiving.seq.block_table)
    assert decode.abort("gone")
    assert decode.blocks.num_free_blocks <= free - len(receiving.local)  # still held: a READ may be landing
    decode.finish_receive("gone", True)
    assert decode.blocks.num_free_blocks >= free - (held - len(receiving.local)) and not decode.has_work()
    prefill.handoffs.release(["gone"])


def test_parked_blocks_are_freed_on_release_and_on_expiry(pair):
    prefill, *_ = pair
    free = prefill.blocks.num_free_blocks
    _, h1 = prefill_one(prefill, "x1", list(range(10, 30)))
    _, h2 = prefill_one(prefill, "x2", list(range(40, 60)))
    assert prefill.handoffs.num_blocks == 10 and prefill.blocks.num_free_blocks == free - 10
    assert prefill.handoffs.release(["x1", "x1"]) == 1  # a repeated release is a no-op
    assert prefill.handoffs.expire(now=0.0) == 0
    assert prefill.handoffs.expire(now=float("inf")) == 1 and not prefill.handoffs.parked
    assert prefill.blocks.num_free_blocks == free


def test_a_first_token_that_ends_the_request_hands_nothing_off(pair):
    prefill, *_ = pair
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    delta, handoff = prefill_one(prefill, "one", list(range(5, 15)), params)
    assert delta.finish_reason == "length" and handoff is None and "one" not in prefill.handoffs.parked


def _stalling_server(queue, done) -> None:
    import os

    os.environ["UCX_TLS"] = "tcp"  # a READ over TCP needs the remote agent to progress: a stopped one stalls it
    regions = [torch.arange(16 * 256, dtype=torch.float32).reshape(16, 256)]
    from runtime.messages import KvLayout

    layout = KvLayout("tiny", 4, "float32", 1, 1, 1, [], 0, 16, "DRAM", 0, [regions[0].data_ptr()], [1024])
    agent = KvAgent("stalling", regions, layout)
    queue.put(agent.record("stalling"))
    done.get()


def test_a_pull_from_a_stalled_prefill_worker_times_out_and_is_cancelled(monkeypatch):
    """A prefill worker that stops answering mid-pull: the READ is given up after the timeout and
    cancelled (so its blocks may be reused); a live one is read exactly."""
    import multiprocessing as mp
    import os
    import signal

    from runtime.messages import KvLayout

    monkeypatch.setenv("UCX_TLS", "tcp")
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_stalling_server, args=(queue, done), daemon=True)
    server.start()
    try:
        record = queue.get(timeout=60)
        mine = [torch.zeros(16, 256)]
        agent = KvAgent("puller", mine, KvLayout("tiny", 4, "float32", 1, 1, 1, [], 0, 16, "DRAM", 0,
                                                 [mine[0].data_ptr()], [1024]))
        got = asyncio.run(agent.pull(record, [0, 1, 5], [2, 3, 9], 10.0))
        assert got.descriptors == 2 and got.bytes == 3 * 1024
        want = torch.arange(16 * 256, dtype=torch.float32).reshape(16, 256)
        assert torch.equal(mine[0][[0, 1, 5]], want[[2, 3, 9]])
        os.kill(server.pid, signal.SIGSTOP)
        try:
            with pytest.raises(TransferFailed, match="timed out") as failed:
                asyncio.run(agent.pull(record, list(range(8, 16)), list(range(8)), 1.0))
            assert failed.value.cancelled
        finally:
            os.kill(server.pid, signal.SIGCONT)
        agent.close()
    finally:
        done.put(1)
        server.join(10)
        if server.is_alive():
            server.kill()


@pytest.mark.parametrize("expired", [False, True])
async def test_the_decode_workers_receiver_pulls_or_prefills_itself_and_releases_the_handoff(pair, target_dir,
                                                                                              expired):
    """The served path on the decode side (KvReceiver on a running StepLoop): a fresh handoff is pulled;
    one too close to its expiry is not read at all (its blocks may be reused) and the prompt is
    prefilled here. Either way the output equals one engine's and the prefill worker is told."""
    import time as _time

    from runtime.messages import GenerateRequest
    from workers.target.disagg import DisaggStats, KvReceiver
    from workers.target.step_loop import StepLoop

    prefill, a, _, _ = pair
    decode = engine_of(target_dir)
    b = KvAgent(f"decode-loop-{expired}", kv_regions(decode), layout_of(decode, "tiny"))
    released = []

    async def publish(topic, msg):
        released.append((topic, msg))

    prompt = [(17 * i + 6) % VOCAB for i in range(22)]
    reference = engine_of(target_dir).generate({"r": prompt}, GREEDY)["r"]
    delta, handoff = prefill_one(prefill, f"loop{expired}", prompt)
    if expired:
        handoff = msgspec.structs.replace(handoff, expires_at=_time.time() + 1.0)
    stats = DisaggStats()
    receiver = KvReceiver(b, lambda: [a.record(handoff.worker_id)], publish, stats, timeout=5.0)
    loop = StepLoop(decode)
    loop.start()
    try:
        req = GenerateRequest(prompt, rest_of(GREEDY), output_ids=list(delta.token_ids), kv_transfer=handoff)
        queue = await receiver.admit(loop, "x", req, None)
        tokens = list(delta.token_ids)
        while True:
            d = await asyncio.wait_for(queue.get(), 30)
            tokens.extend(d.token_ids)
            if d.finish_reason:
                break
    finally:
        await loop.stop()
        b.close()
    assert tokens == reference
    assert (stats.remote_prefills, dict(stats.local_prefills)) == ((0, {"expired": 1}) if expired else (1, {}))
    assert stats.transfer_bytes == (0 if expired else sum(layout_of(decode, "tiny").block_bytes) * 6)
    [(topic, msg)] = released
    assert topic == f"kv_release.{handoff.worker_id}" and msg.handoff_ids == [handoff.handoff_id]
    prefill.handoffs.release(msg.handoff_ids)
