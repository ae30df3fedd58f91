"""Tree attention: every node of a token tree, computed in one pass over the paged cache, gets the
logits its root-to-node path gets computed as a plain sequence."""

from __future__ import annotations

import random

import pytest
import torch

from tests.support.tiny_models import tiny_hf_model
from workers.engine.attention import AttentionMetadata, paged_attention_torch
from workers.speculation.tree import ancestor_mask
from workers.engine.model_runner import ModelRunner
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit


def test_built_metadata_is_not_tensor_only():
    """Host-built metadata takes the batched SDPA path, not the per-token gather reference (a
    classmethod once shadowed the flag's default and sent every CPU step down the slow path)."""
    meta = AttentionMetadata.build([1, 3], [5, 3], [[0, 1], [2]], 4)
    assert meta.tensors_only is False and not meta.has_tree
    static = AttentionMetadata.static(meta.slot_mapping, meta.block_tables, meta.token_seq, meta.token_pos, 4)
    assert static.tensors_only is True


def _reference(q, keys, values, scale):
    """Attention of one query [H, D] over keys/values [n, Hkv, D], written out."""
    group = q.shape[0] // keys.shape[1]
    k, v = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    weights = ((q[None] * k).sum(-1) * scale).softmax(0)  # [n, H]
    return (weights[..., None] * v).sum(0)


def test_tree_mask_attends_to_context_and_ancestors_only():
    torch.manual_seed(0)
    kc, vc = torch.randn(8, 4, 2, 16), torch.randn(8, 4, 2, 16)
    parents = [-1, -1, 1, 0, 2]  # nodes 1..5; node 3 under node 2, node 4 under node 1, node 5 under node 3
    meta = AttentionMetadata.build([6, 1], [13, 9], [list(range(4)), [4, 5, 6]], 4, "cpu",
                                   [ancestor_mask(parents), None])
    q = torch.randn(7, 4, 16)
    out = paged_attention_torch(q, None, None, kc, vc, meta, 0.25)
    flat_k, flat_v = kc.view(-1, 2, 16), vc.view(-1, 2, 16)
    ancestors = {0: [0], 1: [0, 1], 2: [0, 2], 3: [0, 2, 3], 4: [0, 1, 4], 5: [0, 2, 3, 5]}
    for node, anc in ancestors.items():
        keys = list(range(7)) + [7 + a for a in anc]
        torch.testing.assert_close(out[node], _reference(q[node], flat_k[keys], flat_v[keys], 0.25))
    second = [16 + i for i in range(9)]  # the plain decode row in the same batch sees its whole context
    torch.testing.assert_close(out[6], _reference(q[6], flat_k[second], flat_v[second], 0.25))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tree_model")
    tiny_hf_model("llama", path, seed=3, vocab=64, layers=2)
    return path


def test_tree_logits_equal_each_paths_own_logits(model_dir):
    rng = random.Random(0)
    prompt = [rng.randrange(64) for _ in range(9)]
    parents = [-1, -1, -1, 0, 1, 1, 4, 3, 6]
    tokens = [rng.randrange(64) for _ in parents]
    table = list(range(12))
    runner = ModelRunner(load_model(model_dir), 32, 4)
    runner.forward([(prompt[:-1], 0, table)], [1])
    got = runner.forward([([prompt[-1]] + tokens, len(prompt) - 1, table)], [len(tokens) + 1], trees=[parents]).logits
    for node in range(len(tokens) + 1):
        path, i = [], node - 1
        while i >= 0:
            path.append(tokens[i])
            i = parents[i]
        seq = prompt + path[::-1]
        fresh = ModelRunner(load_model(model_dir), 32, 4)
        want = fresh.forward([(seq, 0, table)], [1]).logits[0]
        torch.testing.assert_close(got[node], want, atol=1e-4, rtol=1e-4)


def test_copy_slots_moves_single_positions(model_dir):
    runner = ModelRunner(load_model(model_dir), 8, 4)
    k0 = runner.kv_caches[0][0]
    k0.view(-1, *k0.shape[2:])[5] = 1.0
    runner.copy_slots(torch.tensor([5]), torch.tensor([9]))
    assert torch.equal(k0.view(-1, *k0.shape[2:])[9], k0.view(-1, *k0.shape[2:])[5])
