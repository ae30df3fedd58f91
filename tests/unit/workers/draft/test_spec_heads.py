"""Medusa heads and the MLP speculator: their published layouts load and compute what the papers'
formulas say, what train-draft writes loads back, and speculation with them is lossless (greedy
output equals plain decoding, one request at a time and 8 in a batch, chains and trees)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from runtime.messages import SamplingParams
from tests.support.tiny_models import tiny_hf_model
from tests.unit.workers.engine.test_spec_engine import CFG, VOCAB, plain, prompts, run_spec
from workers.draft.eagle import load_target_parts
from workers.draft.head_proposer import HeadProposer
from workers.draft.spec_heads import (
    MEDUSA,
    MLP,
    MedusaHead,
    MlpSpeculatorHead,
    head_kind,
    load_spec_head,
    save_spec_head,
)
from workers.draft.train.spec_heads import build_medusa, build_mlp, spec_head_forward
from workers.engine.engine import Engine
from workers.engine.weights import load_model
from workers.speculation.payloads import ROOT, DraftInput, SamplingSpec

pytestmark = pytest.mark.unit

H = 64  # tiny_hf_model's hidden size


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("target_heads")
    tiny_hf_model("llama", path, seed=11, vocab=VOCAB, layers=2)
    return path


def _w(gen, *shape, scale=0.2):
    return torch.randn(*shape, generator=gen) * scale


def write_medusa_vllm(path, heads=3, layers=1, token_map=None, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    rows = VOCAB if token_map is None else len(token_map)
    state = {}
    for i in range(heads):
        for j in range(layers):
            state[f"blocks.{i}.layers.{j}.weight"] = _w(gen, H, H)
            state[f"blocks.{i}.layers.{j}.bias"] = _w(gen, H)
        state[f"lm_heads.{i}.weight"] = _w(gen, rows, H, scale=1.0)
    if token_map is not None:
        state["token_map"] = torch.tensor(token_map, dtype=torch.long)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "model_type": "medusa", "hidden_size": H, "vocab_size": VOCAB, "num_heads": heads, "num_hidden_layers": layers,
        "medusa_fc_bias": True, "truncated_vocab_size": rows}))
    return state


def medusa_reference(state: dict, h: torch.Tensor, i: int, layers: int = 1) -> torch.Tensor:
    """Head i by the paper's formula: x ← x + SiLU(W x + b) per layer, then the head's LM head."""
    x = h
    for j in range(layers):
        x = x + F.silu(x @ state[f"blocks.{i}.layers.{j}.weight"].T + state[f"blocks.{i}.layers.{j}.bias"])
    logits = x @ state[f"lm_heads.{i}.weight"].T
    if "token_map" in state:
        full = torch.full((h.shape[0], VOCAB), float("-inf"))
        full[:, state["token_map"]] = logits
        return full
    return logits


def write_mlp_ibm(path, n_predict=3, inner=48, tie=True, scale_input=True, seed=0) -> dict:
    """IBM's layout under ``speculator.``; tied stages written once, as fms-extras saves them."""
    gen = torch.Generator().manual_seed(seed)
    stages = [0] if tie else list(range(n_predict))
    state = {}
    for i in stages:
        state[f"speculator.emb.{i}.weight"] = _w(gen, VOCAB, inner, scale=1.0)
        state[f"speculator.head.{i}.weight"] = _w(gen, VOCAB, inner, scale=1.0)
        state[f"speculator.ln.{i}.weight"] = 1 + _w(gen, inner)
        state[f"speculator.ln.{i}.bias"] = _w(gen, inner)
    for i in ([0, 1] if tie else range(n_predict)):
        state[f"speculator.proj.{i}.weight"] = _w(gen, inner, H if i == 0 else inner)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({
        "architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": "mlp_speculator", "emb_dim": H,
        "inner_dim": inner, "vocab_size": VOCAB, "n_predict": n_predict, "n_candidates": 5,
        "top_k_tokens_per_head": [4, 3, 2][:n_predict], "tie_weights": tie, "scale_input": scale_input}))
    return {k.removeprefix("speculator."): v for k, v in state.items()}


def mlp_reference(state: dict, h: torch.Tensor, tokens: list[torch.Tensor], n_predict: int, inner: int, tie: bool,
                  scale_input: bool) -> list[torch.Tensor]:
    """IBM's generate step by step: state ← GELU(LN(proj(state) + (emb_w/state_w)·emb(token)))."""
    def ln(x, w=None, b=None):
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)
        return x if w is None else x * w + b

    sw = 0.5 ** (0.5 / n_predict)
    ew = math.sqrt((1 - sw ** 2) * (inner / 2))
    s = ln(h) / math.sqrt(2) if scale_input else h
    out = []
    for i in range(n_predict):
        e, p = (0 if tie else i), (min(i, 1) if tie else i)
        z = state[f"emb.{e}.weight"][tokens[i]]
        s = s @ state[f"proj.{p}.weight"].T
        s = F.gelu(ln(s + z * ew / sw, state[f"ln.{e}.weight"], state[f"ln.{e}.bias"]))
        out.append(s @ state[f"head.{e}.weight"].T)
    return out


def test_medusa_layouts_load_and_compute_the_papers_heads(tmp_path):
    gen = torch.Generator().manual_seed(5)
    h = torch.randn(4, H, generator=gen)
    (tmp_path / "v").mkdir()
    state = write_medusa_vllm(tmp_path / "v", heads=3, layers=2, token_map=list(range(0, VOCAB, 2)))
    assert head_kind(tmp_path / "v") == MEDUSA
    head = load_spec_head(tmp_path / "v", H, VOCAB)
    assert isinstance(head, MedusaHead) and head.n_predict == 3
    for i in range(3):
        _, logits = head.step(h, torch.zeros(4, dtype=torch.long), i)
        torch.testing.assert_close(logits, medusa_reference(state, h, i, layers=2))
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == list(range(0, VOCAB, 2))
    # FasterDecoding's medusa_lm_head.pt: {i}.{j}.linear.* and {i}.{layers}.weight
    (tmp_path / "fd").mkdir()
    fd = {}
    for i in range(2):
        fd[f"{i}.0.linear.weight"] = state[f"blocks.{i}.layers.0.weight"]
        fd[f"{i}.0.linear.bias"] = state[f"blocks.{i}.layers.0.bias"]
        fd[f"{i}.1.weight"] = _w(gen, VOCAB, H)
    torch.save(fd, tmp_path / "fd" / "medusa_lm_head.pt")
    (tmp_path / "fd" / "config.json").write_text(json.dumps({"medusa_num_heads": 2, "medusa_num_layers": 1,
                                                             "base_model_name_or_path": "x"}))
    head = load_spec_head(tmp_path / "fd", H, VOCAB)
    _, logits = head.step(h, torch.zeros(4, dtype=torch.long), 1)
    x = h + F.silu(h @ fd["1.0.linear.weight"].T + fd["1.0.linear.bias"])
    torch.testing.assert_close(logits, x @ fd["1.1.weight"].T)
    # a missing tensor and a wrong hidden size are one-line errors
    (tmp_path / "bad").mkdir()
    write_medusa_vllm(tmp_path / "bad", heads=2)
    with pytest.raises(ValueError, match="hidden_size"):
        load_spec_head(tmp_path / "bad", H + 1, VOCAB)
    from safetensors.torch import load_file
    broken = load_file(str(tmp_path / "bad" / "model.safetensors"))
    del broken["lm_heads.1.weight"]
    save_file(broken, str(tmp_path / "bad" / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        load_spec_head(tmp_path / "bad", H, VOCAB)


def test_medusa_with_one_shared_lm_head_and_a_map_over_full_rows(tmp_path):
    """vLLM's original_lm_head (one LM head, written as lm_heads.0 or left to the target's) and a
    token map over full-vocabulary rows (vLLM keeps the map's rows)."""
    gen = torch.Generator().manual_seed(8)
    h = torch.randn(3, H, generator=gen)
    state = write_medusa_vllm(tmp_path, heads=2)
    cfg = json.loads((tmp_path / "config.json").read_text())
    shared = state["lm_heads.0.weight"]
    del state["lm_heads.1.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "original_lm_head": True}))
    head = load_spec_head(tmp_path, H, VOCAB)
    for i in range(2):
        x = h + F.silu(h @ state[f"blocks.{i}.layers.0.weight"].T + state[f"blocks.{i}.layers.0.bias"])
        torch.testing.assert_close(head.step(h, None, i)[1], x @ shared.T)
    # no LM head in the file: the target's
    del state["lm_heads.0.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    target_lm = torch.nn.Linear(H, VOCAB, bias=False)
    head = load_spec_head(tmp_path, H, VOCAB, target_lm)
    x = h + F.silu(h @ state["blocks.1.layers.0.weight"].T + state["blocks.1.layers.0.bias"])
    torch.testing.assert_close(head.step(h, None, 1)[1], x @ target_lm.weight.T)
    with pytest.raises(ValueError, match="target's LM head"):
        load_spec_head(tmp_path, H, VOCAB)
    # separate full-vocabulary heads with a token map
    full = write_medusa_vllm(tmp_path, heads=2)
    full["token_map"] = torch.arange(0, VOCAB, 4)
    save_file(full, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "truncated_vocab_size": VOCAB // 4}))
    logits = load_spec_head(tmp_path, H, VOCAB).step(h, None, 0)[1]
    x = h + F.silu(h @ full["blocks.0.layers.0.weight"].T + full["blocks.0.layers.0.bias"])
    torch.testing.assert_close(logits[:, ::4], x @ full["lm_heads.0.weight"][::4].T)
    assert torch.isinf(logits[:, 1::4]).all()


@pytest.mark.parametrize("tie,scale_input", [(True, True), (False, False)])
def test_mlp_speculator_layout_loads_and_computes_ibms_recurrence(tmp_path, tie, scale_input):
    state = write_mlp_ibm(tmp_path, n_predict=3, inner=48, tie=tie, scale_input=scale_input)
    assert head_kind(tmp_path) == MLP
    head = load_spec_head(tmp_path, H, VOCAB)
    assert isinstance(head, MlpSpeculatorHead) and head.tie_weights == tie
    gen = torch.Generator().manual_seed(9)
    h = torch.randn(5, H, generator=gen)
    tokens = [torch.randint(0, VOCAB, (5,), generator=gen) for _ in range(3)]
    want = mlp_reference(state, h, tokens, 3, 48, tie, scale_input)
    s = head.init_state(h)
    for i in range(3):
        s, logits = head.step(s, tokens[i], i)
        torch.testing.assert_close(logits, want[i], rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["medusa", "mlp"])
def test_written_heads_load_back_identically(tmp_path, kind):
    gen = torch.Generator().manual_seed(3)
    lm = torch.randn(VOCAB, H, generator=gen)
    if kind == "medusa":
        head = build_medusa(H, VOCAB, 3, 1, lm, torch.arange(0, VOCAB, 3))
        for p in head.parameters():
            p.data.normal_(0, 0.3, generator=gen)
    else:
        head = build_mlp(H, H, VOCAB, 3, lm, seed=1)
    save_spec_head(head, tmp_path, dtype=torch.float32)
    loaded = load_spec_head(tmp_path, H, VOCAB)
    h, tok = torch.randn(4, H, generator=gen), torch.randint(0, VOCAB, (4,), generator=gen)
    s1, s2 = head.init_state(h), loaded.init_state(h)
    for i in range(3):
        (s1, l1), (s2, l2) = head.step(s1, tok, i), loaded.step(s2, tok, i)
        torch.testing.assert_close(l1, l2)


@pytest.mark.parametrize("kind", ["medusa", "mlp"])
def test_training_steps_equal_the_drafting_path(kind):
    """spec_head_forward's step k for chain t is what the proposer computes after x_{t+1} with the
    teacher's tokens as drafts."""
    gen = torch.Generator().manual_seed(4)
    lm = torch.randn(VOCAB, H, generator=gen)
    head = build_medusa(H, VOCAB, 3, 1, lm, None) if kind == "medusa" else build_mlp(H, H, VOCAB, 3, lm, seed=2)
    for p in head.parameters():
        p.data.add_(torch.randn(p.shape, generator=gen) * 0.05)
    T = 12
    tokens, hidden, mask = torch.randint(0, VOCAB, (T,), generator=gen), torch.randn(T, H, generator=gen), torch.ones(T, dtype=torch.bool)
    with torch.no_grad():  # chains 0 and 5 continue as the head drafts them, so counting has something to count
        for t in (0, 5):
            s, prev = head.init_state(hidden[t : t + 1]), tokens[t + 1 : t + 2]
            for k in range(3):
                s, logits = head.step(s, prev, k)
                prev = logits.argmax(-1)
                tokens[t + k + 2] = prev[0]
    stats = spec_head_forward(head, tokens, hidden, mask, None, 3)
    # recompute acceptance by drafting each chain the way the proposer does
    accepted = 0
    for t in range(T - 2):
        s = head.init_state(hidden[t : t + 1])
        prev = tokens[t + 1 : t + 2]
        for k in range(3):
            if t + k + 2 >= T:
                break
            s, logits = head.step(s, prev, k)
            if int(logits.argmax()) != int(tokens[t + k + 2]):
                break
            accepted += 1
            prev = tokens[t + k + 2 : t + k + 3]
    assert accepted >= 6  # chains 0 and 5: 3 each
    assert stats.chains == T - 2 and stats.accepted == accepted


def _random_head(kind: str, target_dir):
    """A head on the target: Medusa / MLP initialised from the target's own LM head and embedding
    (what train-draft starts from), perturbed so that its guesses differ from the identity."""
    embed, lm_head, _ = load_target_parts(target_dir)
    gen = torch.Generator().manual_seed(21)
    if kind == "medusa":
        head = build_medusa(H, VOCAB, 3, 1, lm_head.weight.detach(), torch.arange(VOCAB - 16))
    else:
        head = build_mlp(H, H, VOCAB, 3, embed.weight.detach(), seed=3)
    for p in head.parameters():
        p.data.add_(torch.randn(p.shape, generator=gen) * 0.02)
    return head.eval()


GREEDY_SEEDS = (71, 73)  # the prompt seeds of the greedy test (70 + topk)


@pytest.fixture(scope="module")
def distilled_heads(target_dir) -> dict:
    """Medusa and MLP heads fitted to the target's own greedy replies to the greedy test's prompts (what
    train-draft does, on 2k tokens for a second): drafts the target accepts, so verification is tested
    on accepted tokens and not only on rejected ones."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    tokens, mask, hidden = [], [], []
    for seed in GREEDY_SEEDS:
        batch = prompts(32, seed=seed)  # the 16-prompt batch of a seed is its first half
        replies = plain(target_dir, batch, params)
        for rid, prompt in batch.items():
            seq = prompt + replies[rid]
            tokens += seq
            mask += [False] * len(prompt) + [True] * len(replies[rid])
            with torch.no_grad():  # the last hidden state after the final norm, as the proposer gets it
                hidden.append(hf(torch.tensor([seq]), output_hidden_states=True).hidden_states[-1][0])
    # All replies as one sequence: a chain of 3 steps never reaches the next reply across its prompt.
    tokens, mask, hidden = torch.tensor(tokens), torch.tensor(mask), torch.cat(hidden)
    to_draft = torch.full((VOCAB,), -1, dtype=torch.long)
    to_draft[: VOCAB - 16] = torch.arange(VOCAB - 16)  # _random_head's Medusa drafts from a reduced vocabulary
    heads = {}
    for kind in ("medusa", "mlp"):
        head = _random_head(kind, target_dir).train()
        opt = torch.optim.Adam(head.parameters(), lr=1e-2)
        for _ in range(100):
            opt.zero_grad()
            spec_head_forward(head, tokens, hidden, mask, to_draft if kind == "medusa" else None, 3).loss.backward()
            opt.step()
        heads[kind] = head.eval()
    return heads


@pytest.mark.parametrize("kind", ["medusa", "mlp"])
@pytest.mark.parametrize("concurrent,topk", [(1, 1), (8, 1), (8, 3)])
def test_greedy_speculation_with_heads_equals_plain_decoding(target_dir, distilled_heads, kind, concurrent, topk):
    batch = prompts(16 if concurrent == 1 else 32, seed=70 + topk)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = plain(target_dir, batch, params)
    engine = Engine(load_model(target_dir), CFG, num_speculative_tokens=3 if topk == 1 else 8,
                        hidden_layers=(2,))
    proposer = HeadProposer(distilled_heads[kind], 2, tree_topk=topk, tree_depth=3)
    assert proposer.caps.hidden_layers == (2,)
    got = {}
    items = list(batch.items())
    for start in range(0, len(items), concurrent):
        got.update(run_spec(engine, proposer, dict(items[start : start + concurrent]), params))
    assert got == want
    counters = engine.counters[""]
    assert counters.num_drafts > 0 and proposer.forward_calls > 0
    # lossless with drafts accepted: on average at least one per verify step (mean accepted length >= 2)
    assert counters.num_accepted_tokens >= counters.num_drafts, counters
    assert not any(s.broken for s in proposer.seqs.values()) and len(proposer) == 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_sampled_chains_carry_the_distributions_they_were_drawn_from(target_dir):
    head = _random_head("mlp", target_dir)
    proposer = HeadProposer(head, 2)
    hidden = [torch.randn(3, H)]
    spec = SamplingSpec(temperature=0.8, top_k=5, seed=1)
    out = proposer.propose([DraftInput("s", 0, [1, 2, 3, 4], 3, spec, hidden)])[0]
    assert len(out.token_ids) == 3 and len(out.distributions) == 3
    for token, dist in zip(out.token_ids, out.distributions):
        assert token in dist.ids and len(dist.ids) == 5 and abs(sum(dist.probs) - 1) < 1e-5
    # γ beyond the head's stages is cut to n_predict; a one-token prompt has no hidden row: nothing
    out = proposer.propose([DraftInput("t", 0, [5], 6, SamplingSpec(), [torch.zeros(0, H)])])[0]
    assert out.token_ids == []
    # wrong layers (EAGLE-3's three) mark the sequence: empty proposals, not guesses
    out = proposer.propose([DraftInput("u", 0, [1, 2, 3], 2, SamplingSpec(), [torch.randn(2, H)] * 3)])[0]
    assert out.token_ids == [] and proposer.seqs["u"].broken


def test_head_trees_hold_the_best_paths_by_cumulative_probability(target_dir):
    head = _random_head("mlp", target_dir)
    proposer = HeadProposer(head, 2, tree_topk=2, tree_depth=2)
    h = torch.randn(3, H, generator=torch.Generator().manual_seed(2))
    out = proposer.propose([DraftInput("s", 0, [7, 8, 9, 10], 6, SamplingSpec(), [h])])[0]
    assert out.parents[:2] == [ROOT, ROOT] and len(out.token_ids) == 6 and out.distributions == []
    s0, logits0 = head.step(head.init_state(h[-1:]), torch.tensor([10]), 0)
    top = logits0[0].log_softmax(-1).topk(2)
    assert out.token_ids[:2] == top.indices.tolist()
    for node, parent in enumerate(out.parents[2:], start=2):  # depth-2 nodes: children of a root child
        _, logits1 = head.step(s0, torch.tensor([out.token_ids[parent]]), 1)
        assert out.token_ids[node] in logits1[0].topk(2).indices.tolist()
