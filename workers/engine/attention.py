"""Paged attention over a flat batch of tokens from many sequences (torch SDPA path).

Every forward call covers B sequences; sequence b contributes ``query_lens[b]`` new tokens at the
end of its ``context_lens[b]`` tokens (context = cached + new). This one shape serves prefill
chunks, decode (query_len 1) and multi-token verify (query_len γ+1). The new keys and values are
written into the paged cache first (``slot_mapping``), then every query attends causally to its
sequence's cache through the block table.

Cache layout per layer: ``k``/``v`` of shape [num_blocks, block_size, num_kv_heads, head_dim];
token at position p of a sequence lives in slot ``block_table[p // bs] * bs + p % bs``.
Short queries (decode / verify) are padded into one batched SDPA call with a mask; long prefill
chunks get one SDPA call each.

A *tree* row (speculative verification of a token tree, :mod:`workers.speculation.tree`) brings a
[q, q] mask over its own new tokens: each new token sees the whole context before them, and of the
new tokens only those its mask allows (itself and its ancestors), instead of every earlier one.

*Static* metadata (:meth:`AttentionMetadata.static`, for CUDA graphs) holds tensors only: every
token's sequence row, position and slot. The Triton kernel reads nothing else; the torch path then
gathers each token's keys through its block table (a reference, for tests on CPU).

Per-layer options of the attention functions, all off by default:

- ``window`` W (sliding-window attention, Mistral / Gemma 3 local layers / gpt-oss): a token at
  sequence position p sees only keys p - W < j <= p (transformers' ``sliding_window_overlay``). The
  cache keeps every key; the window is a mask (and, for long chunks, a cut of the keys read). A
  token of a tree sits at cache index >= its sequence position; :meth:`AttentionMetadata.window_anchor`
  gives the sequence position the window counts back from.
- ``sinks`` [H] (gpt-oss): a learned logit per query head that joins the softmax's denominator and
  carries no value: ``o = Σ_j e^{s_j} v_j / (e^{sink} + Σ_j e^{s_j})``.
- ``softcap`` c (Gemma 2's attention logit soft-capping): scores become ``c · tanh(s / c)`` before the mask.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

BATCHED_MAX_QUERY = 32  # queries up to this length share one padded SDPA call


@dataclass
class AttentionMetadata:
    """Per-step attention inputs, built once and shared by all layers."""

    block_size: int
    query_lens: list[int]
    context_lens: list[int]
    slot_mapping: torch.Tensor  # [T] long: cache slot of each new token
    block_tables: torch.Tensor  # [B, max_blocks] int32 (padding 0)
    token_seq: torch.Tensor  # [T] int32: which sequence (row of block_tables) each token belongs to
    token_pos: torch.Tensor  # [T] int32: each token's position (it attends to keys 0..pos)
    # batched group: sequences with short queries, padded to [Bg, qmax]
    batch_rows: list[int] = field(default_factory=list)
    batch_token_index: torch.Tensor | None = None  # [Nb] flat token index of each group token
    batch_pad_index: torch.Tensor | None = None  # [Nb] index into the padded [Bg * qmax] queries
    batch_blocks: torch.Tensor | None = None  # [Bg * nb] block ids, nb = blocks of the longest context
    batch_mask: torch.Tensor | None = None  # [Bg, 1, qmax, nb * bs] bool, True = attend; None: attend to all
    batch_kv_len: int = 0  # longest context in the group
    batch_causal: bool = False  # no mask, one sequence whose queries are its whole context
    qmax: int = 0
    # long queries, one call each: (row, token start, query_len, context_len)
    singles: list[tuple[int, int, int, int]] = field(default_factory=list)
    single_blocks: list[torch.Tensor | None] = field(default_factory=list)  # [nb] block ids, None: no prefix
    tensors_only: bool = False  # no host-side lengths (CUDA-graph safe): see :meth:`static`
    has_tree: bool = False  # some row attends by a tree mask
    # Tree masks per token, for kernels that read tensors only (the Triton path): a token sees every
    # key before tree_base[t] (up to its own position), and key tree_base[t] + j only if bit j % 32
    # of tree_bits[t, j // 32] is set. Tokens of rows without a tree have tree_base = position + 1.
    tree_base: torch.Tensor | None = None  # [T] int32
    tree_bits: torch.Tensor | None = None  # [T, W] int32, W = ceil(longest mask width / 32)
    # sliding windows, built on first use and shared by the layers of one forward
    _anchor: torch.Tensor | None = None  # [T] int32, see window_anchor
    _window_masks: dict = field(default_factory=dict)  # window -> batched group's mask
    _trees: list = field(default_factory=list)  # the build's tree masks (for the window masks)

    @property
    def num_tokens(self) -> int:
        return int(self.slot_mapping.shape[0])

    def window_anchor(self) -> torch.Tensor:
        """[T] int32: each token's position in its sequence, where a sliding window counts back from.

        ``token_pos`` (its cache index) except in a token tree, whose nodes sit in consecutive slots
        but at their depth's position: there it is ``tree_base`` + (keys its tree bits allow, itself
        and its ancestors) - 1, for the verifier's trees (bits from the root on) and a draft's (from
        the root's first child on, the root being context) alike. Tensor ops only (CUDA-graph safe).
        """
        if self.tree_bits is None:
            return self.token_pos
        if self._anchor is None:
            words = self.tree_bits.long() & 0xFFFFFFFF  # [T, W] as unsigned
            shifts = torch.arange(32, device=words.device)
            count = ((words[:, :, None] >> shifts) & 1).sum((1, 2))  # [T] bits set
            self._anchor = (self.tree_base.long() + count - 1).to(torch.int32)
        return self._anchor

    @classmethod
    def build(cls, query_lens: list[int], context_lens: list[int], block_tables: list[list[int]],
              block_size: int, device: torch.device | str = "cpu",
              tree_masks: list[torch.Tensor | None] | None = None) -> AttentionMetadata:
        """Inputs for one step; ``block_tables[b]`` must cover ``context_lens[b]`` tokens.

        ``tree_masks[b]`` ([q_b, m] bool with q_b <= m <= context_lens[b], or None: causal) says which
        of row b's last m keys each of its new tokens sees (the keys before those, all of them):
        m = q_b for a tree verified in one pass; a draft growing a tree depth by depth also masks
        the tree nodes of earlier passes. With any tree, every row reads its keys from the cache (none from this step's
        own k/v), so attention functions that write the cache first can fall back to this path.
        """
        if not (len(query_lens) == len(context_lens) == len(block_tables)):
            raise ValueError("query_lens, context_lens and block_tables must have one entry per sequence")
        max_blocks = max((len(bt) for bt in block_tables), default=1) or 1
        tables = torch.zeros(len(block_tables), max_blocks, dtype=torch.long)
        for b, bt in enumerate(block_tables):
            if len(bt) * block_size < context_lens[b] or not 0 < query_lens[b] <= context_lens[b]:
                raise ValueError(f"sequence {b}: bad lengths or block table too short")
            tables[b, : len(bt)] = torch.tensor(bt, dtype=torch.long)
        offsets = torch.arange(block_size)
        all_slots = (tables[:, :, None] * block_size + offsets).view(len(block_tables), -1)  # [B, max_blocks * bs]
        slot_parts, starts, token_seq, token_pos = [], [0], [], []
        for b, (q, c) in enumerate(zip(query_lens, context_lens)):
            slot_parts.append(all_slots[b, c - q : c])
            starts.append(starts[-1] + q)
            token_seq.extend([b] * q)
            token_pos.extend(range(c - q, c))
        meta = cls(
            block_size=block_size,
            query_lens=list(query_lens),
            context_lens=list(context_lens),
            slot_mapping=torch.cat(slot_parts).to(device),
            block_tables=tables.to(device=device, dtype=torch.int32),
            token_seq=torch.tensor(token_seq, dtype=torch.int32, device=device),
            token_pos=torch.tensor(token_pos, dtype=torch.int32, device=device),
        )
        trees = tree_masks or [None] * len(query_lens)
        meta.has_tree = any(t is not None for t in trees)
        meta._trees = list(trees)
        rows = [b for b, q in enumerate(query_lens) if q <= BATCHED_MAX_QUERY or trees[b] is not None]
        for b, q in enumerate(query_lens):
            if q > BATCHED_MAX_QUERY and trees[b] is None:
                c = context_lens[b]
                meta.singles.append((b, starts[b], q, c))
                from_cache = c != q or meta.has_tree
                meta.single_blocks.append(tables[b, : -(-c // block_size)].to(device) if from_cache else None)
        if rows:
            meta._build_batched(rows, starts, tables, device, trees)
        if meta.has_tree:
            meta.tree_base, meta.tree_bits = tree_bitmasks(query_lens, context_lens, trees, device)
        return meta

    @classmethod
    def static(cls, slot_mapping: torch.Tensor, block_tables: torch.Tensor, token_seq: torch.Tensor,
               token_pos: torch.Tensor, block_size: int, tree_base: torch.Tensor | None = None,
               tree_bits: torch.Tensor | None = None) -> AttentionMetadata:
        """Metadata from tensors only (slot_mapping [T] long, block_tables [B, max_blocks] int32,
        token_seq / token_pos [T] int32; for token trees tree_base [T] and tree_bits [T, W] int32, see
        the fields), valid for any lengths they describe: CUDA-graph safe."""
        return cls(block_size=block_size, query_lens=[], context_lens=[], slot_mapping=slot_mapping,
                   block_tables=block_tables, token_seq=token_seq, token_pos=token_pos, tensors_only=True,
                   has_tree=tree_bits is not None, tree_base=tree_base, tree_bits=tree_bits)

    def _build_batched(self, rows: list[int], starts: list[int], tables: torch.Tensor, device,
                       trees: list[torch.Tensor | None]) -> None:
        q_lens = torch.tensor([self.query_lens[b] for b in rows])
        c_lens = torch.tensor([self.context_lens[b] for b in rows])
        qmax, lmax = int(q_lens.max()), int(c_lens.max())
        num_blocks = -(-lmax // self.block_size)
        token_index, pad_index = [], []
        for g, b in enumerate(rows):
            q = self.query_lens[b]
            token_index.extend(range(starts[b], starts[b] + q))
            pad_index.extend(range(g * qmax, g * qmax + q))
        self.batch_rows = rows
        self.qmax = qmax
        self.batch_kv_len = lmax
        self.batch_token_index = torch.tensor(token_index, dtype=torch.long, device=device)
        self.batch_pad_index = torch.tensor(pad_index, dtype=torch.long, device=device)
        self.batch_blocks = tables[rows, :num_blocks].flatten().to(device)
        if len(rows) == 1 and (qmax == 1 or qmax == lmax) and not self.has_tree:
            # one sequence, decoding (sees its whole context) or prefilling from scratch (plain causal)
            self.batch_causal = qmax > 1
            return
        self.batch_mask = self._group_mask(None)

    def batch_window_mask(self, window: int) -> torch.Tensor:
        """The batched group's mask (as ``batch_mask``, never None) with a sliding window of
        ``window`` keys; built once per window and metadata."""
        mask = self._window_masks.get(window)
        if mask is None:
            mask = self._window_masks[window] = self._group_mask(window)
        return mask

    def _group_mask(self, window: int | None) -> torch.Tensor:
        """[Bg, 1, qmax, nb * bs] bool over the batched group's padded keys, True = attend: causal (or
        a row's tree mask over its last keys), optionally within a sliding window. Padding queries
        copy their row's last query (so no row of the mask is empty)."""
        rows = self.batch_rows
        q_lens = torch.tensor([self.query_lens[b] for b in rows])
        c_lens = torch.tensor([self.context_lens[b] for b in rows])
        key_pos = torch.arange(self.batch_blocks.numel() // len(rows) * self.block_size)[None, None, :]  # [1, 1, Lpad]
        offsets = torch.minimum(torch.arange(self.qmax)[None, :], (q_lens - 1)[:, None])
        query_pos = (c_lens - q_lens)[:, None] + offsets  # [Bg, qmax]
        mask = (key_pos <= query_pos[:, :, None]) & (key_pos < c_lens[:, None, None])  # [Bg, qmax, Lpad]
        anchor = query_pos.clone()  # each query's sequence position
        for g, b in enumerate(rows):
            tree = self._trees[b] if self._trees else None
            if tree is not None:  # over the last m keys, the tree mask instead of causal order
                q, c, m = self.query_lens[b], self.context_lens[b], tree.shape[1]
                tree = tree.to("cpu", torch.bool)
                mask[g, :q, c - m : c] = tree
                anchor[g, :q] = c - m + tree.sum(1) - 1
        if window is not None:
            mask &= key_pos > (anchor - window)[:, :, None]
        return mask[:, None].to(self.batch_blocks.device)


def tree_bitmasks(query_lens: list[int], context_lens: list[int], trees: list[torch.Tensor | None],
                  device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token (tree_base [T] int32, tree_bits [T, W] int32) for :class:`AttentionMetadata` (see
    its fields): row b's tree mask [q_b, m] covers its last m keys; rows without a tree get
    tree_base past their own position, so nothing is masked beyond causal order."""
    width = max((t.shape[1] for t in trees if t is not None), default=1)
    words = -(-width // 32)
    base, bits = [], []
    for q, c, tree in zip(query_lens, context_lens, trees):
        if tree is None:
            base.extend(range(c - q + 1, c + 1))
            bits.append(torch.zeros(q, words, dtype=torch.int64))
            continue
        m = tree.shape[1]
        base.extend([c - m] * q)
        padded = torch.zeros(q, words * 32, dtype=torch.int64)
        padded[:, :m] = tree.to("cpu", torch.int64)
        packed = (padded.view(q, words, 32) << torch.arange(32)).sum(-1)  # [q, W] in 0 .. 2^32 - 1
        bits.append(torch.where(packed >= 2 ** 31, packed - 2 ** 32, packed))  # as signed 32-bit words
    return (torch.tensor(base, dtype=torch.int32, device=device),
            torch.cat(bits).to(device=device, dtype=torch.int32))


def allocate_kv_cache(num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, device: torch.device | str) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """One (k, v) pair per layer, each [num_blocks, block_size, num_kv_heads, head_dim]."""
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    return [(torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(num_layers)]


def write_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store new keys/values [T, Hkv, D] at their slots."""
    hkv, d = k.shape[1], k.shape[2]
    k_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, hkv, d).index_copy_(0, slot_mapping, v)


def paged_attention_torch(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor,
                          v_cache: torch.Tensor, meta: AttentionMetadata, scale: float, *, window: int | None = None,
                          sinks: torch.Tensor | None = None, softcap: float | None = None) -> torch.Tensor:
    """Causal attention of new queries over each sequence's cache; k/v already written.

    q [T, H, D]; k, v [T, Hkv, D] (this step's keys, used directly for prefill without prefix; may be
    None when the metadata has a tree, which reads every key from the cache); returns [T, H, D].
    ``window``, ``sinks`` [H] and ``softcap``: see the module docstring (None: off).
    """
    if meta.tensors_only:
        return _static_attention(q, k_cache, v_cache, meta, scale, window, sinks, softcap)
    num_heads, head_dim = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    out = torch.empty_like(q)
    if meta.batch_rows:
        bg, qmax, bs = len(meta.batch_rows), meta.qmax, meta.block_size
        if bg == q.shape[0] and qmax == 1:
            qp = q[:, None]  # every token is one sequence's decode query, in order: [B, 1, H, D]
        else:
            qp = q.new_zeros(bg * qmax, num_heads, head_dim)
            qp[meta.batch_pad_index] = q[meta.batch_token_index]
            qp = qp.view(bg, qmax, num_heads, head_dim)
        keys = k_cache.index_select(0, meta.batch_blocks).view(bg, -1, hkv, head_dim)  # [Bg, Lpad, Hkv, D]
        values = v_cache.index_select(0, meta.batch_blocks).view(bg, -1, hkv, head_dim)
        mask, causal = meta.batch_mask, meta.batch_causal
        if window is not None:
            mask, causal = meta.batch_window_mask(window), False
        if mask is None:
            keys, values = keys[:, : meta.batch_kv_len], values[:, : meta.batch_kv_len]
        o = _attend(qp.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), mask, causal, scale, sinks,
                    softcap)  # [Bg, H, qmax, D]
        o = o.transpose(1, 2).reshape(bg * qmax, num_heads, head_dim)
        if bg == q.shape[0] and qmax == 1:
            out = o
        else:
            out[meta.batch_token_index] = o[meta.batch_pad_index]
    for (_, start, qlen, ctx), blocks in zip(meta.singles, meta.single_blocks):
        qs = q[start : start + qlen].transpose(0, 1)[None]  # [1, H, q, D]
        if blocks is None:  # whole context is new: this step's keys
            keys = k[start : start + qlen].transpose(0, 1)[None]  # [1, Hkv, ctx, D]
            values = v[start : start + qlen].transpose(0, 1)[None]
        else:
            keys = k_cache.index_select(0, blocks).view(-1, hkv, head_dim)[:ctx].transpose(0, 1)[None]  # [1, Hkv, ctx, D]
            values = v_cache.index_select(0, blocks).view(-1, hkv, head_dim)[:ctx].transpose(0, 1)[None]
        if window is None and blocks is None:  # plain causal attention
            o = _attend(qs, keys, values, None, True, scale, sinks, softcap)
        else:
            first = 0 if window is None else max(0, ctx - qlen + 1 - window)  # no query sees a key before it
            query_pos = ctx - qlen + torch.arange(qlen, device=q.device)[:, None]  # [q, 1]
            key_pos = torch.arange(first, ctx, device=q.device)[None, :]  # [1, ctx - first]
            mask = key_pos <= query_pos
            if window is not None:
                mask &= key_pos > query_pos - window
            o = _attend(qs, keys[:, :, first:], values[:, :, first:], mask, False, scale, sinks, softcap)
        out[start : start + qlen] = o[0].transpose(0, 1)
    return out


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, causal: bool, scale: float,
            sinks: torch.Tensor | None, softcap: float | None) -> torch.Tensor:
    """q [B, H, Lq, D], k/v [B, Hkv, Lk, D], mask broadcastable to [B, H, Lq, Lk] (True = attend) or
    None, ``causal``: query i sees keys 0..i. SDPA when there are no sinks and no soft-capping; else
    the softmax written out (float32 scores), as transformers' eager attention does."""
    gqa = q.shape[1] != k.shape[1]
    if sinks is None and softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
    if gqa:
        group = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale  # [B, H, Lq, Lk]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if causal:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is not None:  # one more column per head, dropped after the softmax
        sink = sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    return torch.matmul(probs.to(v.dtype), v)


def _static_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                      scale: float, window: int | None = None, sinks: torch.Tensor | None = None,
                      softcap: float | None = None) -> torch.Tensor:
    """Reference for static metadata: each token attends to keys 0..token_pos of its row's blocks,
    within a token tree only to those its tree bits allow, within a window only to the last
    ``window`` positions (see :class:`AttentionMetadata`).

    q [T, H, D] → [T, H, D]. Gathers [T, max_blocks · bs] keys per token: for tests, not speed.
    """
    num_tokens, num_heads, head_dim = q.shape
    hkv = k_cache.shape[2]
    tables = meta.block_tables.long()[meta.token_seq.long()]  # [T, max_blocks]
    keys = k_cache[tables].view(num_tokens, -1, hkv, head_dim).transpose(1, 2)  # [T, Hkv, L, D]
    values = v_cache[tables].view(num_tokens, -1, hkv, head_dim).transpose(1, 2)
    key_pos = torch.arange(keys.shape[2], device=q.device)[None, :]  # [1, L]
    mask = key_pos <= meta.token_pos.long()[:, None]  # [T, L]
    if meta.tree_bits is not None:  # key tree_base + j is seen only if bit j is set
        width = 32 * meta.tree_bits.shape[1]
        rel = key_pos - meta.tree_base.long()[:, None]  # [T, L]
        inside = (rel >= 0) & (rel < width)
        rel = rel.clamp(0, width - 1)
        words = meta.tree_bits.long().gather(1, rel // 32)  # [T, L] (sign-extended: bit 31 kept)
        mask &= ~inside | ((words >> (rel % 32)) & 1).bool()
    if window is not None:
        mask &= key_pos > meta.window_anchor().long()[:, None] - window
    o = _attend(q[:, :, None], keys, values, mask[:, None, None], False, scale, sinks, softcap)  # [T, H, 1, D]
    return o[:, :, 0]


paged_attention_torch.static_capable = True  # handles static metadata too (the gather reference)
