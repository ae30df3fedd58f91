"""Sampling with speculation follows the target's distribution (χ²), through the whole engine path:
a sampling draft model sends its sparse distributions, the target verifies and rejection-samples.

The first token comes from prefill; the second is the first one a verify step emits. Its exact
marginal under the target alone, Σ_x1 p(x1) p(x2 | x1), is computed from the model and compared
with the tokens speculation produced.
"""

from __future__ import annotations

import pytest
import torch

from runtime.messages import SamplingParams
from tests.unit.workers.engine.helpers import tiny_hf_model
from tests.unit.workers.speculation.test_rejection import chi2_pvalue
from workers.engine.engine import EngineConfig
from workers.engine.weights import load_model
from workers.draft.draft_model import DraftModelProposer
from workers.target.spec_engine import SpecEngine

pytestmark = pytest.mark.unit

VOCAB = 32
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N = 3000


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    target = tmp_path_factory.mktemp("t")
    draft = tmp_path_factory.mktemp("d")
    tiny_hf_model("llama", target, seed=21, vocab=VOCAB, layers=2)
    tiny_hf_model("llama", draft, seed=22, vocab=VOCAB, layers=1)
    return target, draft


@torch.inference_mode()
def exact_marginals(hf, temperature: float) -> tuple[torch.Tensor, torch.Tensor]:
    """p(x1) and Σ_x1 p(x1) p(x2 | x1) under the target alone."""
    p1 = (hf(torch.tensor([PROMPT])).logits[0, -1] / temperature).softmax(-1).double()
    batch = torch.tensor([PROMPT + [x] for x in range(VOCAB)])
    p2_given = (hf(batch).logits[:, -1] / temperature).softmax(-1).double()  # [V, V]
    return p1, (p1[:, None] * p2_given).sum(0)


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_first_verified_token_has_the_target_marginal(dirs, temperature):
    import transformers

    target_dir, draft_dir = dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    p1, p2 = exact_marginals(hf, temperature)
    engine = SpecEngine(load_model(target_dir), EngineConfig(block_size=4, num_blocks=4096, max_num_seqs=256,
                                                            max_num_batched_tokens=4096), num_speculative_tokens=3)
    proposer = DraftModelProposer(load_model(draft_dir), num_blocks=4096, block_size=4, max_support=16)
    torch.manual_seed(1234)
    firsts, seconds = [], []
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    for start in range(0, N, 250):
        out: dict[str, list[int]] = {}
        for i in range(start, start + 250):
            engine.add_request(str(i), PROMPT, params)
            out[str(i)] = []
        while engine.has_work():
            inputs = engine.draft_inputs()
            for rid, delta in engine.step({o.seq_id: o for o in proposer.propose(inputs)}):
                out[rid].extend(delta.token_ids)
            proposer.verified(engine.take_verdicts())
            proposer.release(engine.take_released())
        firsts += [t[0] for t in out.values()]
        seconds += [t[1] for t in out.values()]
    counters = engine.counters[""]
    assert counters.num_drafts >= N  # the second token of every request went through a verify step
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # both accept and reject paths ran
    assert chi2_pvalue(torch.bincount(torch.tensor(firsts), minlength=VOCAB), p1) > 1e-4
    assert chi2_pvalue(torch.bincount(torch.tensor(seconds), minlength=VOCAB), p2) > 1e-4
