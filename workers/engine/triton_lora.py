"""LoRA deltas of a mixed batch in two Triton kernels (GPU; CPU tests: ``TRITON_INTERPRET=1``).

Punica's BGMV: every token carries its adapter slot (-1: none), so one launch serves any mix of
adapters without sorting or padding, and reads only the slots its tokens use:

- shrink: s[t, :] = x[t, :] · A[slot[t]]ᵀ, A [S, R, in] → s [T, R] (float32);
- expand: y[t, :] += s[t, :] · B[slot[t]]ᵀ, B [S, out, R], in place on y [T, out].

Tokens with slot -1 are skipped (their rows of y are left as they are). Accumulation is float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _shrink_kernel(x_ptr, a_ptr, slot_ptr, s_ptr, n_in, rank, stride_x, stride_as, stride_ar,
                   BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    r = tl.program_id(1) * BLOCK_R + tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for k0 in range(0, n_in, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + t * stride_x + k, mask=k < n_in, other=0.0).to(tl.float32)
        a = tl.load(a_ptr + slot * stride_as + r[:, None] * stride_ar + k[None, :],
                    mask=(r[:, None] < rank) & (k[None, :] < n_in), other=0.0).to(tl.float32)
        acc += tl.sum(a * x[None, :], axis=1)
    tl.store(s_ptr + t * rank + r, acc, mask=r < rank)


@triton.jit
def _expand_kernel(s_ptr, b_ptr, slot_ptr, y_ptr, n_out, rank, stride_bs, stride_bo, stride_y,
                   BLOCK_O: tl.constexpr, BLOCK_R: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot < 0:
        return
    o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        r = r0 + tl.arange(0, BLOCK_R)
        s = tl.load(s_ptr + t * rank + r, mask=r < rank, other=0.0)
        b = tl.load(b_ptr + slot * stride_bs + o[:, None] * stride_bo + r[None, :],
                    mask=(o[:, None] < n_out) & (r[None, :] < rank), other=0.0).to(tl.float32)
        acc += tl.sum(b * s[None, :], axis=1)
    y = tl.load(y_ptr + t * stride_y + o, mask=o < n_out, other=0.0).to(tl.float32)
    tl.store(y_ptr + t * stride_y + o, (y + acc).to(y_ptr.dtype.element_ty), mask=o < n_out)


def lora_bgmv(x: torch.Tensor, y: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
              slots: torch.Tensor) -> torch.Tensor:
    """y [T, out] += per-token LoRA deltas, in place; returns y. x [T, in]; lora_a [S, R, in] and
    lora_b [S, out, R] contiguous in their last dimension; slots [T] int (-1: no adapter)."""
    t, n_in = x.shape
    rank, n_out = lora_a.shape[1], lora_b.shape[1]
    if t == 0:
        return y
    x = x.contiguous()
    s = torch.empty(t, rank, device=x.device, dtype=torch.float32)
    block_r = min(64, triton.next_power_of_2(rank))
    _shrink_kernel[(t, triton.cdiv(rank, block_r))](x, lora_a, slots, s, n_in, rank, x.stride(0), lora_a.stride(0),
                                                    lora_a.stride(1), BLOCK_R=block_r, BLOCK_K=64)
    block_o = 64
    _expand_kernel[(t, triton.cdiv(n_out, block_o))](s, lora_b, slots, y, n_out, rank, lora_b.stride(0),
                                                     lora_b.stride(1), y.stride(0), BLOCK_O=block_o,
                                                     BLOCK_R=min(64, triton.next_power_of_2(rank)))
    return y
