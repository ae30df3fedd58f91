"""The draft-model proposer: greedy proposals equal the draft LM's own continuation, through
verdicts, rollbacks and drafting ahead; sampled proposals carry the distribution they came from."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.tiny_models import hf_greedy, tiny_hf_model
from workers.engine.weights import load_model
from workers.draft.draft_model import DraftModelProposer
from workers.draft.drafter import Branch, DraftInput, SamplingSpec, VerifyResult

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def draft(tmp_path_factory):
    path = tmp_path_factory.mktemp("draft")
    hf = tiny_hf_model("llama", path, seed=3, vocab=64)
    return hf, load_model(path)


def test_greedy_proposals_follow_the_draft_model_through_rollbacks(draft):
    hf, model = draft
    proposer = DraftModelProposer(model, num_blocks=64, block_size=4)
    rng = random.Random(0)
    prompts = {f"s{i}": [rng.randrange(64) for _ in range(5 + 3 * i)] for i in range(3)}
    committed = {sid: list(p) for sid, p in prompts.items()}
    outs = proposer.propose([DraftInput(sid, 0, list(p), 3) for sid, p in prompts.items()])
    for rnd in range(1, 8):
        results = []
        for out in outs:
            ctx = committed[out.seq_id]
            assert out.token_ids == hf_greedy(hf, ctx, 3), (rnd, out.seq_id)
            assert out.distributions == []
            # The "target" accepts a random number of drafts, then emits a token of its own.
            k = rng.randrange(0, 4)
            emitted = out.token_ids[:k] + [rng.randrange(64)]
            ctx.extend(emitted)
            results.append(VerifyResult(out.seq_id, rnd - 1, k, emitted))
        proposer.verified(results)
        outs = proposer.propose([DraftInput(sid, rnd, [], 3) for sid in prompts])
    proposer.release(list(prompts))
    assert len(proposer) == 0 and proposer.blocks.num_free_blocks == 64


def test_drafting_ahead_is_reused_when_everything_is_accepted(draft):
    hf, model = draft
    proposer = DraftModelProposer(model, num_blocks=32, block_size=4)
    prompt = [5, 9, 11, 2, 7]
    [out] = proposer.propose([DraftInput("s", 0, prompt, 3)])
    proposer.draft([Branch("s", (), 7, sampled=True)])  # γ tokens, the bonus guess, then γ more
    calls = proposer.forward_calls
    continuation = hf_greedy(hf, prompt, 8)
    # The target accepts all 3 drafts and its bonus token equals the draft's own 4th token.
    proposer.verified([VerifyResult("s", 0, 3, continuation[:4])])
    [nxt] = proposer.propose([DraftInput("s", 1, [], 3)])
    assert nxt.token_ids == continuation[4:7]
    assert proposer.forward_calls == calls  # ready without a model call

    # A different bonus token invalidates the drafted-ahead tail.
    proposer.verified([VerifyResult("s", 1, 3, continuation[4:7] + [(continuation[7] + 1) % 64])])
    [again] = proposer.propose([DraftInput("s", 2, [], 3)])
    ctx = prompt + continuation[:7] + [(continuation[7] + 1) % 64]
    assert again.token_ids == hf_greedy(hf, ctx, 3)
    assert proposer.forward_calls > calls


def test_sampled_proposals_carry_their_distributions(draft):
    _, model = draft
    proposer = DraftModelProposer(model, num_blocks=32, block_size=4, max_support=8)
    spec = SamplingSpec(temperature=0.8, top_k=5, seed=11)
    [out] = proposer.propose([DraftInput("s", 0, [1, 2, 3], 4, spec)])
    assert len(out.token_ids) == 4 and len(out.distributions) == 4
    for token, dist in zip(out.token_ids, out.distributions):
        assert len(dist.ids) == 5 and token in dist.ids
        assert sum(dist.probs) == pytest.approx(1.0, abs=1e-5)
    again = DraftModelProposer(model, num_blocks=32, block_size=4, max_support=8)
    assert again.propose([DraftInput("s", 0, [1, 2, 3], 4, spec)])[0].token_ids == out.token_ids  # seeded
