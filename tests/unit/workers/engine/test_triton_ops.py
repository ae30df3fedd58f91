"""The fused Triton kernels (norm, SwiGLU, rotary + KV write) and the fused model path against torch.

Without CUDA the kernels run under Triton's interpreter (``TRITON_INTERPRET=1``, set before any
kernel module is imported; tiny shapes). With CUDA the same tests run the compiled kernels.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

import torch.nn.functional as F  # noqa: E402

from tests.support.tiny_models import tiny_hf_model  # noqa: E402
from workers.engine.attention import AttentionMetadata, allocate_kv_cache, write_kv  # noqa: E402
from workers.engine.config import RopeConfig  # noqa: E402
from workers.engine.layers import RotaryEmbedding  # noqa: E402
from workers.engine.triton_ops import rms_norm, rotary_write_kv, silu_mul  # noqa: E402
from workers.engine.weights import load_model  # noqa: E402

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


@pytest.mark.parametrize("width", [64, 48])
def test_rms_norm_with_and_without_residual(width):
    x, res, w = _randn(5, width, seed=1), _randn(5, width, seed=2), _randn(width, seed=3)
    y, none = rms_norm(x, w, 1e-6)
    assert none is None
    assert torch.allclose(y, F.rms_norm(x, (width,), w, 1e-6), atol=1e-5)
    y, r = rms_norm(x, w, 1e-6, res)
    assert torch.equal(r, x + res)
    assert torch.allclose(y, F.rms_norm(x + res, (width,), w, 1e-6), atol=1e-5)


@pytest.mark.parametrize("inter", [32, 40])
def test_silu_mul(inter):
    x = _randn(3, 2 * inter)
    gate, up = x.chunk(2, dim=-1)
    assert torch.allclose(silu_mul(x), F.silu(gate) * up, atol=1e-6)


@pytest.mark.parametrize("head_dim", [16, 24])
def test_rotary_write_kv_matches_rotary_and_write_kv(head_dim):
    heads, kv_heads, bs = 4, 2, 4
    rotary = RotaryEmbedding(RopeConfig(theta=10000.0), head_dim, 64).to(DEVICE)
    positions = torch.tensor([0, 5, 6, 17, 31], device=DEVICE)
    slots = torch.tensor([3, 9, 10, 21, 30], device=DEVICE)
    qkv = _randn(5, (heads + 2 * kv_heads) * head_dim)
    caches = [allocate_kv_cache(1, 8, bs, kv_heads, head_dim, torch.float32, DEVICE)[0] for _ in range(2)]
    q = rotary_write_kv(qkv, positions, rotary.cos, rotary.sin, *caches[0], slots, heads, kv_heads, head_dim)
    split = qkv.view(5, heads + 2 * kv_heads, head_dim)
    ref_q, ref_k = rotary(positions, split[:, :heads], split[:, heads : heads + kv_heads])
    write_kv(*caches[1], ref_k, split[:, heads + kv_heads :].contiguous(), slots)
    assert torch.allclose(q, ref_q, atol=1e-5)
    assert torch.allclose(caches[0][0], caches[1][0], atol=1e-5)
    assert torch.equal(caches[0][1], caches[1][1])


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_fused_model_matches_torch_model(tmp_path, family):
    """Prefill then a decode step: logits and hidden states of the fused path equal the torch path's."""
    tiny_hf_model(family, tmp_path, layers=2)
    results = []
    for fused in (False, True):
        model = load_model(tmp_path, device=DEVICE, fused=fused)
        cfg = model.cfg
        kv = allocate_kv_cache(cfg.num_layers, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEVICE)
        ids = (torch.arange(7) * 7).to(DEVICE)
        with torch.inference_mode():
            first = model(ids[:5], torch.arange(5, device=DEVICE), AttentionMetadata.build([5], [5], [[2, 5]], 4, DEVICE),
                          kv, hidden_layers=(0, 1, 2))
            second = model(ids[5:], torch.arange(5, 7, device=DEVICE),
                           AttentionMetadata.build([2], [7], [[2, 5]], 4, DEVICE), kv, hidden_layers=(1, 2))
        results.append((first, second))
    for ref, got in zip(*results):
        assert (ref.logits - got.logits).abs().max() < 1e-4
        assert ref.hidden.keys() == got.hidden.keys()
        for layer in ref.hidden:
            assert (ref.hidden[layer] - got.hidden[layer]).abs().max() < 1e-4
