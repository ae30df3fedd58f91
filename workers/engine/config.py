"""Model and engine configuration: the model's shape parsed from a Hugging Face ``config.json``.

Supported families: Llama 2/3 (incl. ``llama3`` rope scaling), Mistral, Qwen2 (qkv bias) and
Qwen3 (per-head q/k RMSNorm), and the mixtures of experts Qwen3-MoE, Qwen2-MoE, Mixtral and gpt-oss
(attention sinks, alternating sliding-window layers; the experts: :mod:`workers.engine.moe_config`). Both the transformers 4.x keys (``rope_theta`` +
``rope_scaling``) and the 5.x key (``rope_parameters``) are understood; rope scaling ``yarn``
(gpt-oss, long-context Qwen) too. Gemma 3 (``gemma3_text``: :mod:`workers.engine.gemma3_config`)
adds per-layer-type ropes (``rope_parameters`` keyed by layer type, or 4.x's ``rope_local_base_freq``).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from .gemma3_config import Gemma3Options, parse_gemma3
from .moe_config import MoeConfig, parse_moe

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss",
                         "gemma3_text")
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters; ``rope_type`` is one of :data:`SUPPORTED_ROPE_TYPES`."""

    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn: the ramp between extrapolated and interpolated frequencies, and the cos/sin scale
    # (None: 0.1 ln(factor) + 1, or the ratio of the mscale terms when both are given)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    truncate: bool = True
    attention_factor: float | None = None
    mscale: float | None = None
    mscale_all_dim: float | None = None

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
    moe: MoeConfig | None = None  # routed experts (mixtures of experts); None: dense
    attention_sinks: bool = False  # gpt-oss: a learned logit per head in every softmax's denominator
    # per layer "sliding_attention" or "full_attention" (Gemma 3, gpt-oss, Qwen2's max_window_layers);
    # (): every layer slides when sliding_window is set (Mistral)
    layer_types: tuple[str, ...] = ()
    local_rope: RopeConfig | None = None  # the sliding layers' rope where it differs (Gemma 3's local base)
    gemma: Gemma3Options | None = None  # Gemma 3's norms, scaled embeddings, GELU, soft-capping

    def __post_init__(self):
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"unsupported model_type {self.model_type!r}; supported: {SUPPORTED_MODEL_TYPES}")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})")
        if self.layer_types and (len(self.layer_types) != self.num_layers
                                 or not set(self.layer_types) <= {"sliding_attention", "full_attention"}):
            raise ValueError(f"layer_types must give 'sliding_attention' or 'full_attention' for each of the "
                             f"{self.num_layers} layers, got {list(self.layer_types)}")

    def window(self, layer: int) -> int | None:
        """Decoder layer ``layer``'s sliding window (it attends to its last W positions); None: all."""
        if self.sliding_window is None or (self.layer_types and self.layer_types[layer] != "sliding_attention"):
            return None
        return self.sliding_window

    def rope_of(self, layer: int) -> RopeConfig:
        """Decoder layer ``layer``'s rotary embedding."""
        if self.local_rope is not None and self.window(layer) is not None:
            return self.local_rope
        return self.rope

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
        if model_type != "gemma3_text" and cfg.get("hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(f"unsupported hidden_act {cfg.get('hidden_act')!r}")
        attention_bias = bool(cfg.get("attention_bias", False))
        window = cfg.get("sliding_window")
        if model_type == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        if model_type == "qwen3" and not cfg.get("use_sliding_window", False):
            window = None
        if model_type in ("qwen3_moe", "qwen2_moe") and not cfg.get("use_sliding_window", False):
            window = None
        qwen2_bias = model_type == "qwen2" or (model_type == "qwen2_moe" and bool(cfg.get("qkv_bias", True)))
        layers = int(cfg["num_hidden_layers"])
        layer_types = tuple(cfg.get("layer_types") or ())
        if not layer_types and window and model_type in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
            # transformers' rule for configs written without layer_types: layers from max_window_layers on slide
            first = int(cfg.get("max_window_layers", layers))
            layer_types = tuple("sliding_attention" if i >= first else "full_attention" for i in range(layers))
        gemma = parse_gemma3(cfg) if model_type == "gemma3_text" else None
        if gemma is not None:
            layer_types = gemma.layer_types
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
            rope=_parse_rope(cfg, "full_attention"),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qwen2_bias or attention_bias,
            o_bias=attention_bias and model_type not in ("qwen2", "qwen2_moe"),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
            sliding_window=int(window) if window else None,
            eos_token_ids=eos_ids,
            moe=parse_moe(cfg, model_type, int(cfg["num_hidden_layers"])),
            attention_sinks=model_type == "gpt_oss",
            layer_types=layer_types,
            local_rope=_parse_rope(cfg, "sliding_attention") if gemma is not None else None,
            gemma=gemma,
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


def _parse_rope(cfg: dict, layer_type: str = "full_attention") -> RopeConfig:
    """The rope of ``layer_type``'s layers. transformers 5 keys ``rope_parameters`` by layer type for
    models whose layers differ (Gemma 3); in 4.x configs Gemma 3's sliding layers have only a base
    (``rope_local_base_freq``, default 10 000) and its ``rope_scaling`` is the global layers'."""
    params = dict(cfg.get("rope_parameters") or {})
    if layer_type in params and isinstance(params[layer_type], dict):
        params = dict(params[layer_type])
    elif cfg.get("model_type") == "gemma3_text" and layer_type == "sliding_attention":
        return RopeConfig(theta=float(cfg.get("rope_local_base_freq", 10000.0)))
    legacy = cfg.get("rope_scaling") or {}
    if legacy:
        params = {**legacy, **params}
    default_theta = 1_000_000.0 if cfg.get("model_type") == "gemma3_text" else 10000.0
    theta = float(params.get("rope_theta", cfg.get("rope_theta", default_theta)))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if "partial_rotary_factor" in params and params["partial_rotary_factor"] != 1.0:
        raise ValueError("partial rotary embeddings are not supported")
    original = int(params.get("original_max_position_embeddings", cfg.get("max_position_embeddings", 8192)))
    factor = params.get("factor", 1.0)
    yarn = {}
    if rope_type == "yarn":  # as transformers' _compute_yarn_parameters reads them
        original = int(cfg.get("original_max_position_embeddings") or original)
        if factor is None:
            factor = cfg.get("max_position_embeddings", original) / original
        optional = {k: float(params[k]) for k in ("attention_factor", "mscale", "mscale_all_dim")
                    if params.get(k) is not None}
        yarn = dict(beta_fast=float(params.get("beta_fast") or 32.0), beta_slow=float(params.get("beta_slow") or 1.0),
                    truncate=bool(params.get("truncate", True)), **optional)
    return RopeConfig(
        theta=theta,
        rope_type=rope_type,
        factor=float(factor),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=original,
        **yarn,
    )
