"""EAGLE heads: checkpoint layouts load (EAGLE-1 and EAGLE-3), and speculation with them is lossless."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import save_file

from runtime.messages import SamplingParams
from tests.support.eagle_heads import H, write_eagle1, write_eagle3
from tests.support.tiny_models import tiny_model_fixture
from tests.unit.workers.engine.test_spec_engine import CFG, VOCAB, plain, prompts, run_spec
from workers.draft.eagle import Eagle1Head, Eagle3Head, load_eagle, load_target_parts
from workers.draft.eagle_proposer import EagleProposer
from workers.engine.engine import Engine
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit


target_dir = tiny_model_fixture(seed=7, vocab=VOCAB, layers=4)


def test_layouts_load_and_map_vocab(target_dir, tmp_path):
    embed, lm_head, tcfg = load_target_parts(target_dir)
    (tmp_path / "e1").mkdir()
    (tmp_path / "e3").mkdir()
    write_eagle1(tmp_path / "e1")
    write_eagle3(tmp_path / "e3")
    head1, layers1 = load_eagle(tmp_path / "e1", embed, lm_head, tcfg, 512)
    assert isinstance(head1, Eagle1Head) and layers1 == [4] and head1.fc.bias is not None
    head3, layers3 = load_eagle(tmp_path / "e3", embed, lm_head, tcfg, 512)
    assert isinstance(head3, Eagle3Head) and layers3 == [1, 2, 3]
    logits = head3.logits(torch.randn(2, H))
    finite = torch.isfinite(logits[0]).nonzero().flatten().tolist()
    assert finite == list(range(0, 96, 2))  # only target ids 2i are reachable
    (tmp_path / "bad").mkdir()
    write_eagle1(tmp_path / "bad")
    from safetensors.torch import load_file
    state = load_file(str(tmp_path / "bad" / "model.safetensors"))
    del state["layers.0.mlp.down_proj.weight"]
    save_file(state, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        load_eagle(tmp_path / "bad", embed, lm_head, tcfg, 512)


@pytest.mark.parametrize("version,topk", [(1, 1), (3, 1), (3, 3)])
def test_greedy_speculation_with_eagle_equals_plain_decoding(target_dir, tmp_path, version, topk):
    (write_eagle1 if version == 1 else write_eagle3)(tmp_path)
    embed, lm_head, tcfg = load_target_parts(target_dir)
    head, layers = load_eagle(tmp_path, embed, lm_head, tcfg, 512)
    batch = prompts(50, seed=40 + version)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = plain(target_dir, batch, params)
    engine = Engine(load_model(target_dir), CFG, num_speculative_tokens=3 if topk == 1 else 8,
                        hidden_layers=tuple(layers))
    proposer = EagleProposer(head, layers, num_blocks=512, block_size=4, tree_topk=topk, tree_depth=3)
    got = {}
    items = list(batch.items())
    for start in range(0, len(items), 8):
        got.update(run_spec(engine, proposer, dict(items[start : start + 8]), params))
    assert got == want
    assert engine.counters[""].num_drafts > 0 and proposer.forward_calls > 0
    # a random head still hits now and then (seeded: 2-5 tokens here), so the accept path runs too
    assert engine.counters[""].num_accepted_tokens > 0
    assert not any(s.broken for s in proposer.seqs.values())
    assert len(proposer) == 0 and engine.blocks.num_free_blocks == engine.blocks.num_blocks


def _head_chain(head, embed_feats, tokens, path):
    """Reference: the head's log-probabilities after each prefix of ``path``, computed as a plain chain
    (pairs (x_{t+1}, f_t), features of drafted positions from the head's own outputs)."""
    from workers.engine.attention import AttentionMetadata, allocate_kv_cache

    cfg = head.cfg
    kv = allocate_kv_cache(head.num_kv_layers, 64, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    seq = tokens + path
    feats = list(embed_feats)  # target features of positions 0 .. len(tokens) - 2
    out = []
    for t in range(len(seq) - 1):
        meta = AttentionMetadata.build([1], [t + 1], [list(range(16))], 4)
        h = head(torch.tensor([seq[t + 1]]), feats[t][None], torch.tensor([t]), meta, kv)
        if t + 1 >= len(feats):
            feats.append(h[0])
        if t >= len(tokens) - 2:
            out.append(head.logits(h)[0].log_softmax(-1))
    return out  # [len(path) + 1] rows: after the last committed token, then after each path token


def test_eagle_tree_nodes_are_the_heads_top_k_along_their_paths(target_dir, tmp_path):
    """Every node of a drafted tree is among the top-k children its parent's path gives when the head
    runs that path as a plain chain: the tree mask and positions match sequential drafting."""
    write_eagle3(tmp_path, seed=5)
    embed, lm_head, tcfg = load_target_parts(target_dir)
    head, layers = load_eagle(tmp_path, embed, lm_head, tcfg, 512)
    gen = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, VOCAB, (11,), generator=gen).tolist()
    hidden = [torch.randn(len(tokens) - 1, H, generator=gen) for _ in layers]
    proposer = EagleProposer(head, layers, num_blocks=64, block_size=4, tree_topk=3, tree_depth=3)
    from workers.speculation.payloads import DraftInput
    (out,) = proposer.propose([DraftInput("s", 0, tokens, 10, hidden_states=hidden)])
    assert len(out.token_ids) == 10 and out.is_tree and not out.distributions
    feats = head.project(hidden)
    for i, (token, parent) in enumerate(zip(out.token_ids, out.parents)):
        path, p = [], parent
        while p >= 0:
            path.append(out.token_ids[p])
            p = out.parents[p]
        logp = _head_chain(head, feats, tokens, path[::-1])[-1]
        assert token in logp.topk(3).indices.tolist(), f"node {i}"
    # the cache holds only the committed pairs again, and a second proposal gives the same tree
    (again,) = proposer.propose([DraftInput("s", 1, [], 10)])
    assert again.token_ids == out.token_ids and again.parents == out.parents
