"""Tiny random Hugging Face checkpoints (built in code, saved to a tmp dir) and HF reference loops."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "llama3", "qwen2", "qwen3", "mistral")
# The vocabulary of the speculative-decoding tests' tiny targets, drafts and heads.
SPEC_VOCAB = 96


def tiny_hf_model(family: str, path: Path, *, seed: int = 0, tied: bool = False, vocab: int = 256,
                  layers: int = 2, max_positions: int = 512):
    """Save a seeded random tiny model of ``family`` under ``path``; returns the HF model (eval)."""
    import transformers as tf

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=layers, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=max_positions,
                  tie_word_embeddings=tied, initializer_range=0.2, eos_token_id=None, bos_token_id=None,
                  pad_token_id=None)
    if family == "llama":
        cfg = tf.LlamaConfig(**common)
    elif family == "llama3":
        cfg = tf.LlamaConfig(**common, rope_theta=500000.0, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32})
    elif family == "qwen2":
        cfg = tf.Qwen2Config(**common)
    elif family == "qwen3":
        cfg = tf.Qwen3Config(**common, head_dim=32)
    elif family == "mistral":
        cfg = tf.MistralConfig(**common, sliding_window=None)
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    cls = {"qwen2": tf.Qwen2ForCausalLM, "qwen3": tf.Qwen3ForCausalLM, "mistral": tf.MistralForCausalLM}.get(
        family, tf.LlamaForCausalLM)
    model = cls(cfg).eval()
    if family == "qwen2":  # random, non-zero qkv biases so the bias path is exercised
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    model.save_pretrained(path)
    return model



def tiny_model_dir(tmp_path_factory, family: str = "llama", **options) -> Path:
    """A fresh directory from pytest's ``tmp_path_factory`` holding ``tiny_hf_model(family, …, **options)``."""
    path = tmp_path_factory.mktemp(f"tiny-{family}")
    tiny_hf_model(family, path, **options)
    return path


def tiny_model_fixture(family: str = "llama", *, load: bool = False, **options):
    """A module-scoped pytest fixture, named by the module attribute it is assigned to
    (``target_dir = tiny_model_fixture(seed=1, vocab=SPEC_VOCAB)``): the directory of
    :func:`tiny_model_dir`, or with ``load`` the engine model loaded from it."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        path = tiny_model_dir(tmp_path_factory, family, **options)
        if not load:
            return path
        from workers.engine.weights import load_model

        return load_model(path)

    return fixture


def target_and_draft_fixture(seed: int, vocab: int = SPEC_VOCAB):
    """A module-scoped pytest fixture (named as :func:`tiny_model_fixture`'s) of the speculative tests'
    checkpoint pair: a 2-layer llama target of ``seed`` and a 1-layer draft of ``seed + 1``, one vocabulary."""
    import pytest

    @pytest.fixture(scope="module")
    def fixture(tmp_path_factory):
        return (tiny_model_dir(tmp_path_factory, seed=seed, vocab=vocab, layers=2),
                tiny_model_dir(tmp_path_factory, seed=seed + 1, vocab=vocab, layers=1))

    return fixture


@torch.inference_mode()
def hf_greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation with transformers' own KV cache, ignoring eos (on the model's device)."""
    device = next(model.parameters()).device
    out = model(torch.tensor([prompt], device=device), use_cache=True)
    past, tokens = out.past_key_values, []
    for _ in range(steps):
        token = int(out.logits[0, -1].argmax())
        tokens.append(token)
        out = model(torch.tensor([[token]], device=device), past_key_values=past, use_cache=True)
        past = out.past_key_values
    return tokens


_GGUF_NAMES = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}


def write_llama_gguf(model, path: Path, projections: str = "F32") -> None:
    """Write a HF Llama model as a GGUF file the way llama.cpp's converter lays it out (q/k rows
    permuted for its rotary layout), so transformers' GGUF loader can read it back. ``projections``:
    the layer projections' type, F32 or Q4_1 (quantized by gguf-py, llama.cpp's reference code)."""
    import gguf
    import numpy as np

    cfg = model.config

    def permute(w, heads):
        return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)

    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name("tiny")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    for i in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in _GGUF_NAMES.items():
            t = state[f"model.layers.{i}.{hf_name}.weight"]
            if gguf_name == "attn_q":
                t = permute(t, cfg.num_attention_heads)
            elif gguf_name == "attn_k":
                t = permute(t, cfg.num_key_value_heads)
            t = np.ascontiguousarray(t)
            if projections != "F32" and t.ndim == 2:
                qtype = gguf.GGMLQuantizationType[projections]
                writer.add_tensor(f"blk.{i}.{gguf_name}.weight", gguf.quants.quantize(t, qtype),
                                  raw_dtype=qtype)
            else:
                writer.add_tensor(f"blk.{i}.{gguf_name}.weight", t)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_model_with_demo_tokenizer(path: Path, max_positions: int) -> Path:
    """A one-layer tiny Llama in ``path`` that speaks SmolLM2's tokenizer (49,152 tokens, eos 2), for stacks
    that serve chat over HTTP; skips the test when the tokenizer is not installed."""
    import json
    import shutil

    import pytest

    from workers.demo_model import demo_tokenizer_dir

    try:
        tokenizer = demo_tokenizer_dir()
    except FileNotFoundError:
        pytest.skip("SmolLM2's tokenizer is not installed")
    tiny_hf_model("llama", path, vocab=49152, layers=1, max_positions=max_positions)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    for item in tokenizer.iterdir():
        if item.is_file() and not item.name.startswith(".") and item.name != "config.json":
            shutil.copy(item, path / item.name)
    return path
