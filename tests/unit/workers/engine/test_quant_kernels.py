"""The quantized projections' fast kernels against their dequantized references.

- FP8 ``scaled_mm`` (``torch._scaled_mm``, which torch's CPU build also runs for float8): activations
  quantized per token. Checked twice: against the float32 product of the *same* quantized
  activations and weights (only accumulation rounding may differ: 1e-5 relative), and against the
  weight-only reference (unquantized activations) within the bound FP8 rounding allows:
  E4M3 keeps 3 mantissa bits, so |x − x̂| ≤ 2⁻⁴·|x| + 2⁻¹⁰·scale (subnormals) and
  |Δy| ≤ 2⁻⁴·(|x|·|W|ᵀ) + 2⁻¹⁰·scale·Σ|W|.
- INT4 ``triton`` (:mod:`workers.engine.triton_quant`; on CPU Triton's interpreter): AWQ and GPTQ
  layouts through the loader's conversion, M = 1, 3, 17, against x · dequantized Wᵀ: float32 to
  1e-5 relative, float16 to 2e-3 (its output rounding, 2⁻¹¹, and the dequantized weight's).
  bfloat16 runs on CUDA only: Triton's interpreter gets bfloat16 ``tl.dot`` wrong (Triton 3.9,
  with or without this kernel).
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from tests.support.quant import pack_awq, pack_gptq, quantize_int4, write_fp8, write_int4  # noqa: E402
from tests.unit.workers.engine.test_quant import PROMPT, _tiny  # noqa: E402
from workers.engine.attention import AttentionMetadata, allocate_kv_cache  # noqa: E402
from workers.engine.quant import (Int4Weight, QuantScheme, _fused, fp8_scaled_linear,  # noqa: E402
                                  quantize_fp8_per_token, use_kernel)
from workers.engine.triton_quant import int4_matmul  # noqa: E402
from workers.engine.weights import load_model  # noqa: E402

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE == "cuda" else [])


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


@pytest.mark.parametrize("m", [1, 3, 17])
@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_fp8_scaled_mm_matches_the_dequantized_product(m, strategy):
    n, k = 96, 160
    x = torch.randn(m, k, generator=_gen(m)).to(DEVICE)
    w = torch.randn(n, k, generator=_gen(100 + m)) * torch.rand(n, 1, generator=_gen(7))
    amax = w.abs().amax() if strategy == "tensor" else w.abs().amax(dim=1)
    scale = (amax / 448).expand(n).contiguous().float()
    wq = (w / scale[:, None]).to(torch.float8_e4m3fn)
    wq, scale, w_deq = wq.to(DEVICE), scale.to(DEVICE), (wq.float() * scale[:, None]).to(DEVICE)
    bias = torch.randn(n, generator=_gen(3)).to(DEVICE)
    y = fp8_scaled_linear(x, wq, scale, bias).float()
    assert y.shape == (m, n)
    xq, x_scale = quantize_fp8_per_token(x)
    same_inputs = (xq.float() * x_scale) @ w_deq.T + bias
    rel = 1e-5 if DEVICE == "cpu" else 8e-3  # CUDA: bfloat16 output
    assert torch.allclose(y, same_inputs, atol=rel * same_inputs.abs().max().item(), rtol=rel)
    bound = 2**-4 * (x.abs() @ w_deq.abs().T) + 2**-10 * x_scale * w_deq.abs().sum(1) + rel * y.abs()
    assert bool(((y - (x @ w_deq.T + bias)).abs() <= bound + 1e-6).all())


def _logits(model) -> torch.Tensor:
    cfg = model.cfg
    caches = allocate_kv_cache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEVICE)
    meta = AttentionMetadata.build([len(PROMPT)], [len(PROMPT)], [[0]], 16, torch.device(DEVICE))
    with torch.inference_mode():
        return model(torch.tensor(PROMPT, device=DEVICE), torch.arange(len(PROMPT), device=DEVICE), meta, caches).logits


def _int4_weight(method: str, n: int, k: int, group: int, act_order: bool) -> Int4Weight:
    w = torch.randn(n, k, generator=_gen(n + k)) * 0.1
    order = torch.randperm(k, generator=_gen(1)) if act_order else None
    q, zeros, scales, g_idx, _ = quantize_int4(w, group, order, sym=method == "gptq")
    parts = pack_awq(q, zeros, scales) if method == "awq" else pack_gptq(q, zeros, scales, g_idx)
    return _fused(QuantScheme(method, group_size=group), [parts], "test").weight


@pytest.mark.parametrize("method, act_order", [("awq", False), ("gptq", False), ("gptq", True)])
@pytest.mark.parametrize("m", [1, 3, 17])
def test_int4_triton_kernel_matches_the_dequantized_weight(method, act_order, m):
    n, k, group = 80, 256, 128
    qw = _int4_weight(method, n, k, group, act_order)
    assert (qw.perm is not None) == act_order and qw.kernels() == ("dense", "triton")
    for dtype in DTYPES:
        x = torch.randn(m, k, generator=_gen(m)).to(DEVICE, dtype)
        want = x.float() @ qw.dense(torch.float32).to(DEVICE).T  # the layer's input order
        dev = Int4Weight(*(t.to(DEVICE) for t in (qw.packed, qw.scales, qw.zeros, qw.groups)),
                         None if qw.perm is None else qw.perm.to(DEVICE))
        dev.kernels()
        dev.kernel = "triton"
        got = dev.linear(x, None)
        assert got.dtype == dtype and got.shape == (m, n)
        rel = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        assert torch.allclose(got.float(), want, atol=rel * want.abs().max().item(), rtol=rel), dtype


@pytest.mark.parametrize("split", [2, 3])
def test_int4_kernel_split_over_k_sums_the_parts(split):
    """Split-K (what CUDA runs at decode batch sizes): K = 384 in 3 steps of 128 over 2 programs
    leaves the second a step past K; over 3, one step each."""
    n, k, group = 48, 384, 128
    qw = _int4_weight("awq", n, k, group, False)
    x = torch.randn(3, k, generator=_gen(5)).to(DEVICE)
    want = x @ qw.dense(torch.float32).to(DEVICE).T
    got = int4_matmul(x, *(t.to(DEVICE) for t in (qw.packed, qw.scales, qw.zeros)), group, split_k=split)
    assert torch.allclose(got, want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)


def test_int4_kernel_rejects_a_group_it_cannot_step_through():
    x = torch.zeros(2, 48, device=DEVICE)
    with pytest.raises(ValueError, match="group"):
        int4_matmul(x, torch.zeros(8, 24, dtype=torch.uint8, device=DEVICE), torch.ones(8, 2, device=DEVICE),
                    torch.zeros(8, 2, dtype=torch.uint8, device=DEVICE), 24)


def test_int4_model_with_the_triton_kernel_gives_the_dense_paths_logits(tmp_path):
    """A GPTQ act-order checkpoint: every projection on the Triton kernel, logits as the dense path's."""
    write_int4(_tiny(), tmp_path / "gptq", "gptq", group=128, act_order=True)
    model = load_model(tmp_path / "gptq", device=DEVICE)
    assert use_kernel(model, "dense") == {"dense": 8}
    want = _logits(model)
    assert use_kernel(model, "triton") == {"triton": 8}
    got = _logits(model)
    assert (got - want).abs().max().item() <= 1e-4


def test_fp8_model_with_scaled_mm_stays_near_its_dequantized_reference(tmp_path):
    """Per-channel FP8 with FP8 activations: the logits move by the activations' rounding only.
    This random tiny model (initializer range 0.2) amplifies rounding: measured max |Δ| 1.28, mean
    0.19 on logits of standard deviation 2.3 — what FP8 weight rounding itself costs it against
    float32 (max 1.05, mean 0.20). Bounds: mean ≤ 0.3, max ≤ 2, same argmax at every position; a
    wrong layout or scale moves the mean by the logits' own size."""
    write_fp8(_tiny(), tmp_path / "fp8", "channel")
    model = load_model(tmp_path / "fp8", device=DEVICE)
    assert use_kernel(model, "dense") == {"dense": 8}
    want = _logits(model)
    assert use_kernel(model, "scaled_mm") == {"scaled_mm": 8}
    got = _logits(model)
    delta = (got - want).abs()
    assert 0 < delta.mean().item() <= 0.3 and delta.max().item() <= 2.0
    assert torch.equal(got.argmax(-1), want.argmax(-1))
