"""The grouped expert kernels (:mod:`workers.engine.triton_moe`) against the per-expert loop of
:class:`workers.engine.moe.Experts` (CPU: Triton's interpreter on tiny shapes): expert counts 1-16,
top-k 1-4, experts no token chose, batch 1 and many tokens, gpt-oss's biases and clamped SwiGLU,
an expert-parallel rank's share; float32 to 1e-5, float16 to its rounding. Then a fused MoE model:
it reads only tensors (CUDA-graph capturable) and its greedy tokens equal the loop's."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from runtime.messages import SamplingParams  # noqa: E402
from tests.support.tiny_moe import tiny_moe_model  # noqa: E402
from workers.engine.engine import Engine, EngineConfig  # noqa: E402
from workers.engine.moe import Experts, route  # noqa: E402
from workers.engine.moe_config import MoeConfig  # noqa: E402
from workers.engine.parallel import TensorParallel  # noqa: E402
from workers.engine.triton_moe import align_by_expert, fused_experts, padded_pairs  # noqa: E402
from workers.engine.weights import load_model  # noqa: E402

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HIDDEN = 40  # not a multiple of the 16-wide tiles: the masks are exercised


def _rank(rank: int, size: int) -> TensorParallel:
    """Rank ``rank`` of a group of ``size``, to build its share of the experts (never communicates)."""
    return TensorParallel(rank, size, group=object() if size > 1 else None)


def _experts(moe: MoeConfig, seed: int, dtype=torch.float32, tp=None, expert_parallel=False) -> Experts:
    gen = torch.Generator().manual_seed(seed)
    ex = Experts(moe, HIDDEN, tp or _rank(0, 1), expert_parallel)
    with torch.no_grad():
        for p in ex.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
    return ex.to(DEVICE, dtype)


def _routing(moe: MoeConfig, tokens: int, seed: int, dtype=torch.float32, avoid: int = 0):
    """x [T, H] and (weights, ids) [T, k]; ``avoid`` > 0: the last ``avoid`` experts get no token."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, HIDDEN, generator=gen)
    logits = torch.randn(tokens, moe.num_experts, generator=gen) * 2
    if avoid:
        logits[:, moe.num_experts - avoid :] = -1e4
    weights, ids = route(logits, moe)
    return x.to(DEVICE, dtype), weights.to(DEVICE, dtype), ids.to(DEVICE)


@pytest.mark.parametrize("experts, top_k, tokens, avoid", [
    (1, 1, 1, 0), (4, 1, 3, 0), (8, 2, 1, 0), (8, 2, 37, 3), (16, 4, 5, 9), (16, 4, 70, 0)])
@pytest.mark.parametrize("family", ["silu", "gpt_oss"])
def test_kernel_equals_the_expert_loop(experts, top_k, tokens, avoid, family):
    gpt_oss = family == "gpt_oss"
    moe = MoeConfig(num_experts=experts, top_k=top_k, intermediate_size=24, sparse_layers=(0,),
                    scoring="topk_softmax" if gpt_oss else "softmax_topk", norm_topk_prob=True,
                    expert_bias=gpt_oss, activation="swiglu_clamped" if gpt_oss else "silu",
                    swiglu_limit=0.8 if gpt_oss else 7.0)  # a low limit: the clamps bite
    ex = _experts(moe, experts + tokens)
    x, weights, ids = _routing(moe, tokens, tokens + top_k, avoid=avoid)
    with torch.no_grad():
        want = ex(x, ids, weights)
        got = ex.forward_fused(x, ids, weights)
    assert got.shape == want.shape and got.dtype == want.dtype
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("block_m", [16, 32])
def test_float16_and_block_sizes(block_m):
    moe = MoeConfig(num_experts=8, top_k=2, intermediate_size=40, sparse_layers=(0,), norm_topk_prob=True)
    ex = _experts(moe, 3, torch.float16)
    x, weights, ids = _routing(moe, 21, 4, torch.float16)
    with torch.no_grad():
        got = fused_experts(x, ids, weights, ex.gate_up_proj, ex.down_proj, block_m=block_m, block_n=16, block_k=16)
        want = ex.float()(x.float(), ids, weights.float())  # the same (float16) weights, in float32
    assert got.dtype == torch.float16
    # the product h is rounded to float16 between the GEMMs, as the output is: 2⁻¹¹ relative each
    assert torch.allclose(got.float(), want, atol=4e-3, rtol=2e-3), (got.float() - want).abs().max()


@pytest.mark.parametrize("rank", [0, 1])
def test_an_expert_parallel_rank_sums_only_its_experts(rank):
    """Rank r of 2 holds experts [4r, 4r + 4): pairs routed to the other rank add nothing, and the
    two ranks' partial sums add up to the single-device output."""
    moe = MoeConfig(num_experts=8, top_k=3, intermediate_size=16, sparse_layers=(0,), norm_topk_prob=True)
    whole = _experts(moe, 11)
    part = Experts(moe, HIDDEN, _rank(rank, 2), expert_parallel=True).to(DEVICE)
    with torch.no_grad():
        part.gate_up_proj.copy_(whole.gate_up_proj[4 * rank : 4 * rank + 4])
        part.down_proj.copy_(whole.down_proj[4 * rank : 4 * rank + 4])
    x, weights, ids = _routing(moe, 9, 12)
    with torch.no_grad():
        want = part(x, ids, weights)
        got = part.forward_fused(x, ids, weights)
        other = Experts(moe, HIDDEN, _rank(1 - rank, 2), expert_parallel=True).to(DEVICE)
        other.gate_up_proj.copy_(whole.gate_up_proj[4 * (1 - rank) : 4 * (1 - rank) + 4])
        other.down_proj.copy_(whole.down_proj[4 * (1 - rank) : 4 * (1 - rank) + 4])
        total = got + other.forward_fused(x, ids, weights)
    assert torch.allclose(got, want, atol=1e-5, rtol=1e-5)
    assert torch.allclose(total, whole(x, ids, weights), atol=1e-5, rtol=1e-5)


def test_alignment_groups_pairs_by_expert_in_padded_blocks():
    """Pairs of experts [2, 0, 2, 2, 5(another rank's), 0] over 3 experts, blocks of 2: expert 0's
    run [1, 5], expert 2's [0, 2, 3, pad], expert 1 none; blocks past the runs name no expert."""
    local = torch.tensor([2, 0, 2, 2, 5, 0])
    pairs, blocks = align_by_expert(local, 3, 2)
    assert pairs.numel() == padded_pairs(6, 3, 2) == 10
    assert pairs.tolist()[:6] == [1, 5, 0, 2, 3, 6]
    assert set(pairs.tolist()[6:]) == {6}
    assert blocks.tolist() == [0, 2, 2, 3, 3]


def test_a_fused_moe_model_reads_only_tensors_and_decodes_as_the_loop(tmp_path):
    """A tiny Mixtral with ``fused=True`` (its kernels interpreted on CPU): CUDA-graph capturable
    (the loop's model is not) and the same greedy tokens for a batch of 3."""
    tiny_moe_model("mixtral", tmp_path, seed=4, vocab=96, layers=2)
    loop = load_model(tmp_path, device=DEVICE)
    fused = load_model(tmp_path, device=DEVICE, fused=True)
    assert fused.static_capable and not loop.static_capable
    batch = {"a": [5, 9, 1, 4], "b": [7], "c": [3, 3, 8, 2, 61, 17]}
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    config = EngineConfig(block_size=4, num_blocks=32)
    assert Engine(fused, config).generate(batch, params) == Engine(loop, config).generate(batch, params)
