"""EAGLE draft heads (EAGLE-1 and EAGLE-3) and their checkpoint loading.

A head predicts the target's next feature from the embedding of the next token and the current
feature: at position t it takes (x_{t+1}, f_t) and returns f_{t+1}, whose logits give x_{t+2}.
Features come from the target's hidden states where they are known and from the head itself for
positions it drafts.

- EAGLE-1 (Li et al., arXiv 2401.15077): f = the target's last hidden state (after its final norm).
  fc(cat(embed(x), f)) -> Llama decoder layers (the first one without input norm) -> f'; logits
  = the target's LM head on f'. Checkpoint: ``fc.weight`` [H, 2H] (+ optional ``fc.bias``),
  ``layers.N.*``; embedding and LM head are the target's.
- EAGLE-3 (arXiv 2503.01840): the target contributes three hidden states (low, middle, high
  layers), fused by ``fc`` [H, 3H_target]. One ``midlayer`` attends over
  cat(input_layernorm(embed(x)), hidden_norm(f)) (2H wide), then norm + its own LM head over a
  draft vocabulary mapped to target ids by ``d2t`` (target = draft + d2t[draft]). The feature
  passed on is the layer's output before ``norm``.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import torch
from torch import nn

from ..engine.attention import AttentionMetadata
from ..engine.config import ModelConfig
from ..engine.layers import MLP, Linear, RMSNorm, RotaryEmbedding
from ..engine.model import Attention, DecoderLayer

_FUSED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
          "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}


class EagleHead(nn.Module):
    """Common interface: ``project`` target hidden states to features, ``forward`` pairs, ``logits``."""

    version = 0
    num_kv_layers = 1

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding, max_positions: int):
        super().__init__()
        self.cfg = cfg
        self.embed = [embed]  # the target's (or the checkpoint's) embedding; a list keeps it out of state_dict
        self.rotary = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)

    def project(self, target_hidden: list[torch.Tensor]) -> torch.Tensor:
        """Target hidden states (one [T, H_t] per requested layer) -> features [T, H]."""
        raise NotImplementedError

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """[T, H] -> [T, target vocab] float32."""
        raise NotImplementedError

    def greedy_tokens(self, features: torch.Tensor) -> list[int]:
        """[T, H] -> the argmax of each row's ``logits`` (target ids), in one pass and one sync."""
        return self.logits(features).argmax(-1).tolist()

    def top_tokens(self, features: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """[T, H] -> per row the ``k`` likeliest next tokens (target ids, best first) and their
        log-probabilities, in one pass and one sync."""
        values, ids = self.logits(features).log_softmax(-1).topk(k, dim=-1)
        return ids.tolist(), values.tolist()


class Eagle1Head(EagleHead):
    version = 1

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding, lm_head: nn.Linear, max_positions: int, fc_bias: bool):
        super().__init__(cfg, embed, max_positions)
        self.lm_head = [lm_head]
        self.fc = Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=fc_bias)
        self.layers = nn.ModuleList(DecoderLayer(cfg, self.rotary) for _ in range(cfg.num_layers))
        self.layers[0].input_layernorm = nn.Identity()
        self.num_kv_layers = cfg.num_layers

    def project(self, target_hidden: list[torch.Tensor]) -> torch.Tensor:
        return target_hidden[0]

    def forward(self, input_ids, features, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        x = self.fc(torch.cat((self.embed[0](input_ids), features), dim=-1))
        for layer, kv in zip(self.layers, kv_caches):
            x = layer(positions, x, kv, meta)
        return x

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.lm_head[0](features).float()


class _WideAttention(Attention):
    """Attention whose q/k/v projections read a 2H-wide input (EAGLE-3's midlayer)."""

    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding):
        super().__init__(cfg, rotary)
        self.qkv_proj = Linear(2 * cfg.hidden_size, cfg.q_size + 2 * cfg.kv_size, bias=cfg.qkv_bias)


class _MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rotary: RotaryEmbedding, norm_before_residual: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = _WideAttention(cfg, rotary)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size, cfg.mlp_bias)
        self.norm_before_residual = norm_before_residual

    def forward(self, positions, embeds, features, kv, meta) -> torch.Tensor:
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        x = torch.cat((self.input_layernorm(embeds), normed), dim=-1)
        x = self.self_attn(positions, x, kv, meta) + residual
        return x + self.mlp(self.post_attention_layernorm(x))


class Eagle3Head(EagleHead):
    version = 3

    def __init__(self, cfg: ModelConfig, embed: nn.Embedding, max_positions: int, target_hidden_size: int,
                 draft_vocab_size: int, target_vocab_size: int, norm_before_residual: bool):
        super().__init__(cfg, embed, max_positions)
        self.fc = Linear(3 * target_hidden_size, cfg.hidden_size, bias=False)
        self.midlayer = _MidLayer(cfg, self.rotary, norm_before_residual)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = Linear(cfg.hidden_size, draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(draft_vocab_size, dtype=torch.long))
        self.target_vocab_size = target_vocab_size
        self._ids: tuple[tuple, torch.Tensor, bool] | None = None  # (d2t's identity, target ids, increasing)

    def project(self, target_hidden: list[torch.Tensor]) -> torch.Tensor:
        return self.fc(torch.cat(target_hidden, dim=-1))

    def forward(self, input_ids, features, positions, meta: AttentionMetadata, kv_caches) -> torch.Tensor:
        return self.midlayer(positions, self.embed[0](input_ids), features, kv_caches[0], meta)

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        draft = self.lm_head(self.norm(features)).float()  # [T, draft vocab]
        full = draft.new_full((draft.shape[0], self.target_vocab_size), float("-inf"))
        full[:, torch.arange(draft.shape[1], device=draft.device) + self.d2t] = draft
        return full

    def greedy_tokens(self, features: torch.Tensor) -> list[int]:
        """The argmax over the draft vocabulary only, mapped to target ids: the same token as the
        argmax of ``logits`` (every other target id is -inf there) whenever draft -> target ids is
        increasing, so the first maximum is the same one; otherwise the full logits decide."""
        ids, increasing = self._target_ids()
        if not increasing:
            return super().greedy_tokens(features)
        return ids[self.lm_head(self.norm(features)).argmax(-1)].tolist()

    def top_tokens(self, features: torch.Tensor, k: int) -> tuple[list[list[int]], list[list[float]]]:
        """Over the draft vocabulary only (every other target id has probability 0), mapped to target ids."""
        ids, _ = self._target_ids()
        values, top = self.lm_head(self.norm(features)).float().log_softmax(-1).topk(min(k, ids.shape[0]), dim=-1)
        return ids[top].tolist(), values.tolist()

    def _target_ids(self) -> tuple[torch.Tensor, bool]:
        """The target id of each draft token, and whether they increase: worked out once per d2t
        (its storage, device and in-place version), not on every draft step."""
        key = (self.d2t.data_ptr(), self.d2t.device, self.d2t._version)
        if self._ids is None or self._ids[0] != key:
            ids = torch.arange(self.d2t.shape[0], device=self.d2t.device) + self.d2t
            self._ids = (key, ids, bool((ids[1:] > ids[:-1]).all()))
        return self._ids[1], self._ids[2]


# ---------------------------------------------------------------------------------------- loading


def _read_state(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    if files:
        from safetensors.torch import load_file

        for f in files:
            state.update(load_file(str(f)))
    elif (path / "pytorch_model.bin").exists():
        state = torch.load(path / "pytorch_model.bin", map_location="cpu", weights_only=True)
    else:
        raise ValueError(f"no *.safetensors or pytorch_model.bin in {path}")
    return {k.removeprefix("model."): v for k, v in state.items()}


def _load_into(module: nn.Module, state: dict[str, torch.Tensor], skip: tuple[str, ...] = ()) -> None:
    """Copy checkpoint tensors into ``module`` (fusing q/k/v and gate/up); ValueError on gaps."""
    params = dict(module.named_parameters()) | dict(module.named_buffers())
    pending: dict[str, list[torch.Tensor | None]] = {}
    loaded = set()
    for name, tensor in state.items():
        if name.startswith(skip):
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in _FUSED:
            fused, shard = _FUSED[parts[-2]]
            target = ".".join(parts[:-2] + [fused, parts[-1]])
            pending.setdefault(target, [None, None, None] if fused == "qkv_proj" else [None, None])[shard] = tensor
            continue
        if name not in params:
            raise ValueError(f"unexpected tensor {name!r} in the EAGLE checkpoint")
        if params[name].shape != tensor.shape:
            raise ValueError(f"{name}: shape {tuple(tensor.shape)} != expected {tuple(params[name].shape)}")
        params[name].data.copy_(tensor)
        loaded.add(name)
    for target, shards in pending.items():
        if any(s is None for s in shards) or target not in params:
            raise ValueError(f"incomplete or unexpected fused tensor {target!r} in the EAGLE checkpoint")
        fused = torch.cat(shards, dim=0)
        if params[target].shape != fused.shape:
            raise ValueError(f"{target}: shape {tuple(fused.shape)} != expected {tuple(params[target].shape)}")
        params[target].data.copy_(fused)
        loaded.add(target)
    missing = {n for n in dict(module.named_parameters())} - loaded
    if missing:
        raise ValueError(f"the EAGLE checkpoint lacks {sorted(missing)[:4]}")


def read_eagle_config(path: Path) -> dict:
    """The head's config as one flat dict: the legacy EAGLE layout as it is; the ``speculators``
    layout (``speculators_model_type: eagle3``, the layer's shape under ``transformer_layer_config``)
    flattened, with vLLM's default ``norm_before_residual=True`` when it is absent."""
    raw = json.loads((path / "config.json").read_text())
    if "transformer_layer_config" not in raw:
        return raw
    if raw.get("speculators_model_type") != "eagle3":
        raise ValueError(f"{path}: speculators model type {raw.get('speculators_model_type')!r} is not supported "
                         "(supported: eagle3)")
    unsupported = [k for k in ("norm_before_fc", "fc_norm", "norm_output") if raw.get(k)]
    if unsupported:
        raise ValueError(f"{path}: EAGLE-3 options {unsupported} are not supported")
    flat = dict(raw["transformer_layer_config"])
    for key in ("draft_vocab_size", "target_hidden_size", "eagle_aux_hidden_state_layer_ids"):
        if raw.get(key) is not None:
            flat[key] = raw[key]
    flat["norm_before_residual"] = raw.get("norm_before_residual", True)
    flat["speculators_model_type"] = "eagle3"
    return flat


def load_eagle(path: str | Path, target_embed: nn.Embedding, target_lm_head: nn.Linear, target_cfg: ModelConfig,
               max_positions: int) -> tuple[EagleHead, list[int]]:
    """Load an EAGLE-1 or EAGLE-3 head from ``path``; returns it and the target layers it needs."""
    path = Path(path)
    raw = read_eagle_config(path)
    state = _read_state(path)
    if raw.get("speculators_model_type") == "eagle3":  # speculators names its one layer layers.0
        state = {("midlayer." + k.removeprefix("layers.0.") if k.startswith("layers.0.") else k): v
                 for k, v in state.items()}
    cfg = ModelConfig.from_dict({**raw, "model_type": raw.get("model_type") if raw.get("model_type") in
                                 ("llama", "qwen2", "qwen3", "mistral") else "llama"})
    cfg = replace(cfg, vocab_size=target_cfg.vocab_size)
    embed = target_embed
    if "embed_tokens.weight" in state and tuple(state["embed_tokens.weight"].shape) == tuple(target_embed.weight.shape):
        embed = nn.Embedding(*state["embed_tokens.weight"].shape)
        embed.weight.data.copy_(state["embed_tokens.weight"])
    is_eagle3 = any(k.startswith("midlayer.") for k in state) or "d2t" in state
    if is_eagle3:
        draft_vocab = int(raw.get("draft_vocab_size") or state["lm_head.weight"].shape[0])
        head: EagleHead = Eagle3Head(cfg, embed, max_positions, int(raw.get("target_hidden_size") or target_cfg.hidden_size),
                                     draft_vocab, target_cfg.vocab_size, bool(raw.get("norm_before_residual", False)))
        if "d2t" not in state:
            state["d2t"] = torch.zeros(draft_vocab, dtype=torch.long)
        _load_into(head, state, skip=("embed_tokens.", "t2d"))
        L = target_cfg.num_layers
        ids = (raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
            "eagle_aux_hidden_state_layer_ids") or [2, L // 2, L - 3])
        layers = [min(max(int(i), 0), L) for i in ids]
    else:
        head = Eagle1Head(cfg, embed, target_lm_head, max_positions, fc_bias="fc.bias" in state)
        # Layer 0 has no input norm in EAGLE-1; some exports still carry an unused weight for it.
        _load_into(head, state, skip=("embed_tokens.", "lm_head.", "norm.", "layers.0.input_layernorm."))
        layers = [target_cfg.num_layers]
    head.eval()
    return head, layers


def place_head(head: EagleHead, device: torch.device | str, dtype: torch.dtype) -> EagleHead:
    """``head`` moved to ``device`` in ``dtype`` with the target embedding (and EAGLE-1's LM head) it
    holds outside its state; the rotary tables stay float32 (as the target's: positions past a few
    hundred lose their angle in bfloat16), integer buffers (``d2t``) keep their dtype."""
    device = torch.device(device)
    cos, sin = head.rotary.cos.float(), head.rotary.sin.float()
    head.to(device=device, dtype=dtype)
    head.rotary.cos, head.rotary.sin = cos.to(device), sin.to(device)
    head.rotary._last = None
    outside = head.embed + (head.lm_head if isinstance(head, Eagle1Head) else [])  # lists: not submodules
    for part in outside:
        part.to(device=device, dtype=dtype)
    return head


def load_target_parts(path: str | Path) -> tuple[nn.Embedding, nn.Linear, ModelConfig]:
    """The target's embedding, LM head and config, read from its checkpoint without the layers."""
    from ..engine.weights import iter_safetensors, load_model

    path = Path(path)
    if path.suffix == ".gguf":
        model = load_model(path)
        return model.model.embed_tokens, model.lm_head, model.cfg
    cfg = ModelConfig.from_dir(path)
    wanted = {"model.embed_tokens.weight", "lm_head.weight"}
    tensors = {name: t.float() for name, t in iter_safetensors(path) if name in wanted}
    if "model.embed_tokens.weight" not in tensors:
        raise ValueError(f"{path} has no model.embed_tokens.weight")
    embed = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
    embed.weight.data.copy_(tensors["model.embed_tokens.weight"])
    lm_head = Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
    lm_head.weight = embed.weight if cfg.tie_word_embeddings or "lm_head.weight" not in tensors else \
        nn.Parameter(tensors["lm_head.weight"])
    return embed, lm_head, cfg
