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
from tests.support.tiny_models import target_and_draft_fixture
from tests.unit.workers.engine.test_spec_engine import run_spec
from tests.unit.workers.speculation.test_rejection import chi2_pvalue
from workers.draft.draft_model import DraftModelProposer
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

VOCAB = 32
PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]
N = 3000


dirs = target_and_draft_fixture(seed=21, vocab=VOCAB)


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
    engine = Engine(load_model(target_dir), EngineConfig(block_size=4, num_blocks=4096, max_num_seqs=256,
                                                            max_num_batched_tokens=4096), num_speculative_tokens=3)
    proposer = DraftModelProposer(load_model(draft_dir), num_blocks=4096, block_size=4, max_support=16)
    torch.manual_seed(1234)
    firsts, seconds = [], []
    params = SamplingParams(temperature=temperature, max_tokens=4, ignore_eos=True)
    for start in range(0, N, 250):
        out = run_spec(engine, proposer, {str(i): PROMPT for i in range(start, start + 250)}, params)
        firsts += [t[0] for t in out.values()]
        seconds += [t[1] for t in out.values()]
    counters = engine.counters[""]
    assert counters.num_drafts >= N  # the second token of every request went through a verify step
    assert 0 < counters.num_accepted_tokens < counters.num_draft_tokens  # both accept and reject paths ran
    assert chi2_pvalue(torch.bincount(torch.tensor(firsts), minlength=VOCAB), p1) > 1e-4
    assert chi2_pvalue(torch.bincount(torch.tensor(seconds), minlength=VOCAB), p2) > 1e-4


class FixedTree:
    """Deterministic candidates (the same small tree whatever the context): the target verifies them
    as one-hot drafts with the recursive multi-candidate rule."""

    method = "fixed_tree"
    hidden_layers: list[int] = []

    def __init__(self, first: list[int], second: list[int]):
        self.tokens, self.parents = [], []
        for a in first:
            self.tokens.append(a)
            self.parents.append(-1)
            at = len(self.tokens) - 1
            for b in second:
                self.tokens.append(b)
                self.parents.append(at)

    def propose(self, batch):
        from workers.speculation.payloads import DraftOutput
        return [DraftOutput(d.seq_id, d.round, self.tokens[: d.num_speculative_tokens], [], self.parents[: d.num_speculative_tokens])
                for d in batch]

    def verified(self, results):
        pass

    def release(self, seq_ids):
        pass


@torch.inference_mode()
def test_tree_verification_keeps_the_target_distribution(dirs):
    """Tokens 2-4 (emitted by tree verify steps) follow the target alone."""
    import transformers

    target_dir, _ = dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    p1, p2 = exact_marginals(hf, 1.0)
    pairs = torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])
    p3_given = hf(pairs).logits[:, -1].softmax(-1).double().view(VOCAB, VOCAB, VOCAB)  # [x1, x2, x3]
    p2_given = hf(torch.tensor([PROMPT + [x] for x in range(VOCAB)])).logits[:, -1].softmax(-1).double()
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    triples = torch.tensor([PROMPT + [a, b, c] for a in range(VOCAB) for b in range(VOCAB) for c in range(VOCAB)])
    p4_given = torch.cat([hf(chunk).logits[:, -1].softmax(-1).double() for chunk in triples.split(4096)])
    # the fourth token is the first one computed on top of an accepted path's moved KV
    p4 = torch.einsum("ab,abc,abcd->d", p1[:, None] * p2_given, p3_given, p4_given.view(VOCAB, VOCAB, VOCAB, VOCAB))
    likely = p2.topk(6).indices.tolist()
    proposer = FixedTree(likely[:3], likely[3:5])  # 3 children at depth 1, 2 grandchildren under each
    engine = Engine(load_model(target_dir), EngineConfig(block_size=4, num_blocks=4096, max_num_seqs=256,
                                                            max_num_batched_tokens=4096),
                        num_speculative_tokens=9, adaptive=False)
    torch.manual_seed(99)
    seconds, thirds, fourths = [], [], []
    params = SamplingParams(temperature=1.0, max_tokens=4, ignore_eos=True)
    for start in range(0, N, 250):
        out = run_spec(engine, proposer, {str(i): PROMPT for i in range(start, start + 250)}, params)
        seconds += [t[1] for t in out.values()]
        thirds += [t[2] for t in out.values()]
        fourths += [t[3] for t in out.values()]
    counters = engine.counters[""]
    assert counters.num_drafts >= N and counters.accepted_per_pos[0] > 0
    assert chi2_pvalue(torch.bincount(torch.tensor(seconds), minlength=VOCAB), p2) > 1e-4
    assert chi2_pvalue(torch.bincount(torch.tensor(thirds), minlength=VOCAB), p3) > 1e-4
    assert chi2_pvalue(torch.bincount(torch.tensor(fourths), minlength=VOCAB), p4) > 1e-4


PROCESSED = dict(presence_penalty=2.0, frequency_penalty=1.0, repetition_penalty=1.4, logit_bias={2: 1.5, 7: -2.0},
                 min_p=0.05)


def processed_probs(logits: torch.Tensor, prompt: list[int], output: list[int], temperature: float) -> torch.Tensor:
    """The target's distribution after ``prompt`` + ``output`` under PROCESSED, written out from the
    definitions (OpenAI's penalties, vLLM's repetition penalty and min_p), not from the engine."""
    x = logits.double().clone()
    for token, bias in PROCESSED["logit_bias"].items():
        x[token] += bias
    r = PROCESSED["repetition_penalty"]
    for token in set(prompt) | set(output):
        x[token] = x[token] / r if x[token] > 0 else x[token] * r
    for token in set(output):
        x[token] -= PROCESSED["frequency_penalty"] * output.count(token) + PROCESSED["presence_penalty"]
    p = (x / temperature).softmax(-1)
    p = torch.where(p >= PROCESSED["min_p"] * p.max(), p, 0.0)
    return p / p.sum()


@torch.inference_mode()
def test_sampling_under_penalties_bias_and_min_p_keeps_the_target_distribution(dirs):
    """Tokens 2 and 3 (emitted by verify steps: the root row and a row one draft token deep, whose
    penalties count that draft token) follow the processed target distribution exactly."""
    import transformers

    target_dir, draft_dir = dirs
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir).eval()
    t = 0.9
    p1 = processed_probs(hf(torch.tensor([PROMPT])).logits[0, -1], PROMPT, [], t)
    ctx2 = hf(torch.tensor([PROMPT + [a] for a in range(VOCAB)])).logits[:, -1]
    p2_given = torch.stack([processed_probs(ctx2[a], PROMPT, [a], t) for a in range(VOCAB)])  # [x1, x2]
    ctx3 = hf(torch.tensor([PROMPT + [a, b] for a in range(VOCAB) for b in range(VOCAB)])).logits[:, -1]
    p3_given = torch.stack([processed_probs(ctx3[a * VOCAB + b], PROMPT, [a, b], t)
                            for a in range(VOCAB) for b in range(VOCAB)]).view(VOCAB, VOCAB, VOCAB)
    p2 = (p1[:, None] * p2_given).sum(0)
    p3 = torch.einsum("a,ab,abc->c", p1, p2_given, p3_given)
    engine = Engine(load_model(target_dir), EngineConfig(block_size=4, num_blocks=4096, max_num_seqs=256,
                                                            max_num_batched_tokens=4096), num_speculative_tokens=3)
    proposer = DraftModelProposer(load_model(draft_dir), num_blocks=4096, block_size=4, max_support=16)
    torch.manual_seed(4321)
    seconds, thirds = [], []
    params = SamplingParams(temperature=t, max_tokens=4, ignore_eos=True, **PROCESSED)
    for start in range(0, N, 250):
        out = run_spec(engine, proposer, {str(i): PROMPT for i in range(start, start + 250)}, params)
        seconds += [x[1] for x in out.values()]
        thirds += [x[2] for x in out.values()]
    counters = engine.counters[""]
    assert counters.num_drafts >= N and 0 < counters.num_accepted_tokens < counters.num_draft_tokens
    assert counters.accepted_per_pos[0] > 0.1 * N  # the third token often comes from a depth-1 row
    assert all(p2[x] > 0 for x in seconds) and all(p3[x] > 0 for x in thirds)  # nothing min_p removed
    # The penalties' own effect: how often the third token repeats the second (a draft token the
    # depth-1 row must count as generated), against its exact probability; a binomial z-test.
    repeat = float(torch.einsum("a,ab,abb->", p1, p2_given, p3_given))
    seen = sum(b == c for b, c in zip(seconds, thirds)) / len(thirds)
    assert abs(seen - repeat) <= 4 * (repeat * (1 - repeat) / len(thirds)) ** 0.5, (seen, repeat)
    assert chi2_pvalue(torch.bincount(torch.tensor(seconds), minlength=VOCAB), p2) > 1e-4
    assert chi2_pvalue(torch.bincount(torch.tensor(thirds), minlength=VOCAB), p3) > 1e-4
