"""Multi-LoRA serving: PEFT adapters on the attention and MLP projections, many in one batch.

An adapter is a PEFT directory (``adapter_config.json`` + ``adapter_model.safetensors``) whose
modules are among ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj``. For a projection
W [out, in] it adds ``scale · B (A x)`` with A [r, in], B [out, r] and scale = alpha / r
(alpha / √r with rsLoRA), per-module ranks and alphas included (``rank_pattern``,
``alpha_pattern``).

:class:`LoraManager` keeps every *registered* adapter's weights in host memory and copies up to
``max_loras`` of them into device *slots* (stacked tensors). A sequence holds a slot from its
admission to its end or preemption (:meth:`acquire` / :meth:`release`, called by the scheduler);
a slot no running sequence holds is given to another adapter least recently used first, so an
adapter whose slots are all busy waits in the queue (never fails). Base requests take no slot.

Our fused projections (qkv, gate/up) carry the adapters of their parts side by side: a slot's A
is ``[parts · max_rank, in]`` (each part's A in its own rank band, zero-padded) and B is
``[out, parts · max_rank]`` block-diagonal, so one shrink and one expand serve the fused
projection exactly (the zero bands add nothing). The scale is folded into B when a slot is filled.

A batch (:meth:`set_batch`, from the model runner) names each token's slot (-1: base). The delta
is a segmented matmul (Punica/S-LoRA's SGMV) over the token rows of each adapter present:
``y[rows] += (x[rows] Aᵀ) Bᵀ``. With one or two adapters in the batch, one gather and one
``index_add`` per adapter; with :data:`GROUPED_FROM` or more, the rows are padded per adapter to
[U, L, in] and run as two batched matmuls over the U adapters' stacked weights (two ops per
projection however many adapters). On CUDA (``kernel`` auto) the BGMV Triton kernels of
:mod:`.triton_lora` run instead: each token's slot, two launches per projection for any mix. A
base-only batch runs no adapter code.

Prefix caching is keyed by adapter: a sequence's block-hash chain starts from
:func:`runtime.kv_hash.chain_root` of its adapter's name (the router computes the same), so
blocks computed under one adapter are never hits for another or for the base.
"""

from __future__ import annotations

import json
import logging
import math
import re
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch

from runtime.errors import InvalidRequest

from .model import DecoderModel

log = logging.getLogger(__name__)

# our fused projection -> (its module path under a layer, the PEFT module names of its parts)
_PROJECTIONS = {
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
TARGET_MODULES = frozenset(p for _, parts in _PROJECTIONS.values() for p in parts)
# a batch with this many adapters or more runs them as one padded batched matmul (one op per
# projection, not one per adapter); fewer run one segment each (no padding, no weight gather)
GROUPED_FROM = 3


class LoraError(ValueError):
    """An adapter that cannot be served (bad files, modules we do not adapt, rank too large), or a
    name that cannot be loaded or unloaded; ``field`` names the load/unload request's field at fault."""

    def __init__(self, message: str, field: str = "lora_path"):
        super().__init__(message)
        self.field = field


@dataclass
class LoraAdapter:
    """One registered adapter in host memory: per (layer, fused projection), A [R, in] and the
    scaled B [out, R] in the slot layout (R = parts · max_rank)."""

    name: str
    path: str
    rank: int  # its largest module rank
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]


def read_peft_adapter(path: str | Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(adapter_config.json as a dict, state dict) of a PEFT adapter directory."""
    from safetensors.torch import load_file

    path = Path(path)
    config_file = path / "adapter_config.json"
    if not config_file.is_file():
        raise LoraError(f"{path} has no adapter_config.json")
    config = json.loads(config_file.read_text())
    weights = path / "adapter_model.safetensors"
    if weights.is_file():
        return config, load_file(str(weights))
    legacy = path / "adapter_model.bin"
    if legacy.is_file():
        return config, torch.load(str(legacy), map_location="cpu", weights_only=True)
    raise LoraError(f"{path} has no adapter_model.safetensors")


def _module_scale(config: dict, module: str, rank: int) -> float:
    """PEFT's scale of the module named ``module`` (e.g. ``model.layers.3.mlp.down_proj``): its
    ``alpha_pattern`` entry (a pattern matching the name's tail, as PEFT matches it) or ``lora_alpha``,
    over its rank (over √rank with rsLoRA)."""
    alpha = config.get("lora_alpha", rank)
    for pattern, value in (config.get("alpha_pattern") or {}).items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            alpha = value
            break
    return alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank


class _Projection:
    """The LoRA slots of one fused projection of one layer: ``lora_a`` [S, R, in] and ``lora_b``
    [S, out, R]. Called by :class:`.layers.Linear` after its base matmul."""

    def __init__(self, manager: LoraManager, in_features: int, out_features: int, parts: int,
                 device: torch.device, dtype: torch.dtype):
        rank = parts * manager.max_lora_rank
        self.manager = manager
        self.lora_a = torch.zeros(manager.max_loras, rank, in_features, device=device, dtype=dtype)
        self.lora_b = torch.zeros(manager.max_loras, out_features, rank, device=device, dtype=dtype)

    def __call__(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        # x [T, in]; y [T, out] the base projection's output
        segments = self.manager.segments
        if not segments:
            return y
        if self.manager.token_slots is not None:  # GPU: the BGMV kernels, any mix in two launches
            from .triton_lora import lora_bgmv

            return lora_bgmv(x, y, self.lora_a, self.lora_b, self.manager.token_slots)
        grouped = self.manager.grouped
        if grouped is not None:  # many adapters: two batched matmuls over [U, L, ·], rows padded to L
            slots, rows, places, length = grouped
            a = self.lora_a.index_select(0, slots)  # [U, R, in]
            b = self.lora_b.index_select(0, slots)  # [U, out, R]
            xs = x.new_zeros(slots.shape[0] * length, x.shape[1])
            xs.index_copy_(0, places, x.index_select(0, rows))
            delta = torch.bmm(torch.bmm(xs.view(slots.shape[0], length, -1), a.transpose(1, 2)), b.transpose(1, 2))
            return y.index_add(0, rows, delta.view(-1, y.shape[1]).index_select(0, places))
        for slot, rows in segments:
            a, b = self.lora_a[slot], self.lora_b[slot]  # [R, in], [out, R]
            if rows is None:  # every token of the batch uses this adapter
                y = y + (x @ a.T) @ b.T
            else:
                y = y.index_add(0, rows, (x.index_select(0, rows) @ a.T) @ b.T)
        return y


class LoraManager:
    """Registered adapters, ``max_loras`` device slots with LRU reuse, and the current batch's
    token → slot segments. Plain values in: the model, two limits."""

    def __init__(self, model: DecoderModel, max_loras: int, max_lora_rank: int, kernel: str = "auto"):
        if max_loras <= 0:
            raise ValueError(f"max_loras must be positive, got {max_loras}")
        if max_lora_rank <= 0:
            raise ValueError(f"max_lora_rank must be positive, got {max_lora_rank}")
        if model.tp.enabled:
            raise ValueError("LoRA adapters are not supported under tensor parallelism")
        if model.cfg.moe is not None:
            raise ValueError(f"LoRA adapters are not supported on mixtures of experts ({model.cfg.model_type})")
        if kernel not in ("auto", "torch", "triton"):
            raise ValueError(f"kernel must be auto, torch or triton, got {kernel!r}")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.cfg = model.cfg
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        # the Triton kernels (workers.engine.triton_lora) take each token's slot; auto: on CUDA
        self.triton = kernel == "triton" or (kernel == "auto" and self.device.type == "cuda")
        self.token_slots: torch.Tensor | None = None  # [T] int32, the batch's, for the kernels
        self.adapters: dict[str, LoraAdapter] = {}
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # adapter -> slot, least recently used first
        self.slot_refs = [0] * max_loras
        self.slot_owner: list[str | None] = [None] * max_loras
        self.segments: list[tuple[int, torch.Tensor | None]] = []  # the batch now running
        # with GROUPED_FROM adapters or more in the batch: (slots [U], token rows [n], their places in
        # the padded [U * L] layout [n], L)
        self.grouped: tuple[torch.Tensor, torch.Tensor, torch.Tensor, int] | None = None
        self.ever_loaded: set[str] = set()  # names registered at some time (a reload may change weights)
        self.projections: dict[tuple[int, str], _Projection] = {}
        self.out_sizes: dict[str, list[int]] = {}
        layer = model.model.layers[0]
        attn = layer.self_attn
        q, kv = attn.q_size, attn.num_kv_heads * model.cfg.head_dim
        inter = layer.mlp.down_proj.in_features
        self.out_sizes = {"qkv_proj": [q, kv, kv], "o_proj": [model.cfg.hidden_size],
                          "gate_up_proj": [inter, inter], "down_proj": [model.cfg.hidden_size]}
        for i, layer in enumerate(model.model.layers):
            for proj, (parent, parts) in _PROJECTIONS.items():
                linear = getattr(getattr(layer, parent), proj)
                p = _Projection(self, linear.in_features, linear.out_features, len(parts), self.device, self.dtype)
                self.projections[(i, proj)] = p
                linear.lora = p

    # ------------------------------------------------------------------ registry

    @property
    def names(self) -> list[str]:
        return sorted(self.adapters)

    def register(self, name: str, path: str | Path) -> LoraAdapter:
        """Read and check a PEFT adapter and keep it in host memory under ``name``. Raises
        :class:`LoraError` for an adapter this model cannot serve, or a name already taken."""
        if not name:
            raise LoraError("an adapter needs a name", "lora_name")
        if name in self.adapters:
            raise LoraError(f"adapter {name!r} is already loaded", "lora_name")
        adapter = self._read(name, Path(path))
        self.adapters[name] = adapter
        self.ever_loaded.add(name)
        log.info("LoRA adapter %s registered from %s (rank %d)", name, path, adapter.rank)
        return adapter

    def unregister(self, name: str) -> None:
        """Forget an adapter; raises :class:`LoraError` if unknown or a running sequence uses it."""
        if name not in self.adapters:
            raise LoraError(f"adapter {name!r} is not loaded", "lora_name")
        slot = self.slot_of.get(name)
        if slot is not None and self.slot_refs[slot]:
            raise LoraError(f"adapter {name!r} is in use by {self.slot_refs[slot]} running requests", "lora_name")
        if slot is not None:
            del self.slot_of[name]
            self.slot_owner[slot] = None
        del self.adapters[name]
        log.info("LoRA adapter %s unregistered", name)

    def _read(self, name: str, path: Path) -> LoraAdapter:
        config, state = read_peft_adapter(path)
        if config.get("peft_type", "LORA") != "LORA":
            raise LoraError(f"{path}: peft_type {config.get('peft_type')!r} is not LORA")
        if config.get("use_dora"):
            raise LoraError(f"{path}: DoRA adapters are not supported")
        if config.get("bias", "none") != "none":
            raise LoraError(f"{path}: adapters with trained biases are not supported")
        if config.get("modules_to_save"):
            raise LoraError(f"{path}: modules_to_save ({config['modules_to_save']}) is not supported")
        found: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
        for key, tensor in state.items():
            parts = key.split(".")
            if len(parts) < 4 or parts[-2] not in ("lora_A", "lora_B") or parts[-1] != "weight":
                raise LoraError(f"{path}: unexpected adapter tensor {key!r}")
            module = parts[-3]
            if module not in TARGET_MODULES or "layers" not in parts:
                raise LoraError(f"{path}: module {module!r} ({key}) is not adaptable; supported: "
                                f"{', '.join(sorted(TARGET_MODULES))}")
            layer = int(parts[parts.index("layers") + 1])
            if not 0 <= layer < self.cfg.num_layers:
                raise LoraError(f"{path}: layer {layer} out of range")
            entry = found.setdefault((layer, module), {})
            entry[parts[-2]] = tensor
            entry["name"] = ".".join(parts[parts.index("layers") - 1 : -2])  # model.layers.i.….module
        if not found:
            raise LoraError(f"{path}: no LoRA weights")
        weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
        for layer in range(self.cfg.num_layers):
            for proj, (_, parts) in _PROJECTIONS.items():
                self._pack(path, config, found, weights, layer, proj, parts)
        max_rank = max(ab["lora_A"].shape[0] for ab in found.values() if "lora_A" in ab)
        return LoraAdapter(name, str(path), max_rank, weights)

    def _pack(self, path, config, found, weights, layer: int, proj: str, parts: tuple[str, ...]) -> None:
        """One fused projection's A and scaled B in the slot layout (zero bands for absent parts)."""
        r = self.max_lora_rank
        present = [m for m in parts if (layer, m) in found]
        if not present:
            return
        proj_obj = self.projections[(layer, proj)]
        in_features = proj_obj.lora_a.shape[2]
        a_all = torch.zeros(len(parts) * r, in_features)
        b_all = torch.zeros(proj_obj.lora_b.shape[1], len(parts) * r)
        out_start = 0
        for k, (module, out) in enumerate(zip(parts, self.out_sizes[proj])):
            ab = found.get((layer, module))
            if ab is not None:
                if set(ab) != {"lora_A", "lora_B", "name"}:
                    raise LoraError(f"{path}: layer {layer} {module} lacks lora_A or lora_B")
                a, b = ab["lora_A"].float(), ab["lora_B"].float()
                rank = a.shape[0]
                if a.shape != (rank, in_features) or b.shape != (out, rank):
                    raise LoraError(f"{path}: layer {layer} {module}: shapes {tuple(a.shape)}, {tuple(b.shape)} "
                                    f"do not fit the model ({out} x {in_features})")
                if rank > r:
                    raise LoraError(f"{path}: rank {rank} exceeds --max-lora-rank {r}")
                a_all[k * r : k * r + rank] = a
                b_all[out_start : out_start + out, k * r : k * r + rank] = b * _module_scale(config, ab["name"], rank)
            out_start += out
        weights[(layer, proj)] = (a_all.to(self.dtype), b_all.to(self.dtype))

    # ------------------------------------------------------------------ slots

    def check(self, name: str) -> None:
        """Raise :class:`InvalidRequest` (field ``model``) unless ``name`` is registered."""
        if name not in self.adapters:
            raise InvalidRequest(f"LoRA adapter {name!r} is not loaded", field="model")

    def can_acquire(self, seq) -> bool:
        """Whether :meth:`acquire` would give ``seq`` a slot now."""
        name = seq.lora
        return (not name or name in self.slot_of or None in self.slot_owner
                or any(self.slot_refs[s] == 0 for s in self.slot_of.values()))

    def acquire(self, seq) -> bool:
        """Give ``seq`` (``seq.lora``: adapter name or None) its adapter's slot, filling a free or
        least recently used idle slot if needed; False when every slot is busy with other adapters."""
        name = seq.lora
        if not name:
            seq.lora_slot = -1
            return True
        slot = self.slot_of.get(name)
        if slot is None:
            slot = self._free_slot()
            if slot is None:
                return False
            self._fill(slot, self.adapters[name])
            self.slot_of[name] = slot
        self.slot_of.move_to_end(name)
        self.slot_refs[slot] += 1
        seq.lora_slot = slot
        return True

    def release(self, seq) -> None:
        """``seq`` no longer runs (finished, aborted, preempted): its slot may be reused."""
        if getattr(seq, "lora_slot", -1) >= 0:
            self.slot_refs[seq.lora_slot] -= 1
            seq.lora_slot = -1

    def _free_slot(self) -> int | None:
        for slot, owner in enumerate(self.slot_owner):
            if owner is None:
                return slot
        for name, slot in self.slot_of.items():  # least recently used first
            if self.slot_refs[slot] == 0:
                del self.slot_of[name]
                self.slot_owner[slot] = None
                log.debug("LoRA slot %d: evicting %s", slot, name)
                return slot
        return None

    @torch.no_grad()
    def _fill(self, slot: int, adapter: LoraAdapter) -> None:
        for key, p in self.projections.items():
            ab = adapter.weights.get(key)
            if ab is None:
                p.lora_a[slot].zero_()
                p.lora_b[slot].zero_()
            else:
                p.lora_a[slot].copy_(ab[0], non_blocking=True)
                p.lora_b[slot].copy_(ab[1], non_blocking=True)
        self.slot_owner[slot] = adapter.name
        log.debug("LoRA slot %d: %s", slot, adapter.name)

    # ------------------------------------------------------------------ the batch

    def set_batch(self, slots: list[int], lengths: list[int]) -> None:
        """The next forward's chunks: chunk b has ``lengths[b]`` tokens and runs with ``slots[b]``
        (-1: the base model). Builds the token rows of each slot present."""
        used = sorted({s for s in slots if s >= 0})
        self.grouped = self.token_slots = None
        if not used:
            self.segments = []
            return
        if self.triton:
            per_token = [s for s, n in zip(slots, lengths) for _ in range(n)]
            self.token_slots = torch.tensor(per_token, dtype=torch.int32).to(self.device, non_blocking=True)
            self.segments = [(s, None) for s in used]  # (only its truth value is read then)
            return
        if len(used) == 1 and all(s == used[0] for s in slots):
            self.segments = [(used[0], None)]
            return
        rows: dict[int, list[int]] = {s: [] for s in used}
        at = 0
        for s, n in zip(slots, lengths):
            if s >= 0:
                rows[s].extend(range(at, at + n))
            at += n
        self.segments = [(s, torch.tensor(r, dtype=torch.long).to(self.device, non_blocking=True))
                         for s, r in rows.items()]
        if len(used) >= GROUPED_FROM:
            length = max(len(r) for r in rows.values())
            flat = [t for s in used for t in rows[s]]
            places = [u * length + j for u, s in enumerate(used) for j in range(len(rows[s]))]
            index = torch.tensor(used, dtype=torch.long)
            self.grouped = (index.to(self.device, non_blocking=True),
                            torch.tensor(flat, dtype=torch.long).to(self.device, non_blocking=True),
                            torch.tensor(places, dtype=torch.long).to(self.device, non_blocking=True), length)

