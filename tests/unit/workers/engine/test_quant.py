"""Quantized checkpoints: FP8 (compressed-tensors, per tensor and per channel) and INT4 (AWQ, GPTQ,
group 128) load with their weights kept quantized, and give the logits of the dequantized reference.

Tolerance: float32 on CPU, both sides multiply the same dequantized weights, so logits agree to
float rounding: max |Δ| ≤ 1e-4 (logits are O(1)), and greedy tokens are equal. The FP8 reference is
transformers reading the compressed-tensors checkpoint (decompressed); the INT4 one is the model
with the dequantized weights put in before packing (see tests/support/quant.py).
"""

from __future__ import annotations

import pytest
import torch

from runtime.messages import SamplingParams
from tests.support.quant import AWQ_ORDER, pack_awq, pack_gptq, read_fp8_reference, write_fp8, write_int4
from tests.support.tiny_models import hf_greedy
from workers.engine.engine import Engine, EngineConfig
from workers.engine.quant import Fp8Weight, Int4Weight, QuantScheme, weight_bytes
from workers.engine.quant_formats import awq_tensors, gptq_tensors
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

TOLERANCE = 1e-4
PROMPT = [5, 17, 33, 100, 7, 9, 41, 2, 250, 64]


def _tiny(seed: int = 0, bias: bool = False):
    """A seeded random Llama (or Qwen2, with q/k/v biases) whose projections hold 128-wide groups."""
    import transformers as tf

    torch.manual_seed(seed)
    common = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=256, initializer_range=0.2,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)
    model = (tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)) if bias else tf.LlamaForCausalLM(tf.LlamaConfig(**common)))
    return model.eval()


def _logits_ours(model) -> torch.Tensor:
    from workers.engine.attention import AttentionMetadata, allocate_kv_cache

    cfg = model.cfg
    caches = allocate_kv_cache(cfg.num_layers, 4, 16, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
    meta = AttentionMetadata.build([len(PROMPT)], [len(PROMPT)], [[0]], 16, torch.device("cpu"))
    with torch.inference_mode():
        return model(torch.tensor(PROMPT), torch.arange(len(PROMPT)), meta, caches).logits


def _check(ours, reference) -> None:
    with torch.inference_mode():
        want = reference(torch.tensor([PROMPT])).logits[0]
    got = _logits_ours(ours)
    assert (got - want).abs().max().item() <= TOLERANCE
    engine = Engine(ours, EngineConfig(num_blocks=64, block_size=4), eos_token_ids=())
    out = engine.generate({"r": PROMPT}, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))["r"]
    assert out == hf_greedy(reference, PROMPT, 12)


@pytest.mark.parametrize("strategy", ["tensor", "channel"])
def test_fp8_compressed_tensors_checkpoint_matches_its_dequantized_reference(tmp_path, strategy):
    write_fp8(_tiny(), tmp_path / "fp8", strategy)
    assert QuantScheme.of_dir(tmp_path / "fp8") == QuantScheme("fp8", strategy=strategy)
    ours = load_model(tmp_path / "fp8")
    layer = ours.model.layers[0]
    assert isinstance(layer.self_attn.qkv_proj.quant, Fp8Weight) and layer.self_attn.qkv_proj.weight is None
    assert layer.self_attn.qkv_proj.quant.weight.dtype == torch.float8_e4m3fn
    _check(ours, read_fp8_reference(tmp_path / "fp8"))


@pytest.mark.parametrize("method, act_order, bias", [("awq", False, False), ("gptq", False, False),
                                                     ("gptq", True, False), ("awq", False, True)])
def test_int4_checkpoint_matches_its_dequantized_reference(tmp_path, method, act_order, bias):
    reference = write_int4(_tiny(bias=bias), tmp_path / method, method, group=128, act_order=act_order)
    ours = load_model(tmp_path / method)
    assert isinstance(ours.model.layers[1].mlp.down_proj.quant, Int4Weight)
    _check(ours, reference)


def test_packing_follows_the_published_layouts():
    """One word of each layout, from the libraries' packing loops: AutoAWQ puts output column
    AWQ_ORDER[k] in nibble k; GPTQ puts input row 8r + k in nibble k of row r, and zeros minus one."""
    values = torch.arange(8)[None, :]  # one input row, outputs 0..7 hold 0..7
    awq = pack_awq(values.T, torch.zeros(8, 1, dtype=torch.long), torch.ones(8, 1))
    assert awq["qweight"].item() == 0x75316420 and AWQ_ORDER == (0, 2, 4, 6, 1, 3, 5, 7)
    rows = values.repeat(8, 1)  # 8 outputs, each with inputs 0..7 holding 0..7
    zeros = torch.arange(1, 9)[:, None]  # output o's zero is o + 1
    gptq = pack_gptq(rows, zeros, torch.ones(8, 1), torch.zeros(8))
    assert gptq["qweight"][0].tolist() == [0x76543210] * 8 and gptq["qzeros"].item() == 0x76543210
    q, z, s = awq_tensors(awq["qweight"], torch.zeros(1, 1, dtype=torch.int32), torch.ones(1, 8), 1)
    assert q[:, 0].tolist() == list(range(8))
    q, z, s, g = gptq_tensors(gptq["qweight"], gptq["qzeros"], torch.ones(1, 8), None, 8)
    assert q[0].tolist() == list(range(8)) and z[:, 0].tolist() == list(range(1, 9))


def test_weight_memory_per_format(tmp_path):
    """The projections' bytes: FP8 a quarter of float32 (plus a scale per output channel); INT4 an
    eighth (plus a float16 scale and a uint8 zero per group of 128 and an index per input)."""
    base = _tiny()
    base.save_pretrained(tmp_path / "f32")
    dense = weight_bytes(load_model(tmp_path / "f32"))
    write_fp8(_tiny(), tmp_path / "fp8", "channel")
    write_int4(_tiny(), tmp_path / "awq", "awq")
    fp8 = weight_bytes(load_model(tmp_path / "fp8"))
    int4 = weight_bytes(load_model(tmp_path / "awq"))
    projections = sum(p.numel() for n, p in base.named_parameters() if n.split(".")[-2] in (
        "q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    rest = dense["total"] - 4 * projections
    assert dense["quantized"] == 0
    assert fp8["dense"] == int4["dense"] == rest
    assert projections <= fp8["quantized"] <= projections * 1.05
    assert projections / 2 <= int4["quantized"] <= projections / 2 * 1.15


def test_unsupported_quantization_configs_are_refused():
    with pytest.raises(ValueError, match="bitsandbytes"):
        QuantScheme.of({"quantization_config": {"quant_method": "bitsandbytes"}})
    with pytest.raises(ValueError, match="4-bit"):
        QuantScheme.of({"quantization_config": {"quant_method": "gptq", "bits": 8, "group_size": 128}})
    with pytest.raises(ValueError, match="FP8"):
        QuantScheme.of({"quantization_config": {"quant_method": "compressed-tensors", "config_groups": {
            "g": {"format": "pack-quantized", "weights": {"type": "int", "num_bits": 4}}}}})
    assert QuantScheme.of({}) is None


@pytest.mark.parametrize("method", ["fp8", "awq"])
def test_quantizing_in_memory_gives_the_checkpoint_writers_weights(tmp_path, method):
    """``quantize_in_place`` (the GPU bench's 8B-shaped model has no checkpoint) makes what the
    writers make and the loader reads: FP8 per channel as compressed-tensors writes it, INT4 as the
    AWQ GEMM checkpoint of the same min-max quantization."""
    from workers.engine.quant import quantize_in_place

    _tiny().save_pretrained(tmp_path / "f32")
    ours = load_model(tmp_path / "f32")
    assert quantize_in_place(ours, method) == {"dense": 8}
    if method == "fp8":
        write_fp8(_tiny(), tmp_path / "q", "channel")
    else:
        write_int4(_tiny(), tmp_path / "q", "awq", group=128)
    theirs = load_model(tmp_path / "q")
    for mine, ref in zip(ours.modules(), theirs.modules()):
        if getattr(mine, "quant", None) is not None:
            assert mine.weight is None
            for a, b in zip(mine.quant.tensors(), ref.quant.tensors()):
                assert a.dtype == b.dtype and torch.equal(a.float(), b.float())
    assert (_logits_ours(ours) - _logits_ours(theirs)).abs().max().item() == 0


def test_a_gguf_file_served_from_its_q4_1_blocks(tmp_path):
    """``gguf_quantized``: a Llama GGUF with Q4_1 projections (written by gguf-py, q/k rows in
    llama.cpp's order) keeps the file's blocks — 20 bytes per 32 weights, 5/32 of float32 — and
    gives the logits and greedy tokens of the same file dequantized on load by transformers."""
    from tests.support.tiny_models import write_llama_gguf
    from workers.engine.quant import Q4_1Weight

    write_llama_gguf(_tiny(), tmp_path / "tiny.gguf", projections="Q4_1")
    reference = load_model(tmp_path / "tiny.gguf")
    ours = load_model(tmp_path / "tiny.gguf", gguf_quantized=True)
    qkv = ours.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv.quant, Q4_1Weight) and qkv.weight is None
    projections = sum(p.numel() for n, p in reference.named_parameters()
                      if n.endswith(("qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight")))
    assert weight_bytes(ours)["quantized"] == projections * 20 // 32
    assert weight_bytes(ours)["dense"] == weight_bytes(reference)["total"] - 4 * projections
    assert (_logits_ours(ours) - _logits_ours(reference)).abs().max().item() <= TOLERANCE
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [Engine(m, EngineConfig(num_blocks=64, block_size=4), eos_token_ids=()).generate({"r": PROMPT}, params)
            for m in (ours, reference)]
    assert outs[0] == outs[1]
    _tiny().save_pretrained(tmp_path / "dir")
    with pytest.raises(ValueError, match="gguf_quantized needs a .gguf file"):
        load_model(tmp_path / "dir", gguf_quantized=True)


def test_the_target_worker_builds_its_engine_from_a_gguf_kept_quantized(tmp_path):
    """``--gguf-quantized`` reaches the loader: the worker's engine holds Q4_1 projections."""
    from tests.support.tiny_models import write_llama_gguf
    from workers.engine.quant import Q4_1Weight
    from workers.target.__main__ import build_engine, parse_args, target_config

    write_llama_gguf(_tiny(), tmp_path / "tiny.gguf", projections="Q4_1")
    args = parse_args(["--model", str(tmp_path / "tiny.gguf"), "--gguf-quantized", "--num-blocks", "16",
                       "--device", "cpu"])
    engine = build_engine(target_config(args, tmp_path / "tiny.gguf"), "w0")
    assert isinstance(engine.runner.model.model.layers[1].mlp.down_proj.quant, Q4_1Weight)
