"""A Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3) over a flat batch with a paged KV cache.

``forward(input_ids [T], positions [T], meta, kv_caches)`` runs the tokens of many sequences at
once (see :mod:`workers.engine.attention` for the batch layout). Logits are computed only for the
rows in ``logits_indices``; ``hidden_layers`` picks hidden states in Hugging Face's numbering:
0 = embeddings, k in 1..L-1 = output of decoder layer k-1, L = the final normed output.

``fused=True`` (GPU) runs the elementwise work through the Triton kernels of
:mod:`workers.engine.triton_ops` (add + RMSNorm, rotary + KV-cache write, SwiGLU) and attention
through :mod:`workers.engine.triton_attention`; every op then reads only tensors, so a forward can
be captured in a CUDA graph (:mod:`workers.engine.cuda_graphs`). Same maths, same parameters.

``tp`` (a :class:`.parallel.TensorParallel` of size N > 1) builds this rank's shard of the model:
its attention heads, MLP slice and vocabulary slice, with the collectives of
:mod:`workers.engine.parallel`; :meth:`DecoderModel.checkpoint_slice` says which slice of each
checkpoint tensor the rank loads. Hidden states and logits still come out whole.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from .attention import AttentionMetadata, paged_attention_torch, write_kv
from .config import ModelConfig
from .layers import MLP, Linear, RMSNorm, RotaryEmbedding, RowParallelLinear, VocabParallelEmbedding
from .moe import SparseMoe
from .parallel import SINGLE, TensorParallel, split_heads, split_range

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]

# checkpoint name suffix -> (our parameter suffix, shard index) for fused projections
_FUSED = {
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
}


@dataclass
class ModelOutput:
    logits: torch.Tensor | None  # [N, vocab] float32 for the requested rows
    hidden: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [T, hidden]
    slots: torch.Tensor | None = None  # [T] long: the cache slot of each row of ``hidden``


def _triton_ops():
    """The Triton kernels, imported on first use (CPU-only users never import Triton)."""
    from . import triton_ops

    return triton_ops


class Attention(nn.Module):
    """Self-attention over this rank's heads (all of them at tensor-parallel size 1).

    Per-layer options (:mod:`workers.engine.attention`; off by default): ``window``, a sliding window
    of W positions; ``sinks``, a learned logit per head in the softmax's denominator (gpt-oss:
    parameter ``sinks`` [this rank's heads]); ``softcap``, tanh soft-capping of the scores."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, attention_fn=None, tp: TensorParallel = SINGLE, *,
                 window: int | None = None, sinks: bool = False, softcap: float | None = None):
        super().__init__()
        # passed to the attention function only when set: functions without the options still serve
        self.options = {k: v for k, v in (("window", window), ("softcap", softcap)) if v is not None}
        self.register_parameter("sinks", nn.Parameter(torch.empty(tp.heads(cfg.num_heads, cfg.num_kv_heads).q_count))
                                if sinks else None)
        self.cfg = cfg
        heads = tp.heads(cfg.num_heads, cfg.num_kv_heads)
        self.num_heads, self.num_kv_heads = heads.q_count, heads.kv_count
        self.q_size = heads.q_count * cfg.head_dim
        kv_size = heads.kv_count * cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, self.q_size + 2 * kv_size, bias=cfg.qkv_bias)
        self.o_proj = RowParallelLinear(self.q_size, cfg.hidden_size, cfg.o_bias, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
        self.rotary = [rotary]  # shared; a list keeps it out of this module's state dict
        self.scale = cfg.head_dim ** -0.5
        self.attention_fn = attention_fn or paged_attention_torch
        self.fused = False  # rotary + KV write in one Triton kernel (set by DecoderModel)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor],
                meta: AttentionMetadata) -> torch.Tensor:
        cfg = self.cfg
        t = x.shape[0]
        h, hkv = self.num_heads, self.num_kv_heads
        if self.fused and not cfg.qk_norm:
            rotary = self.rotary[0]
            q = _triton_ops().rotary_write_kv(self.qkv_proj(x), positions, rotary.cos, rotary.sin, kv[0], kv[1],
                                           meta.slot_mapping, h, hkv, cfg.head_dim)
            o = self.attention_fn(q, None, None, kv[0], kv[1], meta, self.scale, **self._options())  # [T, H, D]
            return self.o_proj(o.view(t, self.q_size))
        qkv = self.qkv_proj(x).view(t, h + 2 * hkv, cfg.head_dim)
        if cfg.qk_norm:
            q, k, v = qkv.split([h, hkv, hkv], dim=1)
            q, k = self.rotary[0](positions, self.q_norm(q), self.k_norm(k))
        else:  # queries and keys sit side by side in the fused output: rotate them in one go
            q, k = self.rotary[0].rotate(positions, qkv[:, : h + hkv]).split([h, hkv], dim=1)
            v = qkv[:, h + hkv :]
        write_kv(kv[0], kv[1], k, v, meta.slot_mapping)
        o = self.attention_fn(q, k, v, kv[0], kv[1], meta, self.scale, **self._options())  # [T, H, D]
        return self.o_proj(o.reshape(t, self.q_size))

    def _options(self) -> dict:
        return self.options if self.sinks is None else {**self.options, "sinks": self.sinks}


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, attention_fn=None, tp: TensorParallel = SINGLE,
                 index: int = 0, expert_parallel: bool = False):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rotary, attention_fn, tp, window=cfg.window(index), sinks=cfg.attention_sinks)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if cfg.moe is not None and cfg.moe.is_sparse(index):
            self.mlp = SparseMoe(cfg.moe, cfg.hidden_size, tp, expert_parallel)
        else:
            self.mlp = MLP(cfg.hidden_size, split_range(cfg.intermediate_size, tp.rank, tp.size)[1], cfg.mlp_bias, tp)

    def forward(self, positions, x, kv, meta):
        x = x + self.self_attn(positions, self.input_layernorm(x), kv, meta)
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_fused(self, positions, h, residual, kv, meta):
        """Residual-stream form: layer input x = h + residual (residual None: x = h).

        Returns (this layer's output minus its input stream, the input stream), as vLLM's layers do,
        so each add is fused into the next norm."""
        norm = self.input_layernorm
        if residual is None:
            residual = h
            h, _ = _triton_ops().rms_norm(h, norm.weight, norm.eps)
        else:
            h, residual = _triton_ops().rms_norm(h, norm.weight, norm.eps, residual)
        h = self.self_attn(positions, h, kv, meta)
        norm = self.post_attention_layernorm
        h, residual = _triton_ops().rms_norm(h, norm.weight, norm.eps, residual)
        return self.mlp(h), residual


class _Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, attention_fn=None, tp: TensorParallel = SINGLE,
                 expert_parallel: bool = False):
        super().__init__()
        self.embed_tokens = (VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, tp) if tp.enabled
                             else nn.Embedding(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(DecoderLayer(cfg, rotary, attention_fn, tp, i, expert_parallel)
                                    for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DecoderModel(nn.Module):
    """The decoder with Hugging Face parameter names, except fused qkv and gate/up projections."""

    backbone_class = _Backbone  # ``model.*``: a family with other layers (Gemma 3) brings its own

    def __init__(self, cfg: ModelConfig, max_positions: int, attention_fn=None, fused: bool = False,
                 tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        super().__init__()
        if fused and attention_fn is None:
            from .triton_attention import paged_attention_triton as attention_fn
        if fused and not getattr(attention_fn, "reads_cache_only", False):
            raise ValueError("fused kernels need an attention function that reads the cache only (Triton)")
        self.cfg = cfg
        self.fused = fused
        self.max_positions = max_positions
        self.tp = tp
        self.heads = tp.heads(cfg.num_heads, cfg.num_kv_heads)  # raises ValueError if they do not split
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.expert_parallel = expert_parallel and tp.enabled  # experts sharded over the group (see .moe)
        self.model = self.backbone_class(cfg, self.rotary, attention_fn, tp, expert_parallel)
        self.lm_head = Linear(cfg.hidden_size, self.model.embed_tokens.weight.shape[0], bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        for layer in self.model.layers:
            layer.self_attn.fused = layer.mlp.fused = fused

    @property
    def num_local_kv_heads(self) -> int:
        """KV heads this rank caches (all of them at tensor-parallel size 1)."""
        return self.heads.kv_count

    @property
    def max_rank_kv_heads(self) -> int:
        """The most KV heads any rank of the group caches (ranks may differ when the split is uneven):
        what a per-rank cache budget must be sized by."""
        tp, cfg = self.tp, self.cfg
        return max(split_heads(cfg.num_heads, cfg.num_kv_heads, r, tp.size).kv_count for r in range(tp.size))

    @property
    def static_capable(self) -> bool:
        """Whether a forward reads only tensors (no host-side lengths): CUDA-graph capturable. With
        experts only on the fused path: the expert loop reads each expert's token count on the host
        (:mod:`.moe`), the grouped kernels do not."""
        if self.cfg.moe is not None and not self.fused:
            return False
        return getattr(self.model.layers[0].self_attn.attention_fn, "static_capable", False)

    def moe_block(self, name: str) -> tuple[SparseMoe, str, str] | None:
        """(sparse layer's MoE block, the name below it, the block's parameter prefix) for a checkpoint
        tensor of a sparse layer's MLP (``model.layers.N.mlp.*``, Mixtral's ``block_sparse_moe.*``);
        None for any other tensor."""
        parts = name.split(".", 4)
        if len(parts) < 5 or parts[:2] != ["model", "layers"] or parts[3] not in ("mlp", "block_sparse_moe"):
            return None
        if not parts[2].isdigit() or int(parts[2]) >= len(self.model.layers):
            return None
        mlp = self.model.layers[int(parts[2])].mlp
        return (mlp, parts[4], f"model.layers.{parts[2]}.mlp.") if isinstance(mlp, SparseMoe) else None

    def release_dense_weights(self) -> int:
        """For serving on CPU: keep only the packed copies of the linear weights (``Linear.release_dense``),
        except an LM head tied to the embedding. Load weights before; returns how many were released."""
        tied = self.lm_head.weight is self.model.embed_tokens.weight
        return sum(m.release_dense() for m in self.modules()
                   if isinstance(m, Linear) and not (tied and m is self.lm_head))

    def reset_buffers(self) -> None:
        """Recompute the rotary tables (needed after ``to_empty``)."""
        fresh = RotaryEmbedding(self.cfg.rope, self.cfg.head_dim, self.max_positions)
        device = self.lm_head.weight.device
        self.rotary.cos = fresh.cos.to(device)
        self.rotary.sin = fresh.sin.to(device)
        self.rotary._last = None
        if self.cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                kv_caches: KvCaches, logits_indices: torch.Tensor | None = None,
                hidden_layers: Iterable[int] = ()) -> ModelOutput:
        """input_ids, positions [T]; logits for rows ``logits_indices`` [N] (None: all rows)."""
        wanted = set(hidden_layers)
        num_layers = self.cfg.num_layers
        if any(not 0 <= k <= num_layers for k in wanted):
            raise ValueError(f"hidden layers must be in [0, {num_layers}], got {sorted(wanted)}")
        hidden: dict[int, torch.Tensor] = {}
        x = self.model.embed_tokens(input_ids)  # [T, hidden]
        if self.fused:
            x = self._layers_fused(positions, x, meta, kv_caches, wanted, hidden)
        else:
            for i, layer in enumerate(self.model.layers):
                if i in wanted:
                    hidden[i] = x
                x = layer(positions, x, kv_caches[i], meta)
            x = self.model.norm(x)
        if num_layers in wanted:
            hidden[num_layers] = x
        rows = x if logits_indices is None else x[logits_indices]
        logits = self.lm_head(rows)
        if self.tp.enabled:  # each rank's vocabulary columns, gathered and cut to the vocabulary
            logits = self.tp.all_gather_last(logits)[:, : self.cfg.vocab_size]
        return ModelOutput(logits.float(), hidden, meta.slot_mapping)

    def _layers_fused(self, positions, x, meta, kv_caches, wanted, hidden) -> torch.Tensor:
        h, residual = x, None
        for i, layer in enumerate(self.model.layers):
            if i in wanted:
                hidden[i] = x if residual is None else h + residual
            h, residual = layer.forward_fused(positions, h, residual, kv_caches[i], meta)
        norm = self.model.norm
        return _triton_ops().rms_norm(h, norm.weight, norm.eps, residual)[0]

    def checkpoint_slice(self, name: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint tensor ``name`` that this rank holds; None: all of it.

        Column-parallel weights (q/k/v, gate/up, and their biases) are cut along dim 0, row-parallel
        ones (o_proj, down_proj) along dim 1, embedding and LM head by vocabulary rows; norms and
        row-parallel biases are whole on every rank."""
        tp = self.tp
        if not tp.enabled:
            return None
        moe = self.moe_block(name)
        if moe is not None:  # an expert this rank does not hold: length 0, not read
            return moe[0].checkpoint_slice(moe[1])
        parts = name.split(".")
        proj = parts[-2] if len(parts) >= 2 else ""
        cfg, heads, d = self.cfg, self.heads, self.cfg.head_dim
        if proj == "q_proj":
            return 0, heads.q_start * d, heads.q_count * d
        if proj == "self_attn" and parts[-1] == "sinks":  # one per query head
            return 0, heads.q_start, heads.q_count
        if proj in ("k_proj", "v_proj"):
            return 0, heads.kv_start * d, heads.kv_count * d
        if proj in ("gate_proj", "up_proj"):
            return (0, *split_range(cfg.intermediate_size, tp.rank, tp.size))
        if parts[-1] == "weight" and proj == "o_proj":
            return 1, heads.q_start * d, heads.q_count * d
        if parts[-1] == "weight" and proj == "down_proj":
            return (1, *split_range(cfg.intermediate_size, tp.rank, tp.size))
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            embed = self.model.embed_tokens
            return 0, embed.start, embed.rows
        return None

    @torch.no_grad()
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy checkpoint tensors (Hugging Face names) in; raises ValueError on missing/unknown names.

        Under tensor parallelism each tensor must be this rank's slice (:meth:`checkpoint_slice`);
        a vocabulary slice shorter than the padded rows fills the first rows (the rest are zeroed)."""
        params = dict(self.named_parameters(remove_duplicate=False))
        loaded: set[str] = set()
        cfg = self.cfg
        attn = self.model.layers[0].self_attn
        q_size, kv_size = attn.q_size, attn.num_kv_heads * cfg.head_dim
        dense = [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MLP)]
        inter = dense[0].down_proj.in_features if dense else 0
        split = {"qkv_proj": [q_size, kv_size, kv_size], "gate_up_proj": [inter, inter]}
        if self.tp.enabled:  # padding rows of the vocabulary slice: never looked up, logits cut off
            for name in ("model.embed_tokens.weight", "lm_head.weight"):
                params[name].zero_()
        for name, tensor in weights:
            if "rotary_emb" in name:
                continue
            if name == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            moe = self.moe_block(name)
            if moe is not None:
                loaded.update(moe[2] + key for key in moe[0].load(moe[1], tensor))
                continue
            parts = name.split(".")
            target, shard = name, None
            if len(parts) >= 2 and parts[-2] in _FUSED:
                fused, shard = _FUSED[parts[-2]]
                target = ".".join(parts[:-2] + [fused, parts[-1]])
            if target not in params:
                raise ValueError(f"unexpected checkpoint tensor {name!r}")
            param = params[target]
            if target in ("model.embed_tokens.weight", "lm_head.weight") and self.tp.enabled:
                param = param.narrow(0, 0, self.model.embed_tokens.rows)
            if shard is None:
                if param.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(param.shape)}")
                param.copy_(tensor)
                loaded.add(target)
            else:
                sizes = split[target.split(".")[-2]]
                start = sum(sizes[:shard])
                dest = param.narrow(0, start, sizes[shard])
                if dest.shape != tensor.shape:
                    raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(dest.shape)}")
                dest.copy_(tensor)
                loaded.add(f"{target}#{shard}")
        expected = set()
        for i, layer in enumerate(self.model.layers):
            if isinstance(layer.mlp, SparseMoe):
                expected.update(f"model.layers.{i}.mlp." + key for key in layer.mlp.expected())
        for pname in params:
            if pname == "lm_head.weight" and cfg.tie_word_embeddings:
                continue
            if self.moe_block(pname) is not None:  # its block's own keys, above
                continue
            kind = pname.split(".")[-2] if "." in pname else ""
            if kind in split:
                expected.update(f"{pname}#{i}" for i in range(len(split[kind])))
            else:
                expected.add(pname)
        missing = expected - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
