"""Grouped expert GEMMs in Triton for the mixture-of-experts layers (GPU; CPU tests: ``TRITON_INTERPRET=1``).

The maths is :class:`workers.engine.moe.Experts`' loop: every (token, slot) pair p = t·k + j goes
through expert ``ids[t, j]`` (gate/up GEMM, SwiGLU or gpt-oss's clamped variant, down GEMM) and is
weighted by ``weights[t, j]``; a token's k weighted outputs are summed. Here every expert runs in
the same two launches, as vLLM's ``fused_moe`` does:

1. :func:`align_by_expert` (torch, on the device): the pairs sorted by expert, each expert's run of
   pairs padded to a multiple of ``BLOCK_M`` with the placeholder P (no pair), so a block of
   ``BLOCK_M`` sorted rows belongs to one expert: ``sorted_pairs`` [EM] and ``block_experts``
   [EM / BLOCK_M] (``count``: no expert, the block is skipped). EM is an upper bound computed
   from shapes alone, P + min(E, P)·(BLOCK_M − 1) rounded up, so nothing is read on the host.
2. ``_gate_up_kernel``, grid (EM / BLOCK_M, I / BLOCK_N): a block's rows gather their tokens'
   inputs x[p // k] and multiply them by its expert's gate rows and up rows (two float32
   accumulators over the same input tile), add the biases (gpt-oss), apply the activation and
   write the product h [P, I] at the pairs' rows.
3. ``_down_kernel``, grid (EM / BLOCK_M, H / BLOCK_N): h's rows times the expert's down matrix,
   plus its bias, times the pair's routing weight, written in float32 to y [P, H]; then
   y.view(T, k, H).sum(1) adds each token's k outputs (no atomics: the same sum on every run).

A decode step of a large MoE is bound by reading the experts' weights; a block reads its expert's
weight tiles once for up to ``BLOCK_M`` pairs, and experts no pair chose are not read at all.
Everything is decided from shapes and tensors (no host sync, no data-dependent shape), so a layer
can be captured in a CUDA graph. Under expert parallelism a rank holds experts [first,
first + count): pairs routed elsewhere sort last, are never placed in a block and leave zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ACTIVATIONS = {"silu": 0, "swiglu_clamped": 1}


@triton.jit
def _gate_up_kernel(x_ptr, w_ptr, b_ptr, pairs_ptr, experts_ptr, h_ptr, num_pairs, num_experts, H, I,
                    stride_xm, stride_we, stride_wn, stride_be, stride_hm, alpha, limit, TOP_K: tl.constexpr,
                    HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                    BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e >= num_experts:  # a padding block past the last expert's run
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))  # [BLOCK_M]
    m_ok = pair < num_pairs
    tok = (pair // TOP_K).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < I
    w_gate = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn  # row n: gate
    w_up = w_gate + I * stride_wn  # row I + n: up
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < H
        a = tl.load(x_ptr + tok[:, None] * stride_xm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        wm = k_ok[:, None] & n_ok[None, :]
        wg = tl.load(w_gate + rk[:, None], mask=wm, other=0.0)  # [BLOCK_K, BLOCK_N]
        wu = tl.load(w_up + rk[:, None], mask=wm, other=0.0)
        if IEEE:  # float32 weights (tests): full float32 products, not TF32
            acc_g += tl.dot(a, wg, input_precision="ieee")
            acc_u += tl.dot(a, wu, input_precision="ieee")
        else:
            acc_g += tl.dot(a, wg)
            acc_u += tl.dot(a, wu)
    if HAS_BIAS:
        b = b_ptr + e.to(tl.int64) * stride_be + rn
        acc_g += tl.load(b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b + I, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == 0:  # SwiGLU
        h = acc_g * tl.sigmoid(acc_g) * acc_u
    else:  # gpt-oss: (clamp(up, ±limit) + 1) · g · sigmoid(alpha · g), g = min(gate, limit)
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = (u + 1.0) * g * tl.sigmoid(g * alpha)
    out = h_ptr + pair.to(tl.int64)[:, None] * stride_hm + rn[None, :]
    tl.store(out, h.to(h_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def _down_kernel(h_ptr, w_ptr, b_ptr, pairs_ptr, experts_ptr, weights_ptr, y_ptr, num_pairs, num_experts, H, I,
                 stride_hm, stride_we, stride_wn, stride_be, stride_ym, HAS_BIAS: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    e = tl.load(experts_ptr + pid_m)
    if e >= num_experts:
        return
    pair = tl.load(pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pair < num_pairs
    pair64 = pair.to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < H
    w_rows = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[None, :] * stride_wn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        k_ok = rk < I
        a = tl.load(h_ptr + pair64[:, None] * stride_hm + rk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_rows + rk[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)  # [BLOCK_K, BLOCK_N]
        if IEEE:
            acc += tl.dot(a, w, input_precision="ieee")
        else:
            acc += tl.dot(a, w)
    if HAS_BIAS:
        acc += tl.load(b_ptr + e.to(tl.int64) * stride_be + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    acc *= tl.load(weights_ptr + pair64, mask=m_ok, other=0.0).to(tl.float32)[:, None]
    tl.store(y_ptr + pair64[:, None] * stride_ym + rn[None, :], acc, mask=m_ok[:, None] & n_ok[None, :])


def padded_pairs(num_pairs: int, count: int, block_m: int) -> int:
    """EM: the most sorted rows ``num_pairs`` pairs over ``count`` experts can need once each
    expert's run is padded to a multiple of ``block_m`` (a multiple of ``block_m`` itself)."""
    rows = num_pairs + min(count, num_pairs) * (block_m - 1)
    return triton.cdiv(rows, block_m) * block_m


def align_by_expert(local: torch.Tensor, count: int, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """local [P] long: the expert of each pair in this rank's numbering (``count`` or more: another
    rank's) → (sorted_pairs [EM] int32: pair ids grouped by expert, each group padded to a multiple
    of ``block_m`` with P; block_experts [EM / block_m] int32: each block's expert, ``count`` for
    blocks past the last group). Device ops only: no host sync."""
    p = local.numel()
    em = padded_pairs(p, count, block_m)
    local = local.clamp(max=count)  # every other rank's pair: one bucket, never placed
    counts = torch.zeros(count + 1, dtype=torch.long, device=local.device)
    counts.scatter_add_(0, local, torch.ones_like(local))
    counts = counts[:count]  # [E'] pairs per expert
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    pad_start = pad_end - padded  # where each expert's run starts in the sorted rows
    start = counts.cumsum(0) - counts  # ... and in the unpadded sorted order
    order = torch.argsort(local, stable=True)  # [P] pairs grouped by expert
    expert = local[order]
    placed = expert < count
    expert = expert.clamp(max=count - 1)
    rank = torch.arange(p, device=local.device) - start[expert]  # a pair's place in its expert's run
    dest = torch.where(placed, pad_start[expert] + rank, em)  # unplaced pairs: the dump row past the end
    sorted_pairs = torch.full((em + 1,), p, dtype=torch.int32, device=local.device)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    blocks = torch.arange(0, em, block_m, device=local.device)
    block_experts = torch.searchsorted(pad_end, blocks, right=True).to(torch.int32)  # count: past the end
    return sorted_pairs[:em], block_experts


def fused_experts(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor,
                  down: torch.Tensor, *, first: int = 0, num_experts: int | None = None,
                  gate_up_bias: torch.Tensor | None = None, down_bias: torch.Tensor | None = None,
                  activation: str = "silu", alpha: float = 1.702, limit: float = 7.0, block_m: int | None = None,
                  block_n: int = 64, block_k: int = 64) -> torch.Tensor:
    """The weighted sum of each token's experts' outputs, in x's dtype.

    x [T, H]; ids [T, k] (global expert ids) and weights [T, k]; gate_up [E', 2I, H] (gate rows, then
    up rows) and down [E', H, I]: experts [first, first + E') of ``num_experts`` (default E': all of
    them); biases [E', 2I] and [E', H] or None.
    ``block_m``: sorted rows per block (default: 16 while experts average at most 16 pairs, as at
    decode, where a larger block would be mostly padding; 64 beyond)."""
    t, hidden = x.shape
    top_k = ids.shape[1]
    count, two_i, _ = gate_up.shape
    inter = two_i // 2
    if t == 0:
        return torch.zeros_like(x)
    p = t * top_k
    if block_m is None:
        block_m = 16 if p <= 16 * count else 64
    shard = num_experts is not None and num_experts != count  # expert parallel: some pairs are another rank's
    local = ids.reshape(-1) - first  # [P] this rank's numbering
    if shard:
        local = torch.where((local >= 0) & (local < count), local, count)
    sorted_pairs, block_experts = align_by_expert(local, count, block_m)
    x = x.contiguous()
    ieee = x.dtype == torch.float32
    h = torch.empty(p, inter, dtype=x.dtype, device=x.device)
    bias_1 = gate_up_bias if gate_up_bias is not None else gate_up  # unread without HAS_BIAS
    grid = (block_experts.numel(), triton.cdiv(inter, block_n))
    _gate_up_kernel[grid](x, gate_up, bias_1, sorted_pairs, block_experts, h, p, count, hidden, inter,
                          x.stride(0), gate_up.stride(0), gate_up.stride(1),
                          bias_1.stride(0), h.stride(0), float(alpha), float(limit), TOP_K=top_k,
                          HAS_BIAS=gate_up_bias is not None, ACT=ACTIVATIONS[activation], BLOCK_M=block_m,
                          BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, num_warps=4, num_stages=3)
    # every pair is written when this rank holds every expert; another rank's pairs stay zero
    y = (torch.zeros if shard else torch.empty)(p, hidden, dtype=torch.float32, device=x.device)
    bias_2 = down_bias if down_bias is not None else down
    flat_weights = weights.reshape(-1).contiguous()
    grid = (block_experts.numel(), triton.cdiv(hidden, block_n))
    _down_kernel[grid](h, down, bias_2, sorted_pairs, block_experts, flat_weights, y, p, count, hidden, inter,
                       h.stride(0), down.stride(0), down.stride(1), bias_2.stride(0), y.stride(0),
                       HAS_BIAS=down_bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
                       IEEE=ieee, num_warps=4, num_stages=3)
    return y.view(t, top_k, hidden).sum(1).to(x.dtype)
