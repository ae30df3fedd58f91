"""Random EAGLE-1 and EAGLE-3 head checkpoints for the tiny speculative-decoding targets
(:data:`tests.support.tiny_models.SPEC_VOCAB`, hidden size :data:`H`), written in code to a directory."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file

from tests.support.tiny_models import SPEC_VOCAB as VOCAB

H, HEADS, KV_HEADS, INTER = 64, 4, 2, 128


def layer_tensors(prefix: str, gen: torch.Generator, qkv_in: int = H, input_norm: bool = True) -> dict:
    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    d = H // HEADS
    t = {f"{prefix}.self_attn.q_proj.weight": w(HEADS * d, qkv_in), f"{prefix}.self_attn.k_proj.weight": w(KV_HEADS * d, qkv_in),
         f"{prefix}.self_attn.v_proj.weight": w(KV_HEADS * d, qkv_in), f"{prefix}.self_attn.o_proj.weight": w(H, HEADS * d),
         f"{prefix}.mlp.gate_proj.weight": w(INTER, H), f"{prefix}.mlp.up_proj.weight": w(INTER, H),
         f"{prefix}.mlp.down_proj.weight": w(H, INTER), f"{prefix}.post_attention_layernorm.weight": torch.ones(H)}
    if input_norm:
        t[f"{prefix}.input_layernorm.weight"] = torch.ones(H)
    return t


def config(**extra) -> dict:
    return {"model_type": "llama", "hidden_size": H, "intermediate_size": INTER, "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS, "num_hidden_layers": 1, "vocab_size": VOCAB, "rms_norm_eps": 1e-6,
            "max_position_embeddings": 512, **extra}


def write_eagle1(path, seed=0):
    gen = torch.Generator().manual_seed(seed)
    state = {"fc.weight": torch.randn(H, 2 * H, generator=gen) * 0.1, "fc.bias": torch.zeros(H),
             **layer_tensors("layers.0", gen, input_norm=False)}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config()))


def write_eagle3(path, seed=0, draft_vocab=48):
    gen = torch.Generator().manual_seed(seed)
    state = {"fc.weight": torch.randn(H, 3 * H, generator=gen) * 0.1,
             **layer_tensors("midlayer", gen, qkv_in=2 * H), "midlayer.hidden_norm.weight": torch.ones(H),
             "norm.weight": torch.ones(H), "lm_head.weight": torch.randn(draft_vocab, H, generator=gen) * 0.1,
             # draft token i is target token 2i: d2t holds the offsets
             "d2t": torch.arange(draft_vocab, dtype=torch.long), "t2d": torch.zeros(VOCAB, dtype=torch.bool)}
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps(config(draft_vocab_size=draft_vocab, target_hidden_size=H,
                                                         eagle_config={"eagle_aux_hidden_state_layer_ids": [1, 2, 3]})))
