"""What a Gemma 3 text model (``model_type`` ``gemma3_text``) adds to a Llama-shaped decoder, read from
its ``config.json`` (transformers' ``Gemma3TextConfig``, 4.x and 5.x layouts):

- RMSNorm weights applied as ``1 + w``, in float32, before and after both attention and MLP;
- embeddings scaled by ``sqrt(hidden_size)`` (in the model's dtype);
- q/k RMSNorm per head; attention scale ``query_pre_attn_scalar ** -0.5`` instead of ``head_dim ** -0.5``;
- interleaved local (sliding-window) and global layers: ``layer_types``, or every
  ``sliding_window_pattern``-th layer global when a config lists none; two rope bases (parsed by
  :mod:`workers.engine.config`);
- a GELU-tanh gated MLP (``hidden_activation`` ``gelu_pytorch_tanh``);
- optional tanh soft-capping of the attention scores and of the final logits.

The layers themselves: :mod:`workers.engine.gemma3`.
"""

from __future__ import annotations

from dataclasses import dataclass

ACTIVATIONS = ("gelu_pytorch_tanh",)


@dataclass(frozen=True)
class Gemma3Options:
    query_pre_attn_scalar: float
    layer_types: tuple[str, ...]
    hidden_activation: str = "gelu_pytorch_tanh"
    attn_logit_softcapping: float | None = None
    final_logit_softcapping: float | None = None

    def __post_init__(self):
        if self.query_pre_attn_scalar <= 0:
            raise ValueError(f"query_pre_attn_scalar must be positive, got {self.query_pre_attn_scalar}")
        if self.hidden_activation not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_activation {self.hidden_activation!r}; supported: {ACTIVATIONS}")
        for name in ("attn_logit_softcapping", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be positive or null, got {value}")

    @property
    def attention_scale(self) -> float:
        return self.query_pre_attn_scalar ** -0.5


def parse_gemma3(cfg: dict) -> Gemma3Options:
    """The Gemma 3 parts of a ``gemma3_text`` config dict; ValueError names a field the engine cannot serve."""
    if cfg.get("use_bidirectional_attention"):
        raise ValueError("use_bidirectional_attention is not supported (Gemma 3 as a causal LM only)")
    layers = int(cfg["num_hidden_layers"])
    layer_types = cfg.get("layer_types")
    if not layer_types:  # transformers' rule: every pattern-th layer is global
        pattern = int(cfg.get("sliding_window_pattern") or cfg.get("_sliding_window_pattern") or 6)
        layer_types = ["sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(layers)]
    activation = cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"
    return Gemma3Options(
        query_pre_attn_scalar=float(cfg.get("query_pre_attn_scalar", 256)),
        layer_types=tuple(layer_types),
        hidden_activation=activation,
        attn_logit_softcapping=_optional(cfg.get("attn_logit_softcapping")),
        final_logit_softcapping=_optional(cfg.get("final_logit_softcapping")),
    )


def _optional(value) -> float | None:
    return None if value is None else float(value)
