"""Medusa heads and the MLP speculator: drafts read off the target's last hidden state, no KV cache.

Both take h_t, the target's final hidden state (after its final norm: the input of its LM head) at
the position t whose LM head gave the newest committed token x_{t+1}, and draft x_{t+2}, x_{t+3}, ...
They share one stepping interface, so chains and trees are drafted by the same proposer
(:mod:`workers.draft.head_proposer`): ``init_state(h)`` then ``step(state, token, i)`` for i = 0, 1, ...
where ``token`` is the token drafted (or committed, for i = 0) just before, and the step's logits
give the next one.

- **Medusa** (Cai et al., arXiv 2401.10774; Medusa-1): head i is a residual block stack
  x ← x + SiLU(W x + b) over h_t and a linear LM head; it predicts x_{t+i+2} from h_t alone (the
  drafted tokens are not read). Layouts read: vLLM's (``config.json`` with ``model_type: medusa``,
  ``num_heads``, ``num_hidden_layers``, optional ``truncated_vocab_size`` + a ``token_map`` tensor and
  ``original_lm_head``; tensors ``blocks.{i}.layers.{j}.weight|bias``, ``lm_heads.{i}.weight``) and
  FasterDecoding's (``medusa_num_heads`` / ``medusa_num_layers``; ``medusa_lm_head.safetensors|.pt``
  with ``{i}.{j}.linear.weight|bias`` and ``{i}.{num_layers}.weight``). Written in vLLM's layout.
- **MLP speculator** (Wertheimer et al., arXiv 2404.19124; IBM's ``*-accelerator`` checkpoints):
  state_0 = h_t (or ln0(h_t)/√2 with ``scale_input``); stage i: s ← GELU(LN_i(proj_i(s) + a·emb_i(x)))
  with a = emb_weight / state_weight, state_weight = 0.5^(0.5/n_predict), emb_weight =
  √((1 − state_weight²)·inner_dim/2); logits = head_i(s). LN_i normalises by the RMS (eps 1e-6) and
  applies a learned scale and shift. Stages read the previous token, so a draft conditions on its
  own earlier drafts. Layout (``model_type: mlp_speculator``): ``emb.{i}.weight``, ``proj.{i}.weight``,
  ``head.{i}.weight``, ``ln.{i}.weight|bias`` (optionally under ``speculator.``); with ``tie_weights``
  stages ≥ 1 share emb/head/ln with stage 0 and stages ≥ 2 share proj with stage 1.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

MEDUSA = "medusa"
MLP = "mlp_speculator"


class SpecHead(nn.Module):
    """A head drafting from the target's last hidden state (see the module docstring)."""

    kind = ""
    n_predict = 0
    vocab_size = 0  # the target's

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor:
        """h [B, H_target] -> the state stage 0 reads [B, S]."""
        raise NotImplementedError

    def step(self, state: torch.Tensor, tokens: torch.Tensor, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Stage ``i`` on states [B, S] and the previous tokens [B] -> (next states, logits [B, V] float32)."""
        raise NotImplementedError


class _ResidualBlock(nn.Module):
    def __init__(self, hidden: int, num_layers: int, bias: bool):
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(hidden, hidden, bias=bias) for _ in range(num_layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + nn.functional.silu(layer(x))
        return x


class MedusaHead(SpecHead):
    kind = MEDUSA

    def __init__(self, hidden: int, vocab_size: int, num_heads: int, num_layers: int = 1, bias: bool = True,
                 token_map: torch.Tensor | None = None, shared_lm_head: nn.Module | None = None):
        super().__init__()
        self.n_predict = num_heads
        self.vocab_size = vocab_size
        self.blocks = nn.ModuleList(_ResidualBlock(hidden, num_layers, bias) for _ in range(num_heads))
        draft_vocab = vocab_size if token_map is None else int(token_map.shape[0])
        self.shared = shared_lm_head is not None  # vLLM's original_lm_head: one LM head for every block
        if self.shared:
            self.lm_heads = nn.ModuleList([shared_lm_head])
        else:
            self.lm_heads = nn.ModuleList(nn.Linear(hidden, draft_vocab, bias=False) for _ in range(num_heads))
        self.register_buffer("token_map", None if token_map is None else token_map.to(torch.long), persistent=False)

    def init_state(self, hidden: torch.Tensor) -> torch.Tensor:
        return hidden

    def head_logits(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """Head i over h [B, H] -> logits [B, draft vocab] (the token map's order)."""
        return self.lm_heads[0 if self.shared else i](self.blocks[i](hidden)).float()

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [B, V_d] -> target-vocabulary logits [B, V] (-inf outside the map)."""
        if self.token_map is None:
            return logits
        full = logits.new_full((logits.shape[0], self.vocab_size), float("-inf"))
        full[:, self.token_map] = logits
        return full

    def step(self, state, tokens, i):
        return state, self.to_target(self.head_logits(state, i))


class _RmsLayerNorm(nn.Module):
    """The MLP speculator's norm: x / rms(x) (eps inside the root), then an optional scale and shift."""

    def __init__(self, dim: int, affine: bool = True, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        if affine:
            self.weight = nn.Parameter(torch.ones(dim))
            self.bias = nn.Parameter(torch.zeros(dim))
        else:
            self.weight = self.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps).to(x.dtype)
        return x if self.weight is None else x * self.weight + self.bias


class MlpSpeculatorHead(SpecHead):
    kind = MLP

    def __init__(self, emb_dim: int, inner_dim: int, vocab_size: int, n_predict: int, tie_weights: bool = False,
                 scale_input: bool = False):
        super().__init__()
        if tie_weights and n_predict < 2:
            raise ValueError("an MLP speculator ties weights across stages: it needs n_predict >= 2")
        self.n_predict, self.vocab_size = n_predict, vocab_size
        self.emb_dim, self.inner_dim = emb_dim, inner_dim
        self.tie_weights, self.scale_input = tie_weights, scale_input
        self.emb = nn.ModuleList(nn.Embedding(vocab_size, inner_dim) for _ in range(n_predict))
        self.proj = nn.ModuleList(nn.Linear(emb_dim if i == 0 else inner_dim, inner_dim, bias=False)
                                  for i in range(n_predict))
        self.head = nn.ModuleList(nn.Linear(inner_dim, vocab_size, bias=False) for _ in range(n_predict))
        self.ln = nn.ModuleList(_RmsLayerNorm(inner_dim) for _ in range(n_predict))
        self.ln0 = _RmsLayerNorm(emb_dim, affine=False) if scale_input else None
        state_weight = 0.5 ** (0.5 / n_predict)
        emb_weight = math.sqrt((1 - state_weight ** 2) * (inner_dim / 2))
        self.alpha = emb_weight / state_weight  # the token embedding's weight relative to the state's
        if tie_weights:
            for i in range(1, n_predict):
                self.emb[i].weight = self.emb[0].weight
                self.head[i].weight = self.head[0].weight
                self.ln[i].weight, self.ln[i].bias = self.ln[0].weight, self.ln[0].bias
            for i in range(2, n_predict):
                self.proj[i].weight = self.proj[1].weight

    def init_state(self, hidden):
        return hidden if self.ln0 is None else self.ln0(hidden) / math.sqrt(2)

    def stage(self, state: torch.Tensor, tokens: torch.Tensor, i: int) -> torch.Tensor:
        """Stage i's new state [B, inner] (training reads it for all positions at once)."""
        x = self.proj[i](state) + self.alpha * self.emb[i](tokens)
        return nn.functional.gelu(self.ln[i](x))

    def step(self, state, tokens, i):
        state = self.stage(state, tokens, i)
        return state, self.head[i](state).float()


# ---------------------------------------------------------------------------------------- loading


def head_kind(path: str | Path) -> str | None:
    """``medusa`` / ``mlp_speculator`` for a head directory in one of their layouts, else None."""
    cfg_path = Path(path) / "config.json"
    if not cfg_path.exists():
        return None
    raw = json.loads(cfg_path.read_text())
    if raw.get("model_type") == MLP or "MLPSpeculatorPreTrainedModel" in (raw.get("architectures") or []):
        return MLP
    if raw.get("model_type") == MEDUSA or "medusa_num_heads" in raw:
        return MEDUSA
    return None


def _tensors(path: Path, names: tuple[str, ...] = ()) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    files = sorted(path.glob("*.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    for name in names:  # torch pickles (FasterDecoding's medusa_lm_head.pt, pytorch_model.bin)
        if not files and (path / name).exists():
            state.update(torch.load(path / name, map_location="cpu", weights_only=True))
    if not state:
        raise ValueError(f"no head weights (*.safetensors, {', '.join(names)}) in {path}")
    return state


def _copy(module: nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Copy ``state`` into ``module``'s parameters by name; ValueError for a missing, extra or misshapen one."""
    params = dict(module.named_parameters(remove_duplicate=False))
    for name, tensor in state.items():
        if name not in params:
            raise ValueError(f"unexpected tensor {name!r} in the {what} checkpoint")
        if tuple(params[name].shape) != tuple(tensor.shape):
            raise ValueError(f"{what} {name}: shape {tuple(tensor.shape)} != expected {tuple(params[name].shape)}")
        with torch.no_grad():
            params[name].copy_(tensor)
    tied = {id(p) for n, p in params.items() if n in state}
    missing = [n for n, p in params.items() if n not in state and id(p) not in tied]
    if missing:
        raise ValueError(f"{what} checkpoint lacks {missing[:4]}{' ...' if len(missing) > 4 else ''}")


def load_medusa(path: str | Path, hidden: int, vocab_size: int, target_lm_head: nn.Module | None = None) -> MedusaHead:
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    state = _tensors(path, ("medusa_lm_head.pt", "pytorch_model.bin"))
    state = {k.removeprefix("medusa_heads.").removeprefix("model."): v for k, v in state.items()}
    if "medusa_num_heads" in raw and not any(k.startswith("blocks.") for k in state):  # FasterDecoding's
        n, layers = int(raw["medusa_num_heads"]), int(raw.get("medusa_num_layers", 1))
        renamed = {}
        for key, tensor in state.items():
            i, j, *rest = key.split(".")
            if int(j) < layers:  # {i}.{j}.linear.{weight,bias}
                renamed[f"blocks.{i}.layers.{j}.{rest[-1]}"] = tensor
            else:  # {i}.{layers}.weight: the head's LM head
                renamed[f"lm_heads.{i}.weight"] = tensor
        state, token_map, shared = renamed, None, False
    else:
        n, layers = int(raw.get("num_heads", 0)), int(raw.get("num_hidden_layers", 1))
        token_map = state.pop("token_map", None)
        truncated = raw.get("truncated_vocab_size")
        if token_map is not None and truncated is not None and int(truncated) >= vocab_size:
            token_map = None  # vLLM ignores a map that truncates nothing
        shared = bool(raw.get("original_lm_head", False))
        if shared and "lm_heads.0.weight" in state:
            state["lm_head_shared"] = state.pop("lm_heads.0.weight")
    if n <= 0:
        raise ValueError(f"{path}: a Medusa config needs num_heads (or medusa_num_heads) > 0")
    if hidden != int(raw.get("hidden_size", hidden)):
        raise ValueError(f"{path}: Medusa hidden_size {raw.get('hidden_size')} != the target's {hidden}")
    bias = any(k.endswith(".bias") for k in state if k.startswith("blocks."))
    shared_head = None
    if shared:
        weight = state.pop("lm_head_shared", None)
        if weight is None:
            if target_lm_head is None:
                raise ValueError(f"{path}: original_lm_head without lm_heads.0.weight needs the target's LM head")
            shared_head = target_lm_head
        else:
            shared_head = nn.Linear(hidden, weight.shape[0], bias=False)
            shared_head.weight.data.copy_(weight)
    if token_map is not None and shared_head is not None and shared_head.weight.shape[0] > token_map.shape[0]:
        rows = shared_head.weight.data[token_map].clone()  # vLLM slices a full LM head to the map
        shared_head = nn.Linear(hidden, rows.shape[0], bias=False)
        shared_head.weight.data.copy_(rows)
    head = MedusaHead(hidden, vocab_size, n, layers, bias, token_map, shared_head)
    if shared:
        state = {k: v for k, v in state.items() if not k.startswith("lm_heads.")}
        module = head.blocks
        state = {k.removeprefix("blocks."): v for k, v in state.items()}
    else:
        module = head
        if token_map is not None:  # full-vocabulary LM heads with a map: vLLM keeps the map's rows
            state = {k: v[token_map] if k.startswith("lm_heads.") and v.shape[0] > token_map.shape[0] else v
                     for k, v in state.items()}
    _copy(module, state, "Medusa")
    return head.eval()


def load_mlp_speculator(path: str | Path, hidden: int, vocab_size: int) -> MlpSpeculatorHead:
    path = Path(path)
    raw = json.loads((path / "config.json").read_text())
    state = {k.removeprefix("speculator."): v for k, v in _tensors(path, ("pytorch_model.bin",)).items()}
    emb_dim = int(raw.get("emb_dim", hidden))
    if emb_dim != hidden:
        raise ValueError(f"{path}: MLP speculator emb_dim {emb_dim} != the target's hidden size {hidden}")
    if int(raw.get("vocab_size", vocab_size)) != vocab_size:
        raise ValueError(f"{path}: MLP speculator vocab_size {raw.get('vocab_size')} != the target's {vocab_size}")
    inner = int(raw.get("inner_dim") or emb_dim)
    head = MlpSpeculatorHead(emb_dim, inner, vocab_size, int(raw["n_predict"]), bool(raw.get("tie_weights", False)),
                             bool(raw.get("scale_input", False)))
    _copy(head, state, "MLP speculator")
    return head.eval()


def load_spec_head(path: str | Path, hidden: int, vocab_size: int, target_lm_head: nn.Module | None = None) -> SpecHead:
    kind = head_kind(path)
    if kind == MEDUSA:
        return load_medusa(path, hidden, vocab_size, target_lm_head)
    if kind == MLP:
        return load_mlp_speculator(path, hidden, vocab_size)
    raise ValueError(f"{path} is not a Medusa or MLP speculator head (config.json model_type medusa / mlp_speculator)")


# ---------------------------------------------------------------------------------------- writing


def save_spec_head(head: SpecHead, out_dir: str | Path, *, dtype: torch.dtype = torch.float16,
                   extra: dict | None = None) -> Path:
    """Write ``head`` in vLLM's layout for its kind (config.json + model.safetensors); returns the directory."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if isinstance(head, MedusaHead):
        if head.shared:
            raise ValueError("a Medusa head with a shared LM head is written with one LM head per block")
        tensors = {name: p for name, p in head.named_parameters()}
        hidden = head.lm_heads[0].weight.shape[1]
        config = {"architectures": ["MedusaModel"], "model_type": MEDUSA, "hidden_size": int(hidden),
                  "vocab_size": head.vocab_size, "num_heads": head.n_predict,
                  "num_hidden_layers": len(head.blocks[0].layers), "medusa_fc_bias": any(
                      layer.bias is not None for layer in head.blocks[0].layers),
                  "truncated_vocab_size": int(head.lm_heads[0].weight.shape[0]), "max_paths": 64, "topk": 10}
        state = {k: v.detach().to(dtype).contiguous().cpu() for k, v in tensors.items()}
        if head.token_map is not None:
            state["token_map"] = head.token_map.to(torch.long).cpu().contiguous()
    elif isinstance(head, MlpSpeculatorHead):
        seen: set[int] = set()
        state = {}
        for name, p in head.named_parameters():  # tied stages are written once (stage 0 / 1)
            if id(p) not in seen:
                seen.add(id(p))
                state[name] = p.detach().to(dtype).contiguous().cpu()
        config = {"architectures": ["MLPSpeculatorPreTrainedModel"], "model_type": MLP, "emb_dim": head.emb_dim,
                  "inner_dim": head.inner_dim, "vocab_size": head.vocab_size, "n_predict": head.n_predict,
                  "n_candidates": head.n_predict, "top_k_tokens_per_head": [1] * head.n_predict,
                  "tie_weights": head.tie_weights, "scale_input": head.scale_input}
    else:
        raise TypeError(f"cannot write a {type(head).__name__}")
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    if extra:
        config["tandem"] = extra
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
