"""The engine on CUDA (fused Triton kernels, CUDA graphs) against transformers. Skipped without CUDA.

Tolerance rules:
- float32: greedy tokens identical to transformers' greedy loop (TF32 off, IEEE dot products in
  the attention kernel), as on CPU.
- bfloat16: rounding differs between any two bf16 implementations, so exact equality is not
  a property either has. Instead our greedy output, teacher-forced through transformers in bf16,
  must be a near-argmax at every position: transformers' logit of our token is within
  ``BF16_LOGIT_TOL`` of its largest logit. A wrong kernel (masking, rotary, cache slots) picks
  tokens far from the argmax within a few steps and fails this.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime.messages import SamplingParams
from tests.support.tiny_models import FAMILIES, hf_greedy, tiny_hf_model
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

STEPS = 24
BF16_LOGIT_TOL = 0.125


def _prompts(n: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(256) for _ in range(rng.randrange(3, 40))] for i in range(n)}


def _engine(path, dtype) -> Engine:
    model = load_model(path, device="cuda", dtype=dtype, fused=True)
    engine = Engine(model, EngineConfig(num_blocks=256, block_size=16, max_num_seqs=8), eos_token_ids=())
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # captured at start-up
    return engine


@pytest.mark.parametrize("family", FAMILIES)
def test_float32_greedy_equals_transformers(tmp_path, family):
    torch.backends.cuda.matmul.allow_tf32 = False
    hf = tiny_hf_model(family, tmp_path, layers=2).to("cuda")
    engine = _engine(tmp_path, torch.float32)
    prompts = _prompts(8, seed=3)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    with torch.inference_mode():
        want = {rid: hf_greedy(hf, p, STEPS) for rid, p in prompts.items()}
    assert got == want
    assert engine.runner.graphs.replays > 0


@pytest.mark.parametrize("family", ["llama", "llama3", "qwen2"])
def test_bfloat16_greedy_is_near_argmax_under_transformers(tmp_path, family):
    hf = tiny_hf_model(family, tmp_path, layers=2).to("cuda", torch.bfloat16)
    engine = _engine(tmp_path, torch.bfloat16)
    prompts = _prompts(8, seed=4)
    got = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True))
    worst = 0.0
    with torch.inference_mode():
        for rid, prompt in prompts.items():
            ids = torch.tensor([prompt + got[rid]], device="cuda")
            logits = hf(ids).logits[0, len(prompt) - 1 : -1].float()  # [STEPS, V]: what predicted each token
            chosen = logits.gather(1, torch.tensor(got[rid], device="cuda")[:, None])[:, 0]
            worst = max(worst, float((logits.max(dim=1).values - chosen).max()))
    assert worst <= BF16_LOGIT_TOL, worst
