"""INT4 dequant-GEMM in Triton (GPU; CPU tests: ``TRITON_INTERPRET=1``).

y [M, N] = x [M, K] · Wᵀ with W [N, K] held as :class:`~workers.engine.quant.Int4Weight` holds it
(AWQ and GPTQ checkpoints both load into it): ``packed`` uint8 [N, K/2], input 2j in the low
nibble of byte j and 2j+1 in the high one; ``scales`` [N, K/G] and integer ``zeros`` uint8
[N, K/G] per group of G consecutive inputs; W[n, k] = (q[n, k] − zeros[n, k/G]) · scales[n, k/G].
(Act-order GPTQ checkpoints are stored with their inputs sorted by group, and the caller permutes
x to match: groups are then consecutive here.)

Each program computes a [BLOCK_M, BLOCK_N] tile over a range of K: it loads a [BLOCK_N, BLOCK_K/2]
tile of bytes once, splits it into the even-input and odd-input nibbles, dequantizes both with the
group's scale and zero (BLOCK_K divides G, so a K step lies in one group), and accumulates
x_even · W_evenᵀ + x_odd · W_oddᵀ with ``tl.dot`` in float32. The weights never exist dequantized
in memory: a decode step reads 4 bits a weight.

Split-K: at decode M is 1-16, so [M, N] holds few tiles (4096 outputs: 64 tiles) for the GPU's
~132 SMs; the K range is then split over up to ``SPLIT`` programs per tile, each writing a float32
partial product, summed by one torch reduction. Everything is decided from shapes (no host sync,
no data-dependent shape), so the call can be captured in a CUDA graph.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl


@triton.jit
def _int4_gemm_kernel(x_ptr, w_ptr, s_ptr, z_ptr, out_ptr, M, N, K, k_per_split, stride_xm, stride_wn,
                      stride_sn, stride_zn, stride_os, stride_om, GROUP: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    pid_k = tl.program_id(2)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, BLOCK_K // 2)
    m_ok = rm < M
    n_ok = rn < N
    rm64 = rm.to(tl.int64)
    rn64 = rn.to(tl.int64)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_start = pid_k * k_per_split
    for step in range(0, k_per_split // BLOCK_K):
        k0 = k_start + step * BLOCK_K
        even = k0 + 2 * half  # [BLOCK_K/2] the even inputs of this step; the odd ones are even + 1
        k_ok = even < K
        x_rows = x_ptr + rm64[:, None] * stride_xm
        xm = m_ok[:, None] & k_ok[None, :]
        x_even = tl.load(x_rows + even[None, :], mask=xm, other=0.0)  # [BLOCK_M, BLOCK_K/2]
        x_odd = tl.load(x_rows + even[None, :] + 1, mask=xm, other=0.0)
        wm = n_ok[:, None] & k_ok[None, :]
        p = tl.load(w_ptr + rn64[:, None] * stride_wn + (k0 // 2 + half)[None, :], mask=wm, other=0)
        p = p.to(tl.int32)  # [BLOCK_N, BLOCK_K/2], one byte = inputs (2j, 2j+1)
        g = tl.minimum(k0, K - 1) // GROUP  # a step past K (the last split's tail) reads x as 0
        s = tl.load(s_ptr + rn64 * stride_sn + g, mask=n_ok, other=0.0).to(tl.float32)  # [BLOCK_N]
        z = tl.load(z_ptr + rn64 * stride_zn + g, mask=n_ok, other=0).to(tl.float32)
        w_even = (((p & 0xF).to(tl.float32) - z[:, None]) * s[:, None]).to(x_even.dtype)
        w_odd = ((((p >> 4) & 0xF).to(tl.float32) - z[:, None]) * s[:, None]).to(x_even.dtype)
        if IEEE:  # float32 activations (tests): full float32 products, not TF32
            acc += tl.dot(x_even, tl.trans(w_even), input_precision="ieee")
            acc += tl.dot(x_odd, tl.trans(w_odd), input_precision="ieee")
        else:
            acc += tl.dot(x_even, tl.trans(w_even))
            acc += tl.dot(x_odd, tl.trans(w_odd))
    out = out_ptr + pid_k * stride_os + rm64[:, None] * stride_om + rn64[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def block_k(group: int) -> int:
    """The K step for a group size: a divisor of the group, 32..128; 0 where none fits (the
    caller then dequantizes instead)."""
    for b in (128, 64, 32):
        if group % b == 0:
            return b
    return 0


def int4_matmul(x: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                group: int, split_k: int | None = None) -> torch.Tensor:
    """x [M, K] (float16, bfloat16 or float32) · dequantized Wᵀ → [M, N] in x's dtype (see the module
    docstring for the weight's layout). K must be a multiple of ``group``, and ``group`` of 32.
    ``split_k``: programs per output tile along K (default: chosen from the shapes on CUDA, 1 elsewhere)."""
    m, k = x.shape
    n = packed.shape[0]
    bk = block_k(group)
    if not bk or k % group or packed.shape[1] * 2 != k:
        raise ValueError(f"int4_matmul: K={k}, group {group}, packed {tuple(packed.shape)} do not fit")
    x = x.contiguous()
    bm = 16 if m <= 16 else 32 if m <= 32 else 64
    bn = 64
    tiles = triton.cdiv(m, bm) * triton.cdiv(n, bn)
    k_blocks = k // bk
    split = 1
    if split_k is not None:
        split = max(1, min(k_blocks, split_k))
    elif x.is_cuda and m <= 64:  # few tiles: spread K over more programs (about two per SM)
        split = max(1, min(k_blocks, 16, triton.cdiv(2 * _sm_count(x.device.index or 0), tiles)))
    per_split = triton.cdiv(k_blocks, split)
    split = triton.cdiv(k_blocks, per_split)
    if split == 1:
        out = torch.empty(1, m, n, dtype=x.dtype, device=x.device)
    else:
        out = torch.empty(split, m, n, dtype=torch.float32, device=x.device)
    if m:
        grid = (triton.cdiv(m, bm), triton.cdiv(n, bn), split)
        _int4_gemm_kernel[grid](x, packed, scales, zeros, out, m, n, k, per_split * bk, x.stride(0),
                                packed.stride(0), scales.stride(0), zeros.stride(0), out.stride(0), out.stride(1),
                                GROUP=group, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, IEEE=x.dtype == torch.float32,
                                num_warps=4, num_stages=3)
    return out[0] if split == 1 else out.sum(0).to(x.dtype)
