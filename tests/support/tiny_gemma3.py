"""A seeded random-weight Gemma 3 text model built from transformers' own config and code: local
(sliding-window) and global layers interleaved, two rope bases, linear rope scaling on the global
layers, ``query_pre_attn_scalar`` unlike ``head_dim``, final logit soft-capping, tied embeddings
and random norm weights (transformers starts them at zero, which would hide the ``1 + w``), the
post-attention and post-MLP ones large so that greedy outputs vary."""

from __future__ import annotations

from pathlib import Path

import torch

WINDOW = 8


def tiny_gemma3(path: Path | None = None, *, seed: int = 0, layers: int = 4, vocab: int = 256, window: int = WINDOW,
                max_positions: int = 512, **overrides):
    """The HF ``Gemma3ForCausalLM`` (eval, float32, eager attention), saved under ``path`` if given."""
    import transformers as tf

    cfg = tf.Gemma3TextConfig(**{
        "vocab_size": vocab, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": layers,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 32, "max_position_embeddings": max_positions,
        "sliding_window": window, "sliding_window_pattern": 2, "query_pre_attn_scalar": 24,
        "rope_local_base_freq": 100.0, "rope_theta": 10000.0, "rope_scaling": {"rope_type": "linear", "factor": 2.0},
        "final_logit_softcapping": 5.0, "initializer_range": 0.2, "eos_token_id": None, "bos_token_id": None,
        "pad_token_id": None, **overrides})
    cfg._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = tf.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():  # blocks that outweigh the residual: else tied embeddings just echo the last token
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(4.0 if "post_" in name else 0.0, 0.3)
        model.model.embed_tokens.weight.mul_(0.5)
    if path is not None:
        model.save_pretrained(path)
    return model
