"""Paged attention as a Triton kernel (GPU; runs on CPU under ``TRITON_INTERPRET=1`` for tests).

One program per (query token, KV head, split). The program takes the GROUP query heads that share
the KV head as one [GROUP, D] block (GQA: each key is read once for the whole group) and walks its
sequence's keys 0..pos in tiles of TILE keys, gathered through the block table, with an online
softmax and two matrix products per tile (FlashAttention):

    s      = q kᵀ · scale                  [GROUP, TILE], keys past pos masked to -inf
    m_new  = max(m, rowmax s)
    acc    = acc · exp(m - m_new) + exp(s - m_new) v
    l      = l   · exp(m - m_new) + rowsum exp(s - m_new)
    out    = acc / l

Because every token carries its own causal limit, the same launch serves a decode step
(query_len 1), a multi-token verify step (query_len γ+1 at a sequence's end) and prefill chunks.
It reads only tensors (``block_tables``, ``token_seq``, ``token_pos``), never host-side lengths,
so a launch can be captured in a CUDA graph and replayed for any context lengths.

Token trees (``meta.has_tree``: a verify pass over a draft tree, or a draft growing one) add a
per-token bitmask over the tree's keys: a token sees every key before its ``tree_base`` and, from
there up to its own position, only the keys whose bit is set (its ancestors and itself), one bit
per key in 32-bit words (``tree_bits``). A tile can then be wholly masked, so the online softmax
guards ``m = -inf`` (no key seen yet) instead of relying on key 0 coming first.

Split-KV (flash-decoding): when T · num_kv_heads programs would leave most of the GPU idle (small
decode batches), each (token, head) is split S ways over its key tiles (split s takes tiles s,
s+S, s+2S, ...); every split writes its (m, l, acc) and a second kernel merges them:
out = Σ_s e^{m_s - M} acc_s / Σ_s e^{m_s - M} l_s with M = max_s m_s. S depends only on the shapes,
so it is fixed for a captured graph and any context length still works.

Per-layer options, as :func:`workers.engine.attention.paged_attention_torch` takes them:

- ``window`` W: keys before the token's sequence position - W + 1 are masked, and the tile loop
  starts at the tile holding the first key in the window (a window's cost, not the context's). The
  position is ``meta.window_anchor()`` (token_pos outside token trees).
- ``sinks`` [H]: the finished softmax's denominator gains e^{sink}: with M = max(m, sink),
  out = acc·e^{m-M} / (l·e^{m-M} + e^{sink-M}); split-KV adds it once, in the merge.
- ``softcap`` c: s = c · tanh(s / c) on the scaled scores (tanh written with exp, which the
  interpreter has).

Drop-in replacement for :func:`workers.engine.attention.paged_attention_torch` (``k`` and ``v``
are unused: the step's keys are already in the cache).
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from .attention import AttentionMetadata

MAX_SPLITS = 16


@triton.jit
def _paged_attention_kernel(
    out_ptr, part_ptr, stats_ptr, q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, token_seq_ptr, token_pos_ptr,
    tree_base_ptr, tree_bits_ptr, anchor_ptr, sinks_ptr,
    scale, softcap, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_kb, stride_ks, stride_kh, stride_bt,
    stride_tb,
    NUM_HEADS: tl.constexpr, GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, PAGE: tl.constexpr,
    TILE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, NUM_SPLITS: tl.constexpr,
    IEEE: tl.constexpr, TREE: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr, SOFTCAP: tl.constexpr,
):
    t = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(token_seq_ptr + t).to(tl.int64)
    pos = tl.load(token_pos_ptr + t)
    g = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + g  # [GP]
    g_mask = g < GROUP
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    q_mask = g_mask[:, None] & d_mask[None, :]
    q = tl.load(q_ptr + t * stride_qt + heads[:, None] * stride_qh + d[None, :], mask=q_mask, other=0.0)  # [GP, BD]
    n = tl.arange(0, TILE)
    m_i = tl.full([GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([GROUP_PAD], tl.float32)
    acc = tl.zeros([GROUP_PAD, BLOCK_D], tl.float32)
    num_tiles = pos // TILE + 1
    first_tile = 0
    if WINDOW:  # keys from the anchor's position - window + 1 on
        lowest = tl.load(anchor_ptr + t) - window + 1
        first_tile = tl.maximum(lowest, 0) // TILE
    if TREE:
        tree_base = tl.load(tree_base_ptr + t)
    for tile in range(first_tile + split, num_tiles, NUM_SPLITS):
        key = tile * TILE + n  # [TILE] key positions
        valid = key <= pos
        if WINDOW:
            valid = valid & (key >= lowest)
        if TREE:  # past tree_base, only the keys whose bit is set
            rel = key - tree_base
            in_tree = valid & (rel >= 0)
            word = tl.load(tree_bits_ptr + t * stride_tb + rel // 32, mask=in_tree, other=0)
            valid = valid & ((rel < 0) | (((word >> (rel % 32)) & 1) != 0))
        block = tl.load(block_tables_ptr + seq * stride_bt + key // PAGE, mask=valid, other=0).to(tl.int64)
        offs = block[:, None] * stride_kb + (key % PAGE)[:, None] * stride_ks + kv_head * stride_kh + d[None, :]
        kv_mask = valid[:, None] & d_mask[None, :]
        k = tl.load(k_cache_ptr + offs, mask=kv_mask, other=0.0)  # [TILE, BD]
        if IEEE:
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))
        s = s * scale
        if SOFTCAP:  # c · tanh(s / c), tanh(x) = 1 - 2 / (e^{2x} + 1)
            s = softcap * (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0))
        s = tl.where(valid[None, :], s, float("-inf"))  # [GP, TILE]
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if TREE:  # every key so far masked: keep the state at zero (exp(-inf - -inf) would be nan)
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + offs, mask=kv_mask, other=0.0)  # [TILE, BD]
        if IEEE:
            pv = tl.dot(p.to(v.dtype), v, input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    if NUM_SPLITS == 1:
        if SINKS:  # the sink's e^{sink} joins the denominator, both rescaled to max(m, sink)
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
            m_all = tl.maximum(m_i, sink)
            alpha = tl.exp(m_i - m_all)
            acc = acc * alpha[:, None]
            l_i = l_i * alpha + tl.exp(sink - m_all)
        out = acc / l_i[:, None]
        tl.store(out_ptr + t * stride_ot + heads[:, None] * stride_oh + d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:  # this split's partial result; an empty split leaves m = -inf, l = 0, acc = 0
        part = (t * NUM_HEADS + heads) * NUM_SPLITS + split  # [GP]
        tl.store(part_ptr + part[:, None] * BLOCK_D + d[None, :], acc, mask=g_mask[:, None])
        tl.store(stats_ptr + part * 2, tl.where(l_i > 0, m_i, float("-inf")), mask=g_mask)  # empty: -inf
        tl.store(stats_ptr + part * 2 + 1, l_i, mask=g_mask)


@triton.jit
def _merge_splits_kernel(
    out_ptr, part_ptr, stats_ptr, sinks_ptr, stride_ot, stride_oh,
    NUM_HEADS: tl.constexpr, NUM_SPLITS: tl.constexpr, SPLITS_PAD: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr, SINKS: tl.constexpr,
):
    t = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, SPLITS_PAD)
    s_mask = s < NUM_SPLITS
    part = (t * NUM_HEADS + h) * NUM_SPLITS + s  # [SP]
    m = tl.load(stats_ptr + part * 2, mask=s_mask, other=float("-inf"))
    l = tl.load(stats_ptr + part * 2 + 1, mask=s_mask, other=0.0)
    # split 0 always sees a key (key 0, or a window's first: trees start after it or at it): M finite
    m_max = tl.max(m, 0)
    if SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_max = tl.maximum(m_max, sink)
    w = tl.exp(m - m_max)  # [SP]
    d = tl.arange(0, BLOCK_D)
    acc = tl.load(part_ptr + part[:, None] * BLOCK_D + d[None, :], mask=s_mask[:, None], other=0.0)  # [SP, BD]
    denominator = tl.sum(l * w, 0)
    if SINKS:
        denominator += tl.exp(sink - m_max)
    out = tl.sum(acc * w[:, None], 0) / denominator
    tl.store(out_ptr + t * stride_ot + h * stride_oh + d, out.to(out_ptr.dtype.element_ty), mask=d < HEAD_DIM)


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def num_splits(num_tokens: int, num_kv_heads: int, max_keys: int, tile: int, device: torch.device) -> int:
    """Splits per (token, KV head): enough programs to fill the GPU twice over, at most one per tile."""
    programs = num_tokens * num_kv_heads
    sms = _num_sms(device.index or 0) if device.type == "cuda" else 8
    if programs >= sms:
        return 1
    return max(1, min(MAX_SPLITS, -(-2 * sms // programs), -(-max_keys // tile)))


def paged_attention_triton(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, k_cache: torch.Tensor,
                           v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                           splits: int | None = None, *, window: int | None = None,
                           sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """q [T, H, D] (any strides with unit last stride); caches [num_blocks, bs, Hkv, D] → [T, H, D].

    ``k``/``v`` (this step's keys, already written to the cache) are not read. ``splits`` overrides
    the split-KV choice (tests). Token trees (``meta.has_tree``) apply their per-token bitmasks.
    ``window``, ``sinks`` [H] (contiguous), ``softcap``: see the module docstring (None: off).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads, page = k_cache.shape[2], k_cache.shape[1]
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    tile = 64 if q.is_cuda else 16  # the interpreter is slow per element: small tiles for tests
    block_tables = meta.block_tables
    if splits is None:
        keys = block_tables.shape[1] * page if window is None else min(window, block_tables.shape[1] * page)
        splits = num_splits(num_tokens, num_kv_heads, keys, tile, q.device)
    if splits > 1:
        part = torch.empty(num_tokens * num_heads * splits, block_d, dtype=torch.float32, device=q.device)
        stats = torch.empty(num_tokens * num_heads * splits, 2, dtype=torch.float32, device=q.device)
    else:
        part = stats = out  # not touched
    tree = meta.tree_bits is not None
    tree_base, tree_bits = (meta.tree_base, meta.tree_bits) if tree else (meta.token_pos, meta.token_pos[:, None])
    anchor = meta.window_anchor() if window is not None else meta.token_pos
    sinks_arg = sinks if sinks is not None else out  # not read without SINKS
    _paged_attention_kernel[(num_tokens, num_kv_heads, splits)](
        out, part, stats, q, k_cache, v_cache, block_tables, meta.token_seq, meta.token_pos, tree_base, tree_bits,
        anchor, sinks_arg, scale, float(softcap or 0.0), int(window or 0), q.stride(0), q.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        tree_bits.stride(0),
        NUM_HEADS=num_heads, GROUP=group, GROUP_PAD=max(16, triton.next_power_of_2(group)), PAGE=page, TILE=tile,
        HEAD_DIM=head_dim, BLOCK_D=block_d, NUM_SPLITS=splits, IEEE=q.dtype == torch.float32, TREE=tree,
        WINDOW=window is not None, SINKS=sinks is not None and splits == 1, SOFTCAP=softcap is not None,
    )
    if splits > 1:
        _merge_splits_kernel[(num_tokens, num_heads)](
            out, part, stats, sinks_arg, out.stride(0), out.stride(1), NUM_HEADS=num_heads, NUM_SPLITS=splits,
            SPLITS_PAD=triton.next_power_of_2(splits), HEAD_DIM=head_dim, BLOCK_D=block_d, SINKS=sinks is not None,
        )
    return out


paged_attention_triton.static_capable = True  # reads only tensors: usable under CUDA graphs
paged_attention_triton.reads_cache_only = True  # k / v unused: the fused rotary kernel need not return them
