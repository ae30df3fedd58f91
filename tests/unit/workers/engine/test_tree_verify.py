"""Token trees verified in one pass are lossless: greedy output equals plain decoding token for token
(float32, CPU) whichever branch holds the target's tokens, alone and with 8 requests in one batch."""

from __future__ import annotations

import random

import pytest

from runtime.messages import SamplingParams
from tests.support.tiny_models import tiny_model_fixture
from tests.unit.workers.engine.test_spec_engine import CFG, VOCAB, plain, prompts, run_spec
from workers.engine.engine import Engine
from workers.engine.weights import load_model
from workers.speculation.payloads import ROOT, DraftInput, DraftOutput, VerifyResult
from workers.speculation.tree import tree_depths, valid_parents

pytestmark = pytest.mark.unit


target_dir = tiny_model_fixture(seed=1, vocab=VOCAB, layers=2)


class OracleTree:
    """Trees that hide the target's own continuation among wrong branches.

    At each depth the node on the true path gets ``branching`` children in random order, one of them
    the true next token (with probability ``hit``), the others wrong; wrong nodes get a wrong child
    now and then, so accepted paths run through every sibling rank and the KV of an accepted path
    has to move.
    """

    method = "oracle_tree"
    hidden_layers: list[int] = []

    def __init__(self, truth: dict[str, list[int]], prompts: dict[str, list[int]], seed: int, branching: int = 3,
                 depth: int = 4, hit: float = 0.8, deep_hit: float | None = None):
        self.truth, self.prompts = truth, prompts
        self.rng = random.Random(seed)
        self.branching, self.depth, self.hit = branching, depth, hit
        self.deep_hit = hit if deep_hit is None else deep_hit  # below the first level
        self.tokens: dict[str, list[int]] = {}
        self.trees = 0

    def propose(self, batch: list[DraftInput]) -> list[DraftOutput]:
        out = []
        for item in batch:
            seq = self.tokens.setdefault(item.seq_id, [])
            seq.extend(item.new_tokens)
            done = len(seq) - len(self.prompts[item.seq_id])
            future = self.truth[item.seq_id][done:]
            tokens, parents = [], []
            on_path = ROOT  # the true-path node whose children come next
            for d in range(self.depth):
                chance = self.hit if d == 0 else self.deep_hit
                true_next = future[d] if d < len(future) and self.rng.random() < chance else None
                kids = [self._wrong(true_next) for _ in range(self.branching)]
                if true_next is not None:
                    kids[self.rng.randrange(self.branching)] = true_next
                nxt = None
                for t in kids:
                    tokens.append(t)
                    parents.append(on_path)
                    if t == true_next and nxt is None:
                        nxt = len(tokens) - 1
                    elif self.rng.random() < 0.3:  # a wrong node with a child of its own
                        tokens.append(self._wrong(None))
                        parents.append(len(tokens) - 2)
                if nxt is None:
                    break
                on_path = nxt
            assert valid_parents(parents, len(tokens))
            self.trees += 1
            out.append(DraftOutput(item.seq_id, item.round, tokens[: item.num_speculative_tokens], [],
                                   parents[: item.num_speculative_tokens]))
        return out

    def _wrong(self, avoid: int | None) -> int:
        while True:
            t = self.rng.randrange(VOCAB)
            if t != avoid:
                return t

    def verified(self, results: list[VerifyResult]) -> None:
        for r in results:
            self.tokens[r.seq_id].extend(r.emitted_tokens)

    def release(self, seq_ids: list[str]) -> None:
        for s in seq_ids:
            self.tokens.pop(s, None)


@pytest.mark.parametrize("concurrent", [1, 8])
def test_greedy_trees_equal_plain_decoding(target_dir, concurrent):
    batch = prompts(16, seed=7 + concurrent)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = plain(target_dir, batch, params)
    cfg = CFG if concurrent == 8 else CFG.__class__(block_size=4, num_blocks=512, max_num_seqs=1,
                                                    max_num_batched_tokens=256)
    engine = Engine(load_model(target_dir), cfg, num_speculative_tokens=16, adaptive=False)
    oracle = OracleTree(want, batch, seed=concurrent)
    got = run_spec(engine, oracle, batch, params)
    assert got == want
    stats = engine.counters[""]
    # the oracle's trees are accepted deep: far more than one token per verify step
    assert stats.num_drafts > 0 and stats.mean_accepted_length > 2.5
    assert len(stats.accepted_per_pos) >= 3 and stats.accepted_per_pos[2] > 0


def test_tree_paths_respect_max_tokens_and_budget(target_dir):
    """Deep trees near max_tokens are pruned by depth; the node budget keeps a prefix of the tree."""
    batch = prompts(6, seed=3)
    params = SamplingParams(temperature=0, max_tokens=7, ignore_eos=True)
    want = plain(target_dir, batch, params)
    engine = Engine(load_model(target_dir), CFG, num_speculative_tokens=5, adaptive=False)
    oracle = OracleTree(want, batch, seed=5, branching=2, depth=6, hit=1.0)
    got = run_spec(engine, oracle, batch, params)
    assert got == want
    assert all(len(v) == 7 for v in got.values())


def test_malformed_trees_are_ignored(target_dir):
    """A parent index that points forward (or out of range) makes the proposal decode plainly."""
    batch = prompts(3, seed=11)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    want = plain(target_dir, batch, params)

    class Bad(OracleTree):
        def propose(self, items):
            return [DraftOutput(o.seq_id, o.round, o.token_ids, [], [len(o.token_ids)] * len(o.token_ids))
                    for o in super().propose(items)]

    engine = Engine(load_model(target_dir), CFG, num_speculative_tokens=8)
    got = run_spec(engine, Bad(want, batch, seed=1), batch, params)
    assert got == want
    assert engine.counters.get("") is None  # nothing was verified as a draft


def test_tree_depths():
    assert tree_depths([ROOT, ROOT, 0, 2, 1]) == [1, 1, 2, 3, 2]
    assert valid_parents([], 3) and not valid_parents([0], 1) and not valid_parents([ROOT, 1], 2)


def test_trees_near_max_tokens_keep_their_node_budget_and_bound_their_depth(target_dir):
    """With 3 tokens left to emit (2 drafted and the bonus), a request asks for its whole node budget
    and a depth of 2: a tree spends the budget on siblings, a chain stops at 2 tokens; either way the
    output is plain decoding's."""
    from workers.draft.draft_model import DraftModelProposer

    batch = prompts(4, seed=21)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    want = plain(target_dir, batch, params)
    for topk in (4, 1):
        engine = Engine(load_model(target_dir), CFG, num_speculative_tokens=8, adaptive=False)
        draft = DraftModelProposer(load_model(target_dir), num_blocks=256, block_size=4, tree_topk=topk)
        for rid, tokens in batch.items():
            engine.add_request(rid, tokens, params)
        got = {rid: [] for rid in batch}
        for rid, delta in engine.step():  # prefill: one token each, three left
            got[rid].extend(delta.token_ids)
        inputs = engine.draft_inputs()
        assert [(i.num_speculative_tokens, i.max_depth, i.chain_budget) for i in inputs] == [(8, 2, 2)] * len(batch)
        proposals = {o.seq_id: o for o in draft.propose(inputs)}
        for o in proposals.values():
            if topk > 1:
                assert o.is_tree and len(o.token_ids) == 8 and max(tree_depths(o.parents)) == 2
            else:
                assert not o.is_tree and len(o.token_ids) == 2
        while proposals or engine.has_work():
            for rid, delta in engine.step(proposals):
                got[rid].extend(delta.token_ids)
            draft.verified(engine.take_verdicts())
            draft.release(engine.take_released())
            inputs = engine.draft_inputs()
            proposals = {o.seq_id: o for o in draft.propose(inputs)} if inputs else {}
        assert got == want


def test_adaptive_tree_budgets_keep_a_good_tree_and_back_off_a_missing_one(target_dir):
    """Adaptive speculation (the target's default) with trees: a tree whose first level always holds
    the target's token, and nothing deeper, keeps its node budget (γ's chain rule, -1 unless the
    whole depth is accepted, would shrink it every pass), and one that never hits falls to nothing."""
    batch = prompts(4, seed=13)
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = plain(target_dir, batch, params)
    for hit in (1.0, 0.0):
        engine = Engine(load_model(target_dir), CFG, num_speculative_tokens=12, adaptive=True)
        oracle = OracleTree(want, batch, seed=2, branching=3, depth=4, hit=hit, deep_hit=0.0)
        asked: list[int] = []
        propose = oracle.propose
        oracle.propose = lambda items: asked.extend(i.num_speculative_tokens for i in items) or propose(items)
        assert run_spec(engine, oracle, batch, params) == want
        c = engine.counters[""]
        if hit:
            assert sum(asked) / len(asked) > 11  # of 12
            assert c.mean_accepted_length == 2  # the first level, and the token after it
        else:  # halved to 0 within a few passes, then only probed now and then
            assert c.num_draft_tokens < 0.1 * 12 * 40 * len(batch)
