"""Sampling under the pipelined seam follows the target's distribution (χ²): streamed proposals that
fit exactly, that overlap the committed tokens (trimmed), and that assume a wrong prefix (never to be
used) are offered at once; the target picks what fits and rejection-samples as always.

As in test_spec_sampling: the first token comes from prefill, the second is the first one a verify
step emits; its exact marginal under the target alone, Σ_x1 p(x1) p(x2 | x1), is compared with the
tokens the pipelined path produced. The draft's tokens are drawn from a fixed sparse q per depth (a
draft may propose from any q, as long as its tokens are drawn from it); the wrong-prefix proposals
carry a token that was *not* drawn from the q they claim, so using one would bias the result.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime.messages import SamplingParams
from tests.support.tiny_models import tiny_hf_model
from tests.unit.workers.engine.test_spec_sampling import PROMPT, VOCAB, exact_marginals
from tests.unit.workers.speculation.test_rejection import chi2_pvalue
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model
from workers.speculation.payloads import DraftOutput, SparseDist

pytestmark = pytest.mark.unit

N = 3000
GAMMA = 3


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    target = tmp_path_factory.mktemp("t")
    tiny_hf_model("llama", target, seed=21, vocab=VOCAB, layers=2)
    return target


def draw(rng: random.Random, q: SparseDist) -> int:
    return rng.choices(q.ids, weights=q.probs)[0]


def streamed(rng: random.Random, seq_id: str, round_: int, committed: list[int], qs: list[SparseDist],
             flip: bool) -> list[DraftOutput]:
    n = len(committed)
    exact = DraftOutput(seq_id, round_, [draw(rng, q) for q in qs], list(qs), start=n, assumed=committed[-2:])
    # drafted a token earlier: its first token is the one the target committed (one-hot), the rest from q
    overlap = DraftOutput(seq_id, round_, [committed[-1]] + [draw(rng, q) for q in qs],
                          [SparseDist([committed[-1]], [1.0])] + list(qs), start=n - 1, assumed=committed[-3:-1])
    # a wrong assumed prefix, and a token not drawn from the q it claims: using it would bias the result
    wrong = DraftOutput(seq_id, round_, [qs[0].ids[-1]] * GAMMA, list(qs), start=n,
                        assumed=committed[-2:-1] + [(committed[-1] + 1) % VOCAB])
    return [exact, overlap, wrong] if flip else [overlap, exact, wrong]  # ties go to the freshest: wrong


@pytest.mark.parametrize("temperature", [1.0, 0.7])
@torch.inference_mode()
def test_the_first_verified_token_has_the_target_marginal_under_the_pipelined_seam(target_dir, temperature):
    import transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    p1, p2 = exact_marginals(hf, temperature)
    engine = Engine(load_model(target_dir), EngineConfig(block_size=4, num_blocks=4096, max_num_seqs=256,
                                                            max_num_batched_tokens=4096),
                    num_speculative_tokens=GAMMA, adaptive=False)
    engine.spec.pipelined = True
    engine.spec.draft_id = "d"
    rng = random.Random(7)
    torch.manual_seed(1234)
    ids = list(range(0, VOCAB, 3))  # a sparse q over a third of the vocabulary, different per depth
    qs = []
    for _ in range(GAMMA):
        w = [rng.random() + 0.05 for _ in ids]
        qs.append(SparseDist(list(ids), [x / sum(w) for x in w]))
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    firsts, seconds = [], []
    for start in range(0, N, 250):
        rids = [str(i) for i in range(start, start + 250)]
        out = {rid: [] for rid in rids}
        for rid in rids:
            engine.add_request(rid, PROMPT, params)
        for rid, delta in engine.step():  # prefill: the first token
            out[rid].extend(delta.token_ids)
        inputs = engine.draft_inputs()  # asks for every sequence (the pipelined seam uses what fits)
        assert len(inputs) == len(rids)
        props = []
        for d in inputs:
            props += streamed(rng, d.seq_id, d.round, list(d.new_tokens), qs, int(d.seq_id) % 2 == 0)
        engine.offer(props)
        while engine.has_work():
            for rid, delta in engine.step():
                out[rid].extend(delta.token_ids)
            engine.take_verdicts()
            engine.take_released()
        firsts += [t[0] for t in out.values()]
        seconds += [t[1] for t in out.values()]
    counters = engine.counters["d"]
    assert counters.num_drafts >= N  # the second token of every request went through a verify step
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # both accept and reject paths ran
    assert engine.spec.num_bad_proposals == 0 and engine.spec.dropped.get("stale", 0) >= N  # wrong ones dropped
    assert chi2_pvalue(torch.bincount(torch.tensor(firsts), minlength=VOCAB), p1) > 1e-4
    assert chi2_pvalue(torch.bincount(torch.tensor(seconds), minlength=VOCAB), p2) > 1e-4
