"""The Triton paged-attention kernel against the torch SDPA path.

Without CUDA the kernel runs under Triton's interpreter (``TRITON_INTERPRET=1``, set before the
kernel module is imported; tiny shapes because the interpreter is slow). With CUDA the same tests run
the compiled kernel, and the ``gpu`` test adds real head sizes and bf16.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # set only without CUDA: it would turn every later kernel into the interpreter's

from workers.engine.attention import AttentionMetadata, paged_attention_torch, write_kv  # noqa: E402

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def compare(device: str, head_dim: int, seed: int = 0, splits: int | None = None,
            dtype: torch.dtype = torch.float32) -> float:
    """Max abs difference between the two paths on a decode + verify + prefill-chunk batch."""
    from workers.engine.triton_attention import paged_attention_triton

    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, block_size, num_blocks = 4, 2, 4, 12
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    # decode (1 new of 7), verify (γ+1 = 4 new of 10), prefill chunk with prefix (3 new of 5)
    query_lens, context_lens = [1, 4, 3], [7, 10, 5]
    tables = [[3, 7], [0, 9, 5], [11, 2]]
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, device)
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, generator=g).to(device, dtype)
    k = torch.randn(t, kv_heads, head_dim, generator=g).to(device, dtype)
    v = torch.randn(t, kv_heads, head_dim, generator=g).to(device, dtype)
    write_kv(k_cache, v_cache, k, v, meta.slot_mapping)
    scale = head_dim ** -0.5
    ref = paged_attention_torch(q.float(), k.float(), v.float(), k_cache.float(), v_cache.float(), meta, scale)
    out = paged_attention_triton(q, k, v, k_cache, v_cache, meta, scale, splits=splits)
    return float((out.float() - ref).abs().max())


@pytest.mark.parametrize("head_dim", [16, 24])
def test_kernel_matches_torch(head_dim):
    assert compare(DEVICE, head_dim) < 1e-5


@pytest.mark.parametrize("splits", [2, 3])
def test_split_kv_matches_torch(splits):
    """Flash-decoding splits (some of them empty for the short contexts) merge to the same result."""
    assert compare(DEVICE, 16, splits=splits) < 1e-5


def test_model_forward_with_triton_attention_matches_torch(tmp_path):
    from tests.support.tiny_models import tiny_hf_model
    from workers.engine.attention import allocate_kv_cache
    from workers.engine.triton_attention import paged_attention_triton
    from workers.engine.weights import load_model

    tiny_hf_model("llama", tmp_path, layers=1)
    results = []
    for fn in (None, paged_attention_triton):
        model = load_model(tmp_path, attention_fn=fn, device=DEVICE)
        cfg = model.cfg
        kv = allocate_kv_cache(1, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, DEVICE)
        ids = torch.arange(6, device=DEVICE) * 7
        pos = torch.arange(6, device=DEVICE)
        with torch.inference_mode():
            model(ids[:4], pos[:4], AttentionMetadata.build([4], [4], [[2, 5]], 4, DEVICE), kv)
            step = AttentionMetadata.build([2], [6], [[2, 5]], 4, DEVICE)
            results.append(model(ids[4:], pos[4:], step, kv).logits)
    assert (results[0] - results[1]).abs().max() < 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("splits", [None, 1, 4])
def test_kernel_matches_torch_on_cuda_at_real_head_sizes(head_dim, splits):
    assert compare("cuda", head_dim, splits=splits) < 1e-4
    assert compare("cuda", head_dim, splits=splits, dtype=torch.bfloat16) < 3e-2  # bf16 inputs, float32 softmax
    assert compare_trees("cuda", head_dim, splits=splits) < 1e-4
    assert compare_trees("cuda", head_dim, splits=splits, dtype=torch.bfloat16) < 3e-2


def compare_trees(device: str, head_dim: int, splits: int | None = None, seed: int = 0,
                  dtype: torch.dtype = torch.float32) -> float:
    """Max abs difference between the two paths on a batch with token trees: a verify tree of 37
    nodes (two 32-bit mask words, and whole key tiles of non-ancestors), a draft-style row whose
    mask also covers an earlier pass's slots (m > q), a decode row and a chain verify row."""
    from workers.speculation.tree import ancestor_mask
    from workers.engine.triton_attention import paged_attention_triton

    g = torch.Generator().manual_seed(seed)
    rng = __import__("random").Random(seed)
    heads, kv_heads, block_size = 4, 2, 4
    parents = [-1]
    for i in range(1, 36):  # node i's parent: an earlier node or the root
        parents.append(rng.randrange(-1, i))
    tree = ancestor_mask(parents)  # [37, 37]: root + 36 nodes
    draft = torch.zeros(3, 7, dtype=torch.bool)  # 3 frontier nodes over 7 tree slots (4 from earlier passes)
    draft[0, [0, 2, 4]] = draft[1, [1, 5]] = draft[2, [1, 3, 6]] = True
    query_lens, context_lens = [1, 37, 3, 4], [9, 50, 12, 10]
    masks = [None, tree, draft, None]
    num_blocks = sum(-(-c // block_size) for c in context_lens) + 2
    ids = torch.randperm(num_blocks, generator=g).tolist()
    tables, at = [], 0
    for c in context_lens:
        n = -(-c // block_size)
        tables.append(ids[at : at + n])
        at += n
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(device, dtype)
    meta = AttentionMetadata.build(query_lens, context_lens, tables, block_size, device, masks)
    assert meta.has_tree and meta.tree_bits.shape == (sum(query_lens), 2)
    t = sum(query_lens)
    q = torch.randn(t, heads, head_dim, generator=g).to(device, dtype)
    scale = head_dim ** -0.5
    ref = paged_attention_torch(q.float(), None, None, k_cache.float(), v_cache.float(), meta, scale)
    out = paged_attention_triton(q, None, None, k_cache, v_cache, meta, scale, splits=splits)
    return float((out.float() - ref).abs().max())


@pytest.mark.parametrize("splits", [1, 3])
def test_tree_masks_match_torch(splits):
    """Trees take the kernel's bitmask path (no torch fallback) and agree with the masked SDPA path,
    also when a split's tiles are all masked."""
    assert compare_trees(DEVICE, 16, splits=splits) < 1e-5


def test_tree_bitmasks_pack_every_key():
    from workers.engine.attention import tree_bitmasks

    mask = torch.zeros(2, 40, dtype=torch.bool)
    mask[0, [0, 31, 32, 39]] = True
    mask[1, 5] = True
    base, bits = tree_bitmasks([1, 2], [6, 45], [None, mask])
    assert base.tolist() == [6, 5, 5]  # the chain token: past its own position; the tree: c - m
    assert bits[0].tolist() == [0, 0]
    assert bits[1].tolist() == [1 - 2 ** 31, 1 + 128]  # keys 0 and 31 (the sign bit), keys 32 and 39
    unpacked = [[(int(w) >> j) & 1 for w in row for j in range(32)][:40] for row in bits[1:]]
    assert unpacked == mask.int().tolist()
