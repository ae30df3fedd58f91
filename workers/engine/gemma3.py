"""Gemma 3's decoder (``gemma3_text``) on the engine's paged attention, as transformers'
``Gemma3ForCausalLM`` computes it (what differs from Llama: :mod:`workers.engine.gemma3_config`).

One layer, x [T, hidden]:

    h = x + post_attention_norm(attention(input_norm(x)))        norms: x̂ · (1 + w), in float32
    y = h + post_feedforward_norm(mlp(pre_feedforward_norm(h)))  mlp: down(gelu_tanh(gate) · up)

Attention normalizes q and k per head, rotates them with the layer type's rope (local layers:
``rope_local_base_freq``, global layers: ``rope_theta`` and its scaling), scales scores by
``query_pre_attn_scalar ** -0.5`` and, on local layers, attends to the last ``sliding_window``
positions only. The embeddings are multiplied by sqrt(hidden) rounded to the model's dtype; the
logits are soft-capped when the config asks (``final_logit_softcapping``). ``attn_logit_softcapping``
is read but not applied: transformers' Gemma 3 never passes it to its attention (Gemma 2 does), and
the released Gemma 3 configs leave it null; a config that sets it gets a warning. Parameter names are transformers', except the fused
qkv and gate/up projections (as for every family here). Runs unfused (no Triton norm/rotary kernels;
the Triton attention kernel is used when given).
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from .attention import AttentionMetadata
from .config import ModelConfig
from .layers import MLP, RotaryEmbedding, VocabParallelEmbedding
from .model import Attention, DecoderModel, KvCaches, ModelOutput
from .parallel import SINGLE, TensorParallel, split_range

log = logging.getLogger(__name__)


class GemmaRMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) · (1 + weight), in float32, cast back to x's dtype."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        normed = F.rms_norm(x.float(), (x.shape[-1],), None, self.eps)
        return (normed * (1.0 + self.weight.float())).to(x.dtype)


class ScaledEmbedding(nn.Embedding):
    """Embedding rows times ``scale`` rounded to the weight's dtype (transformers' Gemma embedding)."""

    def __init__(self, vocab: int, hidden: int, scale: float):
        super().__init__(vocab, hidden)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


class ScaledParallelEmbedding(VocabParallelEmbedding):
    """:class:`ScaledEmbedding` with its vocabulary split over the ranks of ``tp``."""

    def __init__(self, vocab: int, hidden: int, scale: float, tp: TensorParallel):
        super().__init__(vocab, hidden, tp)
        self.scale = scale

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * torch.tensor(self.scale, dtype=self.weight.dtype)


class Gemma3Attention(Attention):
    """Attention with Gemma's q/k norms and ``query_pre_attn_scalar`` scale."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, attention_fn, tp: TensorParallel, layer: int):
        super().__init__(cfg, rotary, attention_fn, tp, window=cfg.window(layer))
        self.q_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.scale = cfg.gemma.attention_scale


class Gemma3MLP(MLP):
    """down(gelu_tanh(gate(x)) · up(x)), gate and up fused into one matmul."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, attention_fn, tp: TensorParallel, layer: int):
        super().__init__()
        size, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Gemma3Attention(cfg, rotary, attention_fn, tp, layer)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = Gemma3MLP(size, split_range(cfg.intermediate_size, tp.rank, tp.size)[1], False, tp)
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.post_attention_layernorm(self.self_attn(positions, self.input_layernorm(x), kv, meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Backbone(nn.Module):
    """``model.*`` of the checkpoint: scaled embeddings, the layers, the final norm. Holds the local
    layers' rotary tables (``local_rotary``); the global layers share the model's ``rotary``."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, attention_fn=None, tp: TensorParallel = SINGLE,
                 expert_parallel: bool = False):
        super().__init__()
        if cfg.gemma is None:
            raise ValueError("Gemma3Backbone needs a gemma3_text config")
        scale = cfg.hidden_size ** 0.5
        self.embed_tokens = (ScaledParallelEmbedding(cfg.vocab_size, cfg.hidden_size, scale, tp) if tp.enabled
                             else ScaledEmbedding(cfg.vocab_size, cfg.hidden_size, scale))
        self.local_rotary = RotaryEmbedding(cfg.local_rope or cfg.rope, cfg.head_dim, rotary.cos.shape[0])
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(cfg, rotary if cfg.window(i) is None else self.local_rotary, attention_fn, tp, i)
            for i in range(cfg.num_layers))
        self.norm = GemmaRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Gemma3Model(DecoderModel):
    """:class:`DecoderModel` with Gemma 3's backbone and soft-capped logits; always unfused."""

    backbone_class = Gemma3Backbone

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_fn=None, fused: bool = False,
                 tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        if fused and attention_fn is None:
            from .triton_attention import paged_attention_triton as attention_fn
        super().__init__(cfg, max_positions, attention_fn, False, tp, expert_parallel)
        if cfg.gemma.attn_logit_softcapping is not None:
            log.warning("attn_logit_softcapping=%g is not applied (nor is it by transformers' Gemma 3)",
                        cfg.gemma.attn_logit_softcapping)

    def reset_buffers(self) -> None:
        super().reset_buffers()
        local = self.model.local_rotary
        fresh = RotaryEmbedding(self.cfg.local_rope or self.cfg.rope, self.cfg.head_dim, self.max_positions)
        local.cos, local.sin = fresh.cos.to(self.rotary.cos.device), fresh.sin.to(self.rotary.cos.device)
        local._last = None

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KvCaches, logits_indices: torch.Tensor | None = None, hidden_layers=()) -> ModelOutput:
        out = super().forward(input_ids, positions, meta, kv_caches, logits_indices, hidden_layers)
        cap = self.cfg.gemma.final_logit_softcapping
        if cap is not None and out.logits is not None:
            out.logits = torch.tanh(out.logits / cap) * cap
        return out
