"""Multi-LoRA serving: adapters trained here with ``peft`` on a tiny Llama, served by the engine.

Greedy outputs under an adapter equal PEFT's merged model in transformers; a batch mixing the base
and two adapters equals each request served alone; sampled adapter requests follow the adapter's
distribution (χ²); the prefix cache never hits across adapters; slots are reused LRU; speculation
(the base drafts, the target verifies under the adapter) stays lossless.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime.errors import InvalidRequest
from runtime.kv_hash import ROOT_HASH, chain_root
from runtime.messages import SamplingParams
from tests.support.lora import merged_reference, train_lora
from tests.support.tiny_models import hf_greedy, tiny_hf_model
from workers.engine.engine import Engine, EngineConfig
from workers.engine.lora import LoraError, LoraManager
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

VOCAB = 256
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
CFG = EngineConfig(num_blocks=256, block_size=4, max_num_seqs=16, max_num_batched_tokens=40)


@pytest.fixture(scope="module")
def lora_dirs(tmp_path_factory):
    """A seeded tiny Llama and two adapters: every projection at rank 8, and q/v/down only at rank 4
    with rsLoRA scaling, a per-module rank and a per-module alpha (k_proj absent: a zero band in the
    fused qkv)."""
    root = tmp_path_factory.mktemp("lora")
    tiny_hf_model("llama", root / "base", vocab=VOCAB)
    train_lora(root / "base", root / "a1", seed=1)
    train_lora(root / "base", root / "a2", seed=2, rank=4, alpha=8, targets=("q_proj", "v_proj", "down_proj"),
               use_rslora=True, rank_pattern={"down_proj": 2}, alpha_pattern={"layers.1.mlp.down_proj": 3})
    return root


@pytest.fixture(scope="module")
def references(lora_dirs):
    import transformers as tf

    return {"a1": merged_reference(lora_dirs / "base", lora_dirs / "a1"),
            "a2": merged_reference(lora_dirs / "base", lora_dirs / "a2"),
            None: tf.AutoModelForCausalLM.from_pretrained(str(lora_dirs / "base"), dtype=torch.float32).eval()}


def _engine(lora_dirs, max_loras: int = 2, config: EngineConfig = CFG, adapters=("a1", "a2")) -> Engine:
    model = load_model(lora_dirs / "base")
    engine = Engine(model, config, eos_token_ids=(0,), lora=LoraManager(model, max_loras, 8))
    for name in adapters:
        engine.load_lora(name, str(lora_dirs / name))
    return engine


def _prompts(n: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(VOCAB) for _ in range(rng.randrange(3, 30))] for _ in range(n)]


def _run(engine: Engine, requests: dict[str, tuple[list[int], str | None]], params=GREEDY) -> dict[str, list[int]]:
    out = {rid: [] for rid in requests}
    for rid, (prompt, lora) in requests.items():
        engine.add_request(rid, prompt, params, lora=lora)
    while engine.has_work():
        for rid, delta in engine.step():
            out[rid].extend(delta.token_ids)
    return out


def test_greedy_with_adapter_equals_peft_merged_model(lora_dirs, references):
    engine = _engine(lora_dirs)
    prompts = _prompts(3)
    requests = {f"{name}-{i}": (p, name) for name in ("a1", "a2", None) for i, p in enumerate(prompts)}
    got = _run(engine, requests)
    for rid, (prompt, name) in requests.items():
        assert got[rid] == hf_greedy(references[name], prompt, GREEDY.max_tokens), rid
    for i in range(len(prompts)):  # the adapters are not no-ops: each changes the output
        assert len({tuple(got[f"{n}-{i}"]) for n in ("a1", "a2", None)}) == 3


@pytest.mark.parametrize("names", [["a1", "a2", None], ["a1", "a2", "a3", None]])
def test_mixed_batch_equals_each_served_alone(lora_dirs, names):
    """Two adapters run one segment each; three or more run as one padded batched matmul (a3 is
    a1's weights under another name: its own slot)."""
    prompts = _prompts(3 * len(names), seed=1)
    requests = {f"r{i}": (p, names[i % len(names)]) for i, p in enumerate(prompts)}
    adapters = ("a1", "a2")
    alone = {rid: _run(_engine(lora_dirs), {rid: (p, "a1" if name == "a3" else name)})[rid]
             for rid, (p, name) in requests.items()}
    engine = _engine(lora_dirs, max_loras=3, adapters=adapters)
    if "a3" in names:
        engine.load_lora("a3", str(lora_dirs / "a1"))
    used = len(names) - 1
    mixed_steps = 0
    original = engine.runner.forward

    def counting(*args, **kw):
        nonlocal mixed_steps
        out = original(*args, **kw)
        grouped = engine.lora.grouped is not None
        mixed_steps += (len(engine.lora.segments) == used and grouped == (used >= 3)
                        and any(s < 0 for s in kw["adapters"]))
        return out

    engine.runner.forward = counting
    assert _run(engine, requests) == alone
    assert mixed_steps > 0  # steps did batch the base with both adapters


@pytest.mark.parametrize("temperature", [1.0, 0.8])
def test_sampled_adapter_requests_follow_the_adapter_chi_square(lora_dirs, references, temperature):
    """Many one-token requests (the base and both adapters in the same steps): the counts of each
    adapter's first token fit softmax(merged model's logits / T) restricted to its top 6."""
    n, k = 600, 6
    prompt = _prompts(1, seed=3)[0]
    params = SamplingParams(temperature=temperature, top_k=k, max_tokens=1, ignore_eos=True)
    engine = _engine(lora_dirs, config=EngineConfig(num_blocks=512, block_size=4, max_num_seqs=64,
                                                    max_num_batched_tokens=2048))
    torch.manual_seed(7)
    names = ["a1", "a2", None]
    got = _run(engine, {f"r{i}": (prompt, names[i % 3]) for i in range(3 * n)}, params)
    for j, name in enumerate(names):
        with torch.inference_mode():
            logits = references[name](torch.tensor([prompt])).logits[0, -1].double() / temperature
        top = logits.topk(k)
        expected = top.values.softmax(-1) * n
        tokens = [got[f"r{i}"][0] for i in range(j, 3 * n, 3)]
        index = {t: i for i, t in enumerate(top.indices.tolist())}
        assert all(t in index for t in tokens), (name, set(tokens) - set(index))
        observed = torch.bincount(torch.tensor([index[t] for t in tokens]), minlength=k).double()
        chi2 = float(((observed - expected) ** 2 / expected).sum())
        p_value = float(torch.special.gammaincc(torch.tensor((k - 1) / 2), torch.tensor(chi2 / 2)))
        assert p_value > 1e-3, (name, chi2, observed.tolist(), expected.tolist())


def test_prefix_cache_is_keyed_by_adapter(lora_dirs, references):
    engine = _engine(lora_dirs)
    prompt = _prompts(1, seed=4)[0] + list(range(40, 60))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    cached = {}
    for rid, name in [("base", None), ("a1", "a1"), ("a1-again", "a1"), ("a2", "a2"), ("base-again", None)]:
        engine.add_request(rid, prompt, params, lora=name)
        out = []
        while engine.has_work():
            for r, delta in engine.step():
                out.extend(delta.token_ids)
                if delta.usage is not None:
                    cached[r] = delta.usage.cached_tokens
        assert out == hf_greedy(references[name], prompt, 4), rid  # a cross-adapter hit would change it
    assert cached["a1"] == cached["a2"] == 0  # the base's blocks are no hits for an adapter
    assert cached["a1-again"] > 0 and cached["base-again"] > 0  # an adapter's own blocks are
    assert len({ROOT_HASH, chain_root("a1"), chain_root("a2")}) == 3 and chain_root(None) == ROOT_HASH


def test_slots_are_reused_least_recently_used_and_busy_adapters_wait(lora_dirs, references):
    prompt = _prompts(1, seed=5)[0]
    engine = _engine(lora_dirs, max_loras=1)  # two adapters, one slot: a2 waits until a1's request ends
    for rid, name in (("x", "a1"), ("y", "a2"), ("z", None)):
        engine.add_request(rid, prompt, GREEDY, lora=name)
    got = {"x": [], "y": [], "z": []}
    for rid, delta in engine.step():  # the base request behind the waiting a2 is admitted beside a1
        got[rid].extend(delta.token_ids)
    assert [s.request_id for s in engine.scheduler.running] == ["x", "z"]
    assert [s.request_id for s in engine.scheduler.waiting] == ["y"]
    with pytest.raises(LoraError, match="in use"):  # a waiting request uses it too
        engine.unload_lora("a2")
    while engine.has_work():
        for rid, delta in engine.step():
            got[rid].extend(delta.token_ids)
    for rid, name in (("x", "a1"), ("y", "a2"), ("z", None)):
        assert got[rid] == hf_greedy(references[name], prompt, GREEDY.max_tokens)
    lora = engine.lora
    assert lora.slot_owner == ["a2"]
    engine = _engine(lora_dirs, max_loras=2, adapters=("a1", "a2"))
    lora = engine.lora
    engine.load_lora("a3", str(lora_dirs / "a1"))
    _run(engine, {"p": (prompt, "a1")})
    _run(engine, {"q": (prompt, "a2")})
    _run(engine, {"r": (prompt, "a1")})  # a1 is now the most recently used
    _run(engine, {"s": (prompt, "a3")})  # evicts a2, the least recently used idle slot
    assert sorted(lora.slot_of) == ["a1", "a3"]


def test_speculation_with_an_adapter_is_lossless(lora_dirs, references):
    """The base model drafts (the draft knows no adapter); the target verifies under the adapter:
    greedy output equals the merged model's. Acceptance under the adapter is lower than the base's."""
    from workers.draft.draft_model import DraftModelProposer

    engine = _engine(lora_dirs)
    proposer = DraftModelProposer(load_model(lora_dirs / "base"), num_blocks=256, block_size=4)
    prompts = _prompts(2, seed=6)
    requests = {f"{n}-{i}": (p, n) for n in ("a1", None) for i, p in enumerate(prompts)}
    out = {rid: [] for rid in requests}
    for rid, (p, name) in requests.items():
        engine.add_request(rid, p, GREEDY, lora=name, num_speculative_tokens=3)
    usage = {}
    while engine.has_work():
        inputs = engine.draft_inputs()
        proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
        for rid, delta in engine.step(proposals):
            out[rid].extend(delta.token_ids)
            if delta.usage is not None:
                usage[rid] = delta.usage.spec
        proposer.verified(engine.take_verdicts())
        proposer.release(engine.take_released())
    for rid, (p, name) in requests.items():
        assert out[rid] == hf_greedy(references[name], p, GREEDY.max_tokens), rid
    base = [usage[f"None-{i}"] for i in range(2)]
    assert all(u is not None and u.num_draft_tokens > 0 and u.num_accepted_tokens == u.num_draft_tokens
               for u in base)  # the base verifies its own drafts: all accepted
    adapted = [usage[f"a1-{i}"] for i in range(2)]
    assert sum(u.num_draft_tokens for u in adapted if u) > sum(u.num_accepted_tokens for u in adapted if u)


def test_bad_adapters_and_requests_are_refused(lora_dirs, tmp_path):
    engine = _engine(lora_dirs, adapters=("a1",))
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("x", [1, 2, 3], GREEDY, lora="nope")
    assert err.value.field == "model"
    with pytest.raises(LoraError, match="already loaded"):
        engine.load_lora("a1", str(lora_dirs / "a1"))
    with pytest.raises(LoraError, match="adapter_config.json"):
        engine.load_lora("empty", str(tmp_path))
    small = load_model(lora_dirs / "base")
    with pytest.raises(LoraError, match="max-lora-rank"):
        LoraManager(small, 1, 4).register("big", lora_dirs / "a1")  # rank 8 > 4
    engine.add_request("busy", [1, 2, 3], GREEDY, lora="a1")
    engine.step()
    with pytest.raises(LoraError, match="in use"):
        engine.unload_lora("a1")
    engine.abort("busy")
    engine.unload_lora("a1")
    with pytest.raises(InvalidRequest):
        engine.add_request("y", [1, 2, 3], GREEDY, lora="a1")
    plain = Engine(load_model(lora_dirs / "base"), CFG)
    with pytest.raises(InvalidRequest, match="no LoRA"):
        plain.add_request("z", [1, 2, 3], GREEDY, lora="a1")
