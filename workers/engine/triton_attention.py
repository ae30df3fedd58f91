"""Paged attention as a Triton kernel (GPU; runs on CPU under ``TRITON_INTERPRET=1`` for tests).

One program per (query token, query head). A query at position ``pos`` of sequence ``b`` walks
the block table of ``b`` over keys 0..pos with an online softmax:

    m_new = max(m, max_j s_j)              s_j = q · k_j * scale, keys past pos masked to -inf
    acc   = acc * exp(m - m_new) + Σ_j exp(s_j - m_new) v_j
    l     = l   * exp(m - m_new) + Σ_j exp(s_j - m_new)
    out   = acc / l

Because every token carries its own causal limit, the same launch serves a decode step
(query_len 1), a multi-token verify step (query_len γ+1 at a sequence's end) and prefill chunks.
Drop-in replacement for :func:`workers.engine.attention.paged_attention_torch`.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .attention import AttentionMetadata


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, token_seq_ptr, token_pos_ptr, scale,
    stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    kv_head = h // GROUP
    seq = tl.load(token_seq_ptr + t)
    pos = tl.load(token_pos_ptr + t)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q = tl.load(q_ptr + t * stride_qt + h * stride_qh + d, mask=d_mask, other=0.0).to(tl.float32)  # [BLOCK_D]
    offs = tl.arange(0, BLOCK_SIZE)
    m = tl.full([], float("-inf"), tl.float32)
    l = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    num_blocks = pos // BLOCK_SIZE + 1
    for i in range(0, num_blocks):
        block = tl.load(block_tables_ptr + seq * stride_bt + i).to(tl.int64)
        base = block * stride_kb + offs[:, None] * stride_ks + kv_head * stride_kh + d[None, :]  # [BS, BLOCK_D]
        k = tl.load(k_cache_ptr + base, mask=d_mask[None, :], other=0.0).to(tl.float32)
        s = tl.sum(k * q[None, :], axis=1) * scale  # [BS]
        s = tl.where(i * BLOCK_SIZE + offs <= pos, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))
        p = tl.exp(s - m_new)  # [BS]
        alpha = tl.exp(m - m_new)
        v = tl.load(v_cache_ptr + base, mask=d_mask[None, :], other=0.0).to(tl.float32)
        acc = acc * alpha + tl.sum(p[:, None] * v, axis=0)
        l = l * alpha + tl.sum(p, axis=0)
        m = m_new
    out = acc / l
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d_mask)


def paged_attention_triton(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D]; k/v [T, Hkv, D] (already in the cache); caches [num_blocks, bs, Hkv, D] → [T, H, D]."""
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    out = torch.empty_like(q)
    if num_tokens == 0:
        return out
    block_tables = meta.block_tables
    grid = (num_tokens, num_heads)
    _paged_attention_kernel[grid](
        out, q, k_cache, v_cache, block_tables, meta.token_seq, meta.token_pos, scale,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        GROUP=num_heads // num_kv_heads, BLOCK_SIZE=k_cache.shape[1], HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim),
    )
    return out
