"""Writes an EAGLE-3 head in the ``speculators`` layout (config.json + model.safetensors), which vLLM
and the ``speculators`` package load and :func:`workers.draft.eagle.load_eagle` reads back.

config.json: ``speculators_model_type: eagle3``, the layer's Llama config under
``transformer_layer_config`` (its ``vocab_size`` is the target's), ``draft_vocab_size``,
``target_hidden_size``, ``eagle_aux_hidden_state_layer_ids`` (our numbering = vLLM's: the input of
decoder layer k), ``norm_before_residual`` and the optional norms all written explicitly, and
``speculators_config`` (algorithm, proposal method, verifier). Tensors: ``fc.weight``,
``layers.0.*`` with q/k/v and gate/up unfused, ``norm.weight``, ``lm_head.weight``, ``d2t`` (int64,
target = draft + d2t[draft]) and ``t2d`` (bool over the target vocabulary). The embedding is the
target's and is not written (vLLM uses the target's when a head has none).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

from ...engine.config import ModelConfig
from ..eagle import Eagle3Head

SPECULATORS_VERSION = "0.9.0"


def layer_config(cfg: ModelConfig) -> dict:
    rope = cfg.rope
    rope_params = {"rope_theta": rope.theta, "rope_type": rope.rope_type}
    if rope.rope_type != "default":
        rope_params.update(factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                           high_freq_factor=rope.high_freq_factor,
                           original_max_position_embeddings=rope.original_max_position_embeddings)
    if rope.rope_type == "yarn":  # gpt-oss
        rope_params.update(beta_fast=rope.beta_fast, beta_slow=rope.beta_slow, truncate=rope.truncate,
                           **{k: getattr(rope, k) for k in ("attention_factor", "mscale", "mscale_all_dim")
                              if getattr(rope, k) is not None})
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": cfg.hidden_size,
            "intermediate_size": cfg.intermediate_size, "num_hidden_layers": 1, "num_attention_heads": cfg.num_heads,
            "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim, "hidden_act": "silu",
            "rms_norm_eps": cfg.rms_norm_eps, "max_position_embeddings": cfg.max_position_embeddings,
            "vocab_size": cfg.vocab_size, "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False,
            "rope_theta": rope.theta, "rope_parameters": rope_params,
            **({"rope_scaling": rope_params} if rope.rope_type != "default" else {})}


def head_config(target: ModelConfig) -> ModelConfig:
    """The config of a head trained for ``target``: one Llama layer of the target's width, heads and
    rope, whatever the target's own layers hold (q/k norms, qkv biases, experts, sinks, sliding
    windows): exactly what :func:`layer_config` writes and :func:`workers.draft.eagle.load_eagle`
    reads back, so the head trained is the head served (vLLM's and SpecForge's heads for Qwen3 and
    MoE targets are Llama layers too)."""
    return ModelConfig.from_dict(layer_config(target))


def save_eagle3(head: Eagle3Head, t2d: torch.Tensor, out_dir: str | Path, *, layers: list[int],
                verifier: str, num_speculative_tokens: int, dtype: torch.dtype = torch.float16,
                extra: dict | None = None) -> Path:
    """Write ``head`` to ``out_dir``; returns the directory."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg = head.cfg
    q, kv = cfg.q_size, cfg.kv_size
    layer = head.midlayer
    qkv = layer.self_attn.qkv_proj.weight.detach()
    gate, up = layer.mlp.gate_up_proj.weight.detach().chunk(2, dim=0)
    tensors = {
        "fc.weight": head.fc.weight,
        "layers.0.self_attn.q_proj.weight": qkv[:q], "layers.0.self_attn.k_proj.weight": qkv[q : q + kv],
        "layers.0.self_attn.v_proj.weight": qkv[q + kv :],
        "layers.0.self_attn.o_proj.weight": layer.self_attn.o_proj.weight,
        "layers.0.mlp.gate_proj.weight": gate, "layers.0.mlp.up_proj.weight": up,
        "layers.0.mlp.down_proj.weight": layer.mlp.down_proj.weight,
        "layers.0.input_layernorm.weight": layer.input_layernorm.weight,
        "layers.0.hidden_norm.weight": layer.hidden_norm.weight,
        "layers.0.post_attention_layernorm.weight": layer.post_attention_layernorm.weight,
        "norm.weight": head.norm.weight, "lm_head.weight": head.lm_head.weight,
    }
    state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in tensors.items()}
    state["d2t"] = head.d2t.detach().to(torch.long).cpu().contiguous()
    state["t2d"] = t2d.to(torch.bool).cpu().contiguous()
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
        "speculators_version": SPECULATORS_VERSION, "transformer_layer_config": layer_config(cfg),
        "draft_vocab_size": int(head.lm_head.weight.shape[0]), "target_hidden_size": int(head.fc.weight.shape[1] // 3),
        "eagle_aux_hidden_state_layer_ids": list(layers), "norm_before_residual": bool(layer.norm_before_residual),
        "norm_before_fc": False, "fc_norm": False, "norm_output": False, "embed_requires_grad": False,
        "tie_word_embeddings": False, "dtype": str(dtype).removeprefix("torch."),
        "speculators_config": {
            "algorithm": "eagle3", "default_proposal_method": "greedy",
            "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": num_speculative_tokens,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "verifier": {"name_or_path": verifier, "architectures": ["LlamaForCausalLM"]},
        },
        **({"tandem": extra} if extra else {}),
    }
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
