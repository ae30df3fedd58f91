"""Fused Triton kernels for the decoder's elementwise work on GPU (CPU tests: ``TRITON_INTERPRET=1``).

A decode step of a large model is bound by reading its weights; what is left is launch overhead
of the small elementwise ops between the matmuls (eager PyTorch spends ~15 kernels a layer on
norms, rotary and SwiGLU). These fuse them, as vLLM's custom ops do, so a layer is 9 launches:

- :func:`rms_norm`: y = x / sqrt(mean(x²) + eps) · w, optionally first adding the residual
  (r = x + residual, rounded to the input dtype as PyTorch would, returned as the new residual);
  statistics in float32.
- :func:`silu_mul`: silu(gate) · up over a fused [T, 2I] gate/up projection, in float32.
- :func:`rotary_write_kv`: NeoX rotary embedding of the query and key heads of a fused qkv
  projection, keys and values stored straight into the paged cache at their slots; returns the
  rotated queries [T, H, D]. Rotation in float32 against the float32 cos/sin tables.

Every kernel reads only tensors, so each can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, y_ptr, res_out_ptr, n, eps, stride_x, stride_r,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        x = x + tl.load(res_ptr + row * stride_r + offs, mask=mask, other=0.0)
        tl.store(res_out_ptr + row * n + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / n + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * n + offs, (xf * inv * w).to(y_ptr.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [T, N] (and residual [T, N]) → (normed [T, N], x + residual or None)."""
    num_rows, n = x.shape
    y = torch.empty(num_rows, n, dtype=x.dtype, device=x.device)
    res_out = torch.empty_like(y) if residual is not None else None
    if num_rows:
        block = triton.next_power_of_2(n)
        _rms_norm_kernel[(num_rows,)](
            x, residual if residual is not None else x, weight, y, res_out if res_out is not None else y, n, eps,
            x.stride(0), residual.stride(0) if residual is not None else 0,
            HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=min(16, max(1, block // 256)),
        )
    return y, res_out


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, inter, stride_x, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    gate = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    out = gate / (1.0 + tl.exp(-gate)) * up
    tl.store(y_ptr + row * inter + offs, out.to(y_ptr.dtype.element_ty), mask=mask)


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2I] = [gate | up] → silu(gate) · up [T, I]."""
    num_rows, width = x.shape
    inter = width // 2
    y = torch.empty(num_rows, inter, dtype=x.dtype, device=x.device)
    if num_rows:
        block = min(1024, triton.next_power_of_2(inter))
        _silu_mul_kernel[(num_rows, triton.cdiv(inter, block))](x, y, inter, x.stride(0), BLOCK=block)
    return y


@triton.jit
def _rotary_kv_kernel(qkv_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, positions_ptr, slots_ptr, cos_ptr, sin_ptr,
                      stride_t, stride_slot, stride_kh,
                      NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
                      HALF: tl.constexpr, HALF_PAD: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    pos = tl.load(positions_ptr + t)
    i = tl.arange(0, HALF_PAD)
    mask = i < HALF
    cos = tl.load(cos_ptr + pos * HALF + i, mask=mask, other=0.0)
    sin = tl.load(sin_ptr + pos * HALF + i, mask=mask, other=0.0)
    src = qkv_ptr + t * stride_t + h * HEAD_DIM
    x1 = tl.load(src + i, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(src + HALF + i, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if h < NUM_HEADS:
        dst = q_out_ptr + (t * NUM_HEADS + h) * HEAD_DIM
        tl.store(dst + i, o1.to(q_out_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + i, o2.to(q_out_ptr.dtype.element_ty), mask=mask)
    else:
        kv_head = h - NUM_HEADS
        slot = tl.load(slots_ptr + t).to(tl.int64)
        dst = k_cache_ptr + slot * stride_slot + kv_head * stride_kh
        tl.store(dst + i, o1.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + i, o2.to(k_cache_ptr.dtype.element_ty), mask=mask)
        vsrc = src + NUM_KV_HEADS * HEAD_DIM  # the value head sits NUM_KV_HEADS heads after its key head
        vdst = v_cache_ptr + slot * stride_slot + kv_head * stride_kh
        tl.store(vdst + i, tl.load(vsrc + i, mask=mask, other=0.0), mask=mask)
        tl.store(vdst + HALF + i, tl.load(vsrc + HALF + i, mask=mask, other=0.0), mask=mask)


def rotary_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                    k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor,
                    num_heads: int, num_kv_heads: int, head_dim: int) -> torch.Tensor:
    """qkv [T, (H + 2·Hkv)·D]; positions, slot_mapping [T]; cos, sin [P, D/2] float32;
    caches [num_blocks, bs, Hkv, D] (written). Returns the rotated queries [T, H, D]."""
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if num_tokens:
        half = head_dim // 2
        _rotary_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
            qkv, q, k_cache, v_cache, positions, slot_mapping, cos, sin, qkv.stride(0), k_cache.stride(1),
            k_cache.stride(2), NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
        )
    return q
