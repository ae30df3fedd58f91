"""Mixtures of experts against transformers' own implementation on the same seeded random weights
(float32, CPU): the routers alone, logits at every position (one pass and chunked prefill), greedy
decoding of 5 prompts × 32 tokens in one engine batch with chunked prefill, the checkpoint layouts
the loader takes, speculation (lossless on an MoE target), tensor and expert parallelism over two
real ranks, and the configs the engine refuses (one ValueError naming the field)."""

from __future__ import annotations

import json
import random

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.messages import SamplingParams
from tests.support.tiny_models import hf_greedy
from tests.support.tiny_moe import tiny_moe_model
from tests.unit.workers.engine.test_spec_engine import make_proposer, run_spec
from workers.engine.attention import AttentionMetadata, allocate_kv_cache
from workers.engine.config import ModelConfig
from workers.engine.engine import Engine, EngineConfig
from workers.engine.moe import SparseMoe, route
from workers.engine.moe_config import MoeConfig, parse_moe
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")
VOCAB = 256
STEPS = 32
# chunked prefill: prompts of up to 40 tokens go in chunks of at most 16 tokens a step, beside decodes
CHUNKED = EngineConfig(block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=16)
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)


def prompts(n: int = 5, seed: int = 0, vocab: int = VOCAB) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"p{i}": [rng.randrange(vocab) for _ in range(rng.randrange(6, 41))] for i in range(n)}


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(family, model dir, transformers model)."""
    path = tmp_path_factory.mktemp(request.param)
    return request.param, path, tiny_moe_model(request.param, path, seed=3)


def _cache(cfg: ModelConfig, blocks: int = 64, block_size: int = 4):
    return allocate_kv_cache(cfg.num_layers, blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")


# ---------------------------------------------------------------------- routers and configs (pure)


def test_routers_equal_transformers():
    from transformers import GptOssConfig, MixtralConfig, Qwen3MoeConfig
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssTopKRouter
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    torch.manual_seed(0)
    x = torch.randn(50, 32)
    cases = [
        (Qwen3MoeTopKRouter(Qwen3MoeConfig(hidden_size=32, num_experts=16, num_experts_per_tok=4,
                                           norm_topk_prob=norm)),
         MoeConfig(16, 4, 8, (0,), norm_topk_prob=norm))
        for norm in (False, True)
    ] + [
        (MixtralTopKRouter(MixtralConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=2)),
         MoeConfig(8, 2, 8, (0,), norm_topk_prob=True)),
        (GptOssTopKRouter(GptOssConfig(hidden_size=32, num_local_experts=8, num_experts_per_tok=3)),
         MoeConfig(8, 3, 8, (0,), scoring="topk_softmax", router_bias=True)),
    ]
    for hf, moe in cases:
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 1)
            _, want_weights, want_ids = hf(x)
            logits = torch.nn.functional.linear(x, hf.weight, getattr(hf, "bias", None))
            weights, ids = route(logits, moe)
        assert torch.equal(ids, want_ids)
        assert torch.allclose(weights, want_weights.float(), atol=1e-6)
        if moe.norm_topk_prob or moe.scoring == "topk_softmax":
            assert torch.allclose(weights.sum(-1), torch.ones(50))


def test_sparse_layers_follow_decoder_sparse_step_and_mlp_only_layers():
    base = {"model_type": "qwen3_moe", "num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 16}
    assert parse_moe(base, "qwen3_moe", 4).sparse_layers == (0, 1, 2, 3)
    assert parse_moe({**base, "decoder_sparse_step": 2}, "qwen3_moe", 4).sparse_layers == (1, 3)
    assert parse_moe({**base, "mlp_only_layers": [0, 3]}, "qwen3_moe", 4).sparse_layers == (1, 2)
    assert parse_moe({**base, "num_experts": 0}, "qwen3_moe", 4) is None  # no experts: every layer dense
    mixtral = parse_moe({"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 16}, "mixtral", 2)
    assert mixtral.norm_topk_prob and mixtral.sparse_layers == (0, 1)
    assert parse_moe({}, "llama", 2) is None


def _qwen3_moe_dict(**changes) -> dict:
    from transformers import Qwen3MoeConfig

    cfg = Qwen3MoeConfig(hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_experts=8,
                         num_experts_per_tok=2, vocab_size=64).to_dict()
    cfg["num_experts"] = cfg.pop("num_local_experts")  # as Qwen's published configs spell it
    return {**cfg, **changes}


@pytest.mark.parametrize("changes, field", [
    ({"scoring_func": "sigmoid"}, "scoring_func='sigmoid'"),
    ({"topk_method": "noaux_tc"}, "topk_method='noaux_tc'"),
    ({"n_group": 8}, "n_group=8"),
    ({"routed_scaling_factor": 2.5}, "routed_scaling_factor=2.5"),
    ({"num_experts_per_tok": 9}, "num_experts_per_tok"),
    ({"moe_intermediate_size": 0}, "moe_intermediate_size"),
])
def test_configs_the_engine_cannot_serve_name_the_field(changes, field):
    with pytest.raises(ValueError, match="^[^\n]*" + field.replace("(", r"\(").replace(")", r"\)")):
        ModelConfig.from_dict(_qwen3_moe_dict(**changes))


def test_expert_parallelism_needs_experts_divisible_by_the_ranks():
    moe = ModelConfig.from_dict(_qwen3_moe_dict(num_experts=6)).moe
    assert [moe.local_experts(r, 2) for r in range(2)] == [(0, 3), (3, 3)]
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible by the expert-parallel size \(4\)"):
        moe.local_experts(0, 4)


def test_the_target_worker_refuses_an_unservable_moe_at_start(tmp_path):
    """The target's config check (before any weight loads): one ValueError naming the field."""
    from workers.engine.target_config import TargetConfig

    (tmp_path / "config.json").write_text(json.dumps(_qwen3_moe_dict(num_experts=6)))
    with pytest.raises(ValueError, match=r"num_experts \(6\) must be divisible"):
        TargetConfig(model=str(tmp_path), served_model_name="m", tensor_parallel_size=4, enable_expert_parallel=True)
    TargetConfig(model=str(tmp_path), served_model_name="m", tensor_parallel_size=2, enable_expert_parallel=True)  # 3 each: fine
    (tmp_path / "config.json").write_text(json.dumps(_qwen3_moe_dict(scoring_func="sigmoid")))
    with pytest.raises(ValueError, match="unsupported MoE router: scoring_func='sigmoid'"):
        TargetConfig(model=str(tmp_path), served_model_name="m")


# ---------------------------------------------------------------------- against transformers


def test_logits_at_every_position_match_transformers_in_one_pass_and_in_chunks(family):
    name, path, hf = family
    model = load_model(path)
    assert model.cfg.moe is not None and model.cfg.model_type == name
    sparse = [isinstance(layer.mlp, SparseMoe) for layer in model.model.layers]
    assert sparse == ([True, False, True] if name == "qwen3_moe" else [True] * 3)  # mlp_only_layers=[1]
    tokens = torch.randint(0, VOCAB, (45,), generator=torch.Generator().manual_seed(7))
    table = [9, 3, 11, 0, 5, 1, 7, 2, 12, 4, 6, 8]  # scattered blocks
    with torch.inference_mode():
        want = hf(tokens[None]).logits[0]
        meta = AttentionMetadata.build([45], [45], [table], 4)
        whole = model(tokens, torch.arange(45), meta, _cache(model.cfg)).logits
        kv, chunks = _cache(model.cfg), []
        for start in range(0, 45, 7):  # prefill in chunks over the growing cache
            stop = min(start + 7, 45)
            meta = AttentionMetadata.build([stop - start], [stop], [table], 4)
            chunks.append(model(tokens[start:stop], torch.arange(start, stop), meta, kv).logits)
    assert (whole - want).abs().max() < 1e-4
    assert (torch.cat(chunks) - want).abs().max() < 1e-4


def test_greedy_batch_with_chunked_prefill_equals_transformers(family):
    """5 prompts × 32 tokens in one engine batch, prefills in chunks beside other sequences' decodes;
    then transformers' logits over each whole sequence against ours at every position."""
    name, path, hf = family
    model = load_model(path)
    batch = prompts(5, seed=11)
    engine = Engine(model, CHUNKED)
    got = engine.generate(batch, GREEDY)
    for rid, prompt in batch.items():
        assert got[rid] == hf_greedy(hf, prompt, STEPS), rid
        assert len(set(got[rid])) > 3  # a random model that does not just repeat one token
        seq = torch.tensor(prompt + got[rid])
        with torch.inference_mode():
            want = hf(seq[None]).logits[0]
            meta = AttentionMetadata.build([len(seq)], [len(seq)], [list(range(20))], 4)
            ours = model(seq, torch.arange(len(seq)), meta, _cache(model.cfg)).logits
        assert (ours - want).abs().max() < 1e-4


def test_stacked_expert_tensors_load_as_per_expert_ones(tmp_path, family):
    """The stacked layout (``experts.gate_up_proj`` [E, 2I, H], ``experts.down_proj`` [E, H, I], as
    transformers holds Qwen's and Mixtral's experts in memory) loads to the same model."""
    name, path, _ = family
    state = load_file(path / "model.safetensors")
    stacked, groups = {}, {}
    for key, tensor in state.items():
        parts = key.split(".")
        if ".experts." in key and parts[-3].isdigit():
            prefix = ".".join(parts[:-3]).replace("block_sparse_moe", "mlp")
            proj = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}.get(parts[-2], parts[-2])
            groups.setdefault((prefix, proj), {})[int(parts[-3])] = tensor
        else:
            stacked[key] = tensor
    for (prefix, proj), experts in groups.items():
        groups[(prefix, proj)] = torch.stack([experts[e] for e in sorted(experts)])
    for prefix in {p for p, _ in groups}:
        stacked[f"{prefix}.gate_up_proj"] = torch.cat([groups[(prefix, "gate_proj")], groups[(prefix, "up_proj")]], 1)
        stacked[f"{prefix}.down_proj"] = groups[(prefix, "down_proj")]
    out = tmp_path / "stacked"
    out.mkdir()
    save_file(stacked, str(out / "model.safetensors"))
    (out / "config.json").write_text((path / "config.json").read_text())
    a, b = load_model(path), load_model(out)
    for (na, pa), (nb, pb) in zip(a.state_dict().items(), b.state_dict().items()):
        assert na == nb and torch.equal(pa, pb), na
    del stacked[next(k for k in stacked if k.endswith("experts.down_proj"))]
    save_file(stacked, str(out / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        load_model(out)


@pytest.mark.parametrize("method", ["ngram", "ngram_tree", "self_draft"])
def test_speculation_on_an_moe_target_equals_plain_decoding(tmp_path, method):
    """n-gram drafts (prompts that repeat, so there is always a match: proposals every step they can)
    and the target's own weights as a draft model, verified by an MoE target in batches of 8."""
    path = tmp_path / "target"
    tiny_moe_model("qwen3_moe", path, seed=5, vocab=96)
    rng = random.Random(5)
    batch = {}
    for i in range(8):
        motif = [rng.randrange(96) for _ in range(rng.randrange(3, 7))]
        batch[f"r{i}"] = (motif * 4 + [rng.randrange(96)] + motif)[:28]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = Engine(load_model(path), CHUNKED).generate(batch, params)
    engine = Engine(load_model(path), EngineConfig(block_size=4, num_blocks=512, max_num_seqs=8,
                                                   max_num_batched_tokens=256), num_speculative_tokens=4)
    assert run_spec(engine, make_proposer(method, path, path), batch, params) == want
    counters = engine.counters[""]
    assert counters.num_drafts > 0 and counters.num_accepted_tokens > 0
    if method == "self_draft":
        assert counters.acceptance_rate == 1.0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


# ---------------------------------------------------------------------- two real ranks


@pytest.fixture(scope="module", params=["qwen3_moe", "gpt_oss"])
def parallel_model(request, tmp_path_factory):
    """An 8-expert top-3 MoE with an odd vocabulary (qwen3_moe: a dense layer; gpt-oss: expert and
    router biases, interleaved gate/up columns, sinks per head); its single-device greedy tokens."""
    path = tmp_path_factory.mktemp(f"{request.param}-parallel")
    tiny_moe_model(request.param, path, seed=9, vocab=251, top_k=3)
    batch = prompts(6, seed=13, vocab=251)
    return path, batch, Engine(load_model(path), CHUNKED).generate(batch, GREEDY)


@pytest.mark.parametrize("expert_parallel", [False, True], ids=["tp2", "ep2"])
def test_expert_and_tensor_parallel_greedy_equal_one_device(parallel_model, expert_parallel):
    """EP 2 (experts 0-3 on rank 0, 4-7 on rank 1, attention tensor-parallel) and TP 2 (every expert
    sliced over both ranks) give the single device's tokens, plain and speculative."""
    from workers.engine.followers import load_sharded

    path, batch, want = parallel_model
    model, followers = load_sharded(str(path), 2, expert_parallel=expert_parallel)
    try:
        experts = model.model.layers[0].mlp.experts
        if expert_parallel:  # rank 0 holds 4 whole experts
            assert (experts.first, experts.count, experts.inter) == (0, 4, 32)
        else:  # every expert, half of each
            assert (experts.first, experts.count, experts.inter) == (0, 8, 16)
        assert Engine(model, CHUNKED, followers=followers).generate(batch, GREEDY) == want
        engine = Engine(model, EngineConfig(block_size=4, num_blocks=512, max_num_seqs=8), num_speculative_tokens=4,
                        followers=followers)
        assert run_spec(engine, make_proposer("ngram", path, path), batch, GREEDY) == want
    finally:
        followers.close()


def test_gpt_oss_mxfp4_experts_dequantize_on_load_as_transformers_does(tmp_path):
    """gpt-oss's published layout: ``experts.{gate_up,down}_proj_blocks`` / ``_scales`` (MXFP4) with
    ``quant_method: mxfp4``. Random nibbles and scales, dequantized by transformers' own function
    into the reference model: our logits equal its. Another quantization of an MoE is refused."""
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    hf = tiny_moe_model("gpt_oss", tmp_path / "bf16", seed=6)
    state = load_file(tmp_path / "bf16" / "model.safetensors")
    gen = torch.Generator().manual_seed(6)
    e, h, i = 8, 64, 32
    packed = {"gate_up_proj": (2 * i, h), "down_proj": (h, i)}  # (stored rows, columns) per expert
    with torch.no_grad():
        for layer in range(3):
            prefix = f"model.layers.{layer}.mlp.experts."
            for proj, (rows, cols) in packed.items():
                blocks = torch.randint(0, 256, (e, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
                scales = torch.randint(122, 128, (e, rows, cols // 32), generator=gen, dtype=torch.uint8)
                dense = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
                getattr(hf.model.layers[layer].mlp.experts, proj).copy_(dense)
                del state[prefix + proj]
                state[prefix + proj + "_blocks"], state[prefix + proj + "_scales"] = blocks, scales
    out = tmp_path / "mxfp4"
    out.mkdir()
    save_file(state, str(out / "model.safetensors"))
    config = json.loads((tmp_path / "bf16" / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["model.layers.*.self_attn",
                                                                                        "model.layers.*.mlp.router"]}
    (out / "config.json").write_text(json.dumps(config))
    model = load_model(out)
    tokens = torch.randint(0, VOCAB, (30,), generator=gen)
    with torch.inference_mode():
        want = hf(tokens[None]).logits[0]
        got = model(tokens, torch.arange(30), AttentionMetadata.build([30], [30], [list(range(8))], 4),
                    _cache(model.cfg)).logits
    assert (got - want).abs().max() < 1e-4
    config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32}
    (out / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="'awq' is not supported for mixtures of experts"):
        load_model(out)


def test_memory_counts_every_expert_and_a_sparse_steps_activations(tmp_path):
    """The weights a worker holds (what --gpu-memory-utilization subtracts) are all experts', and the
    activation estimate takes a sparse layer's per-token rows (k inputs, gate/up, k outputs, logits)."""
    from workers.engine.moe_config import step_intermediate
    from workers.engine.quant import weight_bytes

    tiny_moe_model("qwen3_moe", tmp_path, seed=1)
    model = load_model(tmp_path)
    moe = model.cfg.moe
    experts = 2 * moe.num_experts * 3 * moe.intermediate_size * model.cfg.hidden_size * 4  # 2 sparse layers
    dense = sum(p.numel() * 4 for n, p in model.named_parameters() if ".experts." not in n)
    assert weight_bytes(model)["total"] == experts + dense
    assert step_intermediate(96, 64, None) == 96
    # top-2 of 8 experts of 32 on hidden 64: 2·(2·64 + 3·32) + 8 = 456 per token = 3 × 152
    assert step_intermediate(96, 64, moe) == 152
    assert step_intermediate(4096, 64, moe) == 4096  # a wider dense layer decides


@pytest.mark.parametrize("rope", [
    {"rope_type": "yarn", "rope_theta": 150000.0, "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
     "truncate": False, "original_max_position_embeddings": 4096},  # gpt-oss's
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 16.0, "beta_slow": 2.0,
     "original_max_position_embeddings": 256},  # truncated ramp (the default)
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 8.0, "mscale": 0.707, "mscale_all_dim": 1.0,
     "original_max_position_embeddings": 128},  # the attention factor from the mscale terms
])
def test_yarn_rope_equals_transformers(rope):
    from transformers import GptOssConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from workers.engine.layers import RotaryEmbedding, rope_attention_scale, rope_inv_freq

    hf_cfg = GptOssConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                          num_hidden_layers=2, max_position_embeddings=4096, rope_parameters=rope)
    inv_freq, scale = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg)
    cfg = ModelConfig.from_dict({**hf_cfg.to_dict(), "intermediate_size": 32})
    assert torch.equal(rope_inv_freq(cfg.rope, 16), inv_freq)
    assert rope_attention_scale(cfg.rope) == pytest.approx(scale, rel=1e-12)
    rotary = RotaryEmbedding(cfg.rope, 16, 64)
    freqs = torch.arange(64, dtype=torch.float32)[:, None] * inv_freq[None]
    assert torch.allclose(rotary.cos, freqs.cos() * scale) and torch.allclose(rotary.sin, freqs.sin() * scale)


@pytest.mark.parametrize("moe_family", FAMILIES)
def test_train_draft_builds_an_eagle3_head_for_an_moe_target_that_speculates_losslessly(tmp_path, moe_family):
    """``tandem train-draft`` on a 4-layer MoE of each family (its hidden layers offered as for a dense
    target; the head a Llama layer whatever the target's attention: Qwen3's q/k norms, Qwen2's qkv
    biases, gpt-oss's biases, sinks, windows and YaRN rope): the head it writes drafts for the MoE
    target and greedy output equals plain decoding."""
    import shutil

    from tests.unit.workers.draft.test_train import _quiet
    from workers.demo_model import demo_tokenizer_dir
    from workers.draft.eagle import load_eagle, load_target_parts
    from workers.draft.eagle_proposer import EagleProposer
    from workers.draft.train.checkpoint import head_config
    from workers.draft.train.trainer import TrainConfig, train

    try:
        tokenizer = demo_tokenizer_dir()
    except FileNotFoundError:
        pytest.skip("SmolLM2's tokenizer is not installed")
    target = tmp_path / "target"
    tiny_moe_model(moe_family, target, seed=2, vocab=49152, layers=4, max_positions=512)
    for f in tokenizer.iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, target / f.name)
    out = tmp_path / "head"
    metrics = train(TrainConfig(target=str(target), out=str(out), prompts=6, eval_prompts=2, max_tokens=12,
                                max_len=256, shard_size=4, draft_vocab=512, steps=2, epochs=1, batch_tokens=256,
                                warmup=1, save_every=2, threads=1, dtype="float32"), progress=_quiet)
    assert metrics["train_sequences"] > 0
    embed, lm_head, target_cfg = load_target_parts(target)
    head, layers = load_eagle(out, embed, lm_head, target_cfg, 256)
    assert head.cfg == head_config(target_cfg) and head.cfg.moe is None and not head.cfg.qk_norm  # as trained
    model = load_model(target)
    rng = random.Random(0)
    batch = {f"r{i}": [rng.randrange(49152) for _ in range(rng.randrange(4, 20))] for i in range(8)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    want = Engine(model, EngineConfig(num_blocks=256, block_size=4), eos_token_ids=()).generate(batch, params)
    engine = Engine(model, EngineConfig(num_blocks=256, block_size=4), eos_token_ids=(), num_speculative_tokens=3,
                    hidden_layers=tuple(layers))
    assert run_spec(engine, EagleProposer(head, layers, num_blocks=256, block_size=4), batch, params) == want
    assert engine.counters[""].num_drafts > 0
