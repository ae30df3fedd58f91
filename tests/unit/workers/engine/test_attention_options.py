"""Sliding windows, attention sinks and logit soft-capping in the paged attention paths (torch, static
metadata, Triton under its interpreter) against a dense reference: each sequence's whole keys and
values, a plain masked softmax written out."""

import pytest
import torch

from tests.support.triton_cpu import interpreted
from workers.engine.attention import AttentionMetadata, paged_attention_torch, tree_bitmasks, write_kv
from workers.speculation.tree import ancestor_mask, tree_depths

pytestmark = pytest.mark.unit

HEADS, KV_HEADS, DIM, BS = 4, 2, 16, 4


def dense(q, keys, values, query_pos, key_visible, scale, window, sinks, softcap):
    """q [q, H, D] at sequence positions ``query_pos`` [q]; keys/values [L, Hkv, D] of one sequence;
    ``key_visible`` [q, L] bool (causal or tree order) before the window."""
    group = HEADS // KV_HEADS
    k = keys.repeat_interleave(group, dim=1)  # [L, H, D]
    v = values.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,lhd->hql", q, k) * scale  # [H, q, L]
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = key_visible.clone()
    if window is not None:
        visible &= torch.arange(keys.shape[0])[None, :] > query_pos[:, None] - window
    scores = scores.masked_fill(~visible[None], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks[:, None, None].expand(-1, q.shape[0], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1)[..., : keys.shape[0]]
    return torch.einsum("hql,lhd->qhd", probs, v)


def scene(query_lens, context_lens, trees=None, seed=0):
    """Random caches, block tables and the step's q/k/v (written to the cache), plus the dense answer's
    inputs: per sequence (query rows, its keys/values in order, query positions, visibility)."""
    g = torch.Generator().manual_seed(seed)
    trees = trees or [None] * len(query_lens)
    need = [-(-c // BS) for c in context_lens]
    perm = torch.randperm(sum(need) + 3, generator=g).tolist()
    tables, at = [], 0
    for n in need:
        tables.append(perm[at : at + n])
        at += n
    num_blocks = sum(need) + 3
    k_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM, generator=g)
    v_cache = torch.randn(num_blocks, BS, KV_HEADS, DIM, generator=g)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, BS, "cpu", [t for t in trees])
    t = sum(query_lens)
    q = torch.randn(t, HEADS, DIM, generator=g)
    k = torch.randn(t, KV_HEADS, DIM, generator=g)
    v = torch.randn(t, KV_HEADS, DIM, generator=g)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    rows, start = [], 0
    for b, (ql, c) in enumerate(zip(query_lens, context_lens)):
        slots = torch.tensor([tables[b][p // BS] * BS + p % BS for p in range(c)])
        keys = k_cache.view(-1, KV_HEADS, DIM)[slots]
        values = v_cache.view(-1, KV_HEADS, DIM)[slots]
        key_pos = torch.arange(c)[None, :]
        cache_pos = torch.arange(c - ql, c)[:, None]
        visible = key_pos <= cache_pos
        query_pos = cache_pos[:, 0].clone()
        tree = trees[b]
        if tree is not None:
            m = tree.shape[1]
            visible[:, c - m :] = tree
            query_pos = c - m + tree.sum(1) - 1
        rows.append((slice(start, start + ql), keys, values, query_pos, visible))
        start += ql
    return q, k, v, k_cache, v_cache, meta, rows


def reference(q, rows, scale, window, sinks, softcap):
    out = torch.empty_like(q)
    for sl, keys, values, query_pos, visible in rows:
        out[sl] = dense(q[sl], keys, values, query_pos, visible, scale, window, sinks, softcap)
    return out


def static_of(meta):
    return AttentionMetadata.static(meta.slot_mapping, meta.block_tables, meta.token_seq, meta.token_pos, BS,
                                    meta.tree_base, meta.tree_bits)


SINKS = torch.tensor([0.5, -1.0, 2.0, 0.0])
OPTIONS = [dict(window=None, sinks=None, softcap=None), dict(window=5, sinks=None, softcap=None),
           dict(window=None, sinks=SINKS, softcap=None), dict(window=None, sinks=None, softcap=3.0),
           dict(window=3, sinks=SINKS, softcap=2.0), dict(window=1, sinks=None, softcap=None)]
# decode, verify, a prefill chunk after a prefix, a prefill from scratch, a long (> 32) chunk after a prefix
BATCHES = {"mixed": ([1, 4, 3, 6, 40], [9, 14, 11, 6, 45]), "decode": ([1, 1, 1], [7, 13, 2]),
           "one prefill": ([12], [12]), "one long prefill": ([40], [40]), "one decode": ([1], [10])}


@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v is not None and v}" for k, v in o.items()))
@pytest.mark.parametrize("batch", list(BATCHES), ids=str)
def test_torch_paths_match_dense_reference(batch, options):
    q, k, v, kc, vc, meta, rows = scene(*BATCHES[batch])
    want = reference(q, rows, 0.3, **options)
    assert (paged_attention_torch(q, k, v, kc, vc, meta, 0.3, **options) - want).abs().max() < 1e-5
    assert (paged_attention_torch(q, None, None, kc, vc, static_of(meta), 0.3, **options) - want).abs().max() < 1e-5


def test_defaults_are_todays_attention():
    """No window, no sinks, no cap: the same numbers as before the options existed (SDPA)."""
    q, k, v, kc, vc, meta, rows = scene(*BATCHES["mixed"], seed=3)
    assert torch.equal(paged_attention_torch(q, k, v, kc, vc, meta, 0.3),
                       paged_attention_torch(q, k, v, kc, vc, meta, 0.3, window=None, sinks=None, softcap=None))
    assert (paged_attention_torch(q, k, v, kc, vc, meta, 0.3) - reference(q, rows, 0.3, None, None, None)).abs().max() < 1e-5


def test_a_window_wider_than_every_context_changes_nothing():
    q, k, v, kc, vc, meta, _ = scene(*BATCHES["mixed"], seed=4)
    assert (paged_attention_torch(q, k, v, kc, vc, meta, 0.3, window=64)
            - paged_attention_torch(q, k, v, kc, vc, meta, 0.3)).abs().max() < 1e-6


def _tree_batch():
    parents = [-1, -1, 0, 0, 2]  # root, two children, two grandchildren, one great-grandchild
    verify = ancestor_mask(parents)  # [6, 6] over the tree's own keys, root first
    draft = torch.tensor([[1, 0, 1, 0], [0, 1, 0, 1]], dtype=torch.bool)  # a draft's frontier over 4 slots
    return [6, 1, 2], [15, 8, 12], [verify, None, draft]


@pytest.mark.parametrize("options", OPTIONS[1:], ids=lambda o: "-".join(f"{k}={v is not None and v}" for k, v in o.items()))
def test_token_trees_window_from_their_depth(options):
    """A tree's nodes sit in consecutive slots; the window counts back from each node's depth position."""
    q, k, v, kc, vc, meta, rows = scene(*_tree_batch(), seed=5)
    anchors = meta.window_anchor()
    assert anchors[:6].tolist() == [9 + d for d in [0] + tree_depths([-1, -1, 0, 0, 2])]
    assert anchors[6:].tolist() == [7, 9, 9]
    want = reference(q, rows, 0.3, **options)
    assert (paged_attention_torch(q, None, None, kc, vc, meta, 0.3, **options) - want).abs().max() < 1e-5
    assert (paged_attention_torch(q, None, None, kc, vc, static_of(meta), 0.3, **options) - want).abs().max() < 1e-5


def test_tree_bitmasks_anchor_for_rows_without_a_tree_is_their_position():
    base, bits = tree_bitmasks([2, 1], [5, 3], [None, torch.ones(1, 2, dtype=torch.bool)])
    meta = AttentionMetadata.static(torch.zeros(3, dtype=torch.long), torch.zeros(2, 2, dtype=torch.int32),
                                    torch.tensor([0, 0, 1], dtype=torch.int32),
                                    torch.tensor([3, 4, 2], dtype=torch.int32), BS, base, bits)
    assert meta.window_anchor().tolist() == [3, 4, 2]


@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("options", OPTIONS, ids=lambda o: "-".join(f"{k}={v is not None and v}" for k, v in o.items()))
def test_triton_kernel_matches_dense_reference(options, splits):
    with interpreted("workers.engine.triton_attention") as (mod,):
        q, _, _, kc, vc, meta, rows = scene([1, 4, 3, 6], [9, 14, 11, 6], seed=6)
        out = mod.paged_attention_triton(q, None, None, kc, vc, meta, 0.3, splits=splits, **options)
        assert (out - reference(q, rows, 0.3, **options)).abs().max() < 1e-5
        q, _, _, kc, vc, meta, rows = scene(*_tree_batch(), seed=7)
        out = mod.paged_attention_triton(q, None, None, kc, vc, meta, 0.3, splits=splits, **options)
        assert (out - reference(q, rows, 0.3, **options)).abs().max() < 1e-5
