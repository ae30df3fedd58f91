"""Tiny seeded random mixtures of experts, built with transformers' own config and model classes and
saved with ``save_pretrained`` (what that writes is what the engine must load)."""

from __future__ import annotations

from pathlib import Path

import torch

MOE_FAMILIES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")


def tiny_moe_model(family: str, path: Path, *, seed: int = 0, vocab: int = 256, layers: int = 3,
                   experts: int = 8, top_k: int = 2, max_positions: int = 1024, **overrides):
    """Save a seeded random tiny ``family`` MoE under ``path``; returns the transformers model (eval).

    ``qwen3_moe``: layer 1 dense (``mlp_only_layers``), renormalised top-k; ``qwen2_moe``: a shared
    expert and qkv biases; ``mixtral``: every layer sparse; ``gpt_oss``: router and expert biases,
    attention biases and sinks, alternating sliding-window layers (window 8) and YaRN rope. Every
    router, bias and sink is drawn at random (transformers starts some of them at zero)."""
    import transformers as tf

    common = dict(hidden_size=64, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, vocab_size=vocab, max_position_embeddings=max_positions, initializer_range=0.2,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None, tie_word_embeddings=False,
                  num_experts_per_tok=top_k)
    if family == "qwen3_moe":
        cfg = tf.Qwen3MoeConfig(**{**common, "intermediate_size": 96, "moe_intermediate_size": 32,
                                   "num_experts": experts, "norm_topk_prob": True, "mlp_only_layers": [1],
                                   **overrides})
        cls = tf.Qwen3MoeForCausalLM
    elif family == "qwen2_moe":
        cfg = tf.Qwen2MoeConfig(**{**common, "intermediate_size": 96, "moe_intermediate_size": 32,
                                   "shared_expert_intermediate_size": 48, "num_experts": experts,
                                   "norm_topk_prob": False, **overrides})
        cls = tf.Qwen2MoeForCausalLM
    elif family == "mixtral":
        cfg = tf.MixtralConfig(**{**common, "intermediate_size": 32, "num_local_experts": experts,
                                  "sliding_window": None, **overrides})
        cls = tf.MixtralForCausalLM
    elif family == "gpt_oss":
        rope = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": False, "original_max_position_embeddings": max_positions // 4}
        cfg = tf.GptOssConfig(**{**common, "intermediate_size": 32, "num_local_experts": experts,
                                 "sliding_window": 8, "rope_parameters": rope, **overrides})
        cls = tf.GptOssForCausalLM
    else:
        raise ValueError(family)
    torch.manual_seed(seed)
    model = cls(cfg).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(("gate.weight", "router.weight", "router.bias", "sinks", "_bias")) or (
                    name.endswith(".bias") and "self_attn" in name):
                param.normal_(0, 0.5)
    model.save_pretrained(path)
    return model
