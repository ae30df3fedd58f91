"""The mixture-of-experts part of a model's shape, parsed from a Hugging Face ``config.json``: plain
values, no torch (the target worker checks a model's split with it before loading anything).

Families and their routers (what transformers' own modeling code computes):

- ``qwen3_moe``, ``qwen2_moe``: softmax over all experts, top-k, the k weights renormalised to sum
  to 1 when ``norm_topk_prob``; ``decoder_sparse_step`` and ``mlp_only_layers`` say which layers
  are sparse (the others keep a dense MLP of ``intermediate_size``). ``qwen2_moe`` adds a shared
  expert (``shared_expert_intermediate_size``) scaled by ``sigmoid(shared_expert_gate(x))``.
- ``mixtral``: softmax over all experts, top-k, renormalised (the same as a softmax over the k
  chosen logits); every layer sparse.
- ``gpt_oss``: a router with a bias; top-k of the logits, then a softmax over those k; experts with
  biases and the clamped SwiGLU ``(clamp(up, ±limit) + 1) · g · sigmoid(alpha · g)``,
  ``g = clamp(gate, max=limit)``; every layer sparse.

A config that asks for a router this engine does not compute (a scoring function other than
softmax, grouped top-k, a routed scaling factor) raises ``ValueError`` naming the field.
"""

from __future__ import annotations

from dataclasses import dataclass

MOE_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss")
SCORINGS = ("softmax_topk", "topk_softmax")  # softmax over all then top-k; top-k of logits then softmax
ACTIVATIONS = ("silu", "swiglu_clamped")


@dataclass(frozen=True)
class MoeConfig:
    """Routed experts of every sparse layer: ``num_experts`` of ``intermediate_size``, ``top_k`` per token."""

    num_experts: int
    top_k: int
    intermediate_size: int
    sparse_layers: tuple[int, ...]  # layer indices with experts; the others have a dense MLP
    scoring: str = "softmax_topk"
    norm_topk_prob: bool = False  # softmax_topk: renormalise the k weights to sum to 1
    router_bias: bool = False
    expert_bias: bool = False
    activation: str = "silu"
    swiglu_alpha: float = 1.702
    swiglu_limit: float = 7.0
    shared_intermediate_size: int = 0  # a shared expert beside the routed ones (0: none)

    def __post_init__(self):
        if self.num_experts <= 0:
            raise ValueError(f"num_experts must be positive, got {self.num_experts}")
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in 1..num_experts ({self.num_experts}), got {self.top_k}")
        if self.intermediate_size <= 0:
            raise ValueError(f"moe_intermediate_size must be positive, got {self.intermediate_size}")
        if self.scoring not in SCORINGS:
            raise ValueError(f"unsupported MoE scoring {self.scoring!r}; supported: {SCORINGS}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MoE expert activation {self.activation!r}; supported: {ACTIVATIONS}")
        if self.shared_intermediate_size < 0:
            raise ValueError(f"shared_expert_intermediate_size must be >= 0, got {self.shared_intermediate_size}")

    def is_sparse(self, layer: int) -> bool:
        return layer in self.sparse_layers

    def local_experts(self, rank: int, size: int) -> tuple[int, int]:
        """(first, count) of the experts rank ``rank`` of ``size`` holds under expert parallelism:
        an equal contiguous share; raises ValueError when they do not divide evenly."""
        if self.num_experts % size:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by the expert-parallel size "
                             f"({size}) to shard experts evenly")
        per = self.num_experts // size
        return rank * per, per


# router settings of other MoE families that this engine does not compute, with the value that
# means "the plain router" (a config may carry the key with that value)
_PLAIN_ROUTER = {"scoring_func": ("softmax",), "topk_method": ("greedy",), "n_group": (None, 0, 1),
                 "topk_group": (None, 0, 1), "routed_scaling_factor": (None, 1, 1.0), "moe_router_type": ("softmax",)}


def parse_moe(cfg: dict, model_type: str, num_layers: int) -> MoeConfig | None:
    """The MoE config of a Hugging Face config dict (None for a dense ``model_type``); raises
    ValueError naming the field for routers, activations or sizes the engine cannot serve."""
    if model_type not in MOE_MODEL_TYPES:
        return None
    for key, plain in _PLAIN_ROUTER.items():
        if key in cfg and cfg[key] not in plain:
            raise ValueError(f"unsupported MoE router: {key}={cfg[key]!r} (supported: {plain[0]!r})")
    experts = cfg.get("num_local_experts", cfg.get("num_experts"))
    if experts is None:
        raise ValueError(f"{model_type} config has no num_experts / num_local_experts")
    if int(experts) == 0:  # transformers' Qwen MoE classes then build every layer dense
        return None
    top_k = int(cfg.get("num_experts_per_tok", 2))
    if model_type in ("qwen3_moe", "qwen2_moe"):
        step = int(cfg.get("decoder_sparse_step", 1))
        if step <= 0:
            raise ValueError(f"decoder_sparse_step must be positive, got {step}")
        dense = set(cfg.get("mlp_only_layers") or [])
        sparse = tuple(i for i in range(num_layers) if i not in dense and int(experts) > 0 and (i + 1) % step == 0)
        return MoeConfig(num_experts=int(experts), top_k=top_k, intermediate_size=int(cfg["moe_intermediate_size"]),
                         sparse_layers=sparse, norm_topk_prob=bool(cfg.get("norm_topk_prob", False)),
                         shared_intermediate_size=int(cfg.get("shared_expert_intermediate_size") or 0)
                         if model_type == "qwen2_moe" else 0)
    if model_type == "mixtral":
        return MoeConfig(num_experts=int(experts), top_k=top_k, intermediate_size=int(cfg["intermediate_size"]),
                         sparse_layers=tuple(range(num_layers)), norm_topk_prob=True)
    return MoeConfig(num_experts=int(experts), top_k=top_k, intermediate_size=int(cfg["intermediate_size"]),
                     sparse_layers=tuple(range(num_layers)), scoring="topk_softmax", router_bias=True,
                     expert_bias=True, activation="swiglu_clamped", swiglu_alpha=float(cfg.get("swiglu_alpha", 1.702)),
                     swiglu_limit=float(cfg.get("swiglu_limit", 7.0)))


def step_intermediate(intermediate_size: int, hidden_size: int, moe: MoeConfig | None) -> int:
    """The MLP width a step's activation estimate (:func:`workers.engine.memory.step_activation_bytes`,
    which counts 3 × width per token: gate, up, product) must assume: a sparse layer holds, per token,
    its k gathered input rows, their gate/up and product, k weighted outputs and the router's logits
    (and a shared expert's gate/up/product), which can exceed a dense layer's."""
    if moe is None:
        return intermediate_size
    per_token = (moe.top_k * (2 * hidden_size + 3 * moe.intermediate_size) + moe.num_experts
                 + 3 * moe.shared_intermediate_size)
    return max(intermediate_size, -(-per_token // 3))
