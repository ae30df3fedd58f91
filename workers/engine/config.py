"""Model and engine configuration: the model's shape parsed from a Hugging Face ``config.json``.

Supported families: Llama 2/3 (incl. ``llama3`` rope scaling), Mistral, Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm). Both the transformers 4.x keys (``rope_theta`` + ``rope_scaling``)
and the 5.x key (``rope_parameters``) are understood.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES`."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192

    def __post_init__(self):
        if self.rope_type not in SUPPORTED_ROPE_TYPES:
            raise ValueError(f"unsupported rope type {self.rope_type!r}; supported: {SUPPORTED_ROPE_TYPES}")
        if self.theta <= 0 or self.factor <= 0:
            raise ValueError("rope theta and factor must be positive")


@dataclass(frozen=True)
class ModelConfig:
    """The shape of a Llama-family decoder."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False  # Qwen2; Llama's attention_bias
    o_bias: bool = False  # Llama's attention_bias also covers o_proj
    mlp_bias: bool = False
    qk_norm: bool = False  # Qwen3
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, cfg: dict) -> ModelConfig:
        """Parse a Hugging Face config dict; raises ValueError for unsupported models."""
        model_type = cfg.get("model_type", "")
        heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        head_dim = cfg.get("head_dim") or hidden // heads
        if cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
        attention_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        if model_type == "qwen3" and not cfg.get("use_sliding_window", False):
            window = None
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope=_parse_rope(cfg),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=(model_type == "qwen2") or attention_bias,
            o_bias=attention_bias and model_type != "qwen2",
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type == "qwen3",
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        """Read ``config.json`` from a model directory."""
        config_path = Path(path) / "config.json"
        if not config_path.exists():
            raise ValueError(f"no config.json in {path}")
        raw = json.loads(config_path.read_text())
        generation = Path(path) / "generation_config.json"
        if generation.exists():  # Llama 3 lists its extra end-of-turn ids only here
            extra = json.loads(generation.read_text()).get("eos_token_id")
            ids = extra if isinstance(extra, list) else ([extra] if extra is not None else [])
            base = raw.get("eos_token_id")
            base = base if isinstance(base, list) else ([base] if base is not None else [])
            raw["eos_token_id"] = sorted(set(base) | set(ids))
        return cls.from_dict(raw)


def _parse_rope(cfg: dict) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    legacy = cfg.get("rope_scaling") or {}
    if legacy:
        params = {**legacy, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if "partial_rotary_factor" in params and params["partial_rotary_factor"] != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192))),
    )
