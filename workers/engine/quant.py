"""Quantized checkpoints: FP8 (compressed-tensors) and INT4 (AWQ, GPTQ) linear weights, kept quantized.

Formats, read from ``config.json``'s ``quantization_config``:

- ``compressed-tensors``, format ``float-quantized`` (what llm-compressor writes for FP8 schemes):
  ``W.weight`` in ``float8_e4m3fn`` with ``W.weight_scale`` float32, ``[1]`` (strategy ``tensor``)
  or ``[out, 1]`` (``channel``); W ≈ weight · scale. Activation quantization (``input_activations``,
  dynamic or static ``input_scale``) is not emulated: activations stay in the compute dtype.
- ``awq`` (AutoAWQ's GEMM layout, 4 bits, zero point): ``qweight`` int32 ``[in, out/8]`` packing 8
  output columns per word in the order 0 2 4 6 1 3 5 7, ``qzeros`` int32 ``[in/g, out/8]`` the same
  way, ``scales`` ``[in/g, out]``; W[o, i] = (q - z) · s of i's group.
- ``gptq`` (4 bits, the original "v1" checkpoint format): ``qweight`` int32 ``[in/8, out]`` packing 8
  input rows per word (low bits first), ``qzeros`` int32 ``[in/g, out/8]`` holding zero − 1 packed
  along the output, ``scales`` ``[in/g, out]``, ``g_idx`` ``[in]`` (each input's group; act-order
  checkpoints permute it); W[o, i] = (q - (z + 1)) · s[g_idx[i]].

A quantized projection keeps its weight in its stored width: 1 byte a weight for FP8, 4 bits for
INT4 (two per byte), plus the scales (and zeros); :func:`weight_bytes` counts it. Our fused
projections (q/k/v, gate/up) concatenate their parts along the output: per-tensor FP8 scales
become per-output-channel ones there, which is the same arithmetic.

Compute: every device dequantizes the weight to the activations' dtype for each matmul
(:meth:`QuantWeight.dense`) — correct everywhere, and slower than full-precision weights on CPU (a
dequantization per matmul; the point is the memory). ``torch._scaled_mm`` (Hopper FP8) and a
fused INT4 dequant-GEMM are not wired in.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .layers import Linear
from .model import DecoderModel

log = logging.getLogger(__name__)

PROJECTIONS = {  # our projection -> (its parent under a layer, the checkpoint names of its parts)
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
_PART = {part: (parent, proj) for proj, (parent, parts) in PROJECTIONS.items() for part in parts}
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column AWQ puts in nibble k of a word
_AWQ_UNDO = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])  # column j's nibble


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization: ``method`` fp8 | awq | gptq, and INT4's group size."""

    method: str
    group_size: int = 0
    strategy: str = ""  # fp8: tensor | channel

    @staticmethod
    def of(config: dict) -> QuantScheme | None:
        """The scheme of a ``config.json`` dict; None when unquantized; ValueError when unsupported."""
        q = config.get("quantization_config")
        if not q:
            return None
        method = q.get("quant_method")
        if method == "compressed-tensors":
            groups = list((q.get("config_groups") or {}).values())
            formats = {g.get("format") or q.get("format") for g in groups}
            if len(groups) != 1 or formats != {"float-quantized"}:
                raise ValueError(f"compressed-tensors: only one float-quantized (FP8) group is supported, got {formats}")
            w = groups[0].get("weights") or {}
            if (w.get("type"), w.get("num_bits")) != ("float", 8) or w.get("strategy") not in ("tensor", "channel"):
                raise ValueError(f"compressed-tensors: FP8 weights per tensor or channel only, got {w}")
            return QuantScheme("fp8", strategy=w["strategy"])
        if method in ("awq", "gptq"):
            bits = q.get("bits", q.get("w_bit"))
            group = q.get("group_size", q.get("q_group_size"))
            if bits != 4 or not isinstance(group, int) or group <= 0:
                raise ValueError(f"{method}: 4-bit weights with a positive group size only, got bits={bits} group={group}")
            if method == "awq" and (q.get("version", "gemm").lower() != "gemm" or not q.get("zero_point", True)):
                raise ValueError("awq: only the GEMM layout with zero points is supported")
            if method == "gptq" and q.get("checkpoint_format", "gptq") != "gptq":
                raise ValueError(f"gptq: checkpoint_format {q.get('checkpoint_format')!r} is not supported")
            return QuantScheme(method, group_size=group)
        raise ValueError(f"quantization method {method!r} is not supported (compressed-tensors FP8, awq, gptq are)")

    @staticmethod
    def of_dir(path: Path) -> QuantScheme | None:
        file = path / "config.json"
        return QuantScheme.of(json.loads(file.read_text())) if file.is_file() else None


class QuantWeight:
    """A quantized [out, in] weight; ``dense(dtype)`` is the dequantized weight."""

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dense(x.dtype), bias)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError


class Fp8Weight(QuantWeight):
    """FP8 E4M3 weight [out, in] with one float32 scale per output channel [out]."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        self.weight, self.scale = weight, scale

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.scale[:, None]).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scale]


class Int4Weight(QuantWeight):
    """4-bit weight: ``packed`` uint8 [out, in/2] (low nibble: even input), per-group ``scales`` and
    integer ``zeros`` [out, in/g], and each input's group ``groups`` [in] (act-order permutes it)."""

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor):
        self.packed, self.scales, self.zeros, self.groups = packed, scales, zeros, groups

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        q = torch.stack((self.packed & 0xF, self.packed >> 4), dim=-1).view(self.packed.shape[0], -1)  # [out, in]
        s = self.scales.index_select(1, self.groups).float()  # [out, in]
        z = self.zeros.index_select(1, self.groups).float()
        return ((q.float() - z) * s).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.packed, self.scales, self.zeros, self.groups]


def _pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """[out, in] integers in 0..15 → uint8 [out, in/2], the even input in the low nibble."""
    q = q.to(torch.uint8).view(q.shape[0], -1, 2)
    return (q[..., 0] | (q[..., 1] << 4)).contiguous()


def _unpack_int32(x: torch.Tensor) -> torch.Tensor:
    """int32 [..., n] → nibbles [..., n, 8], nibble k = bits 4k..4k+3."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32)
    return (x.unsqueeze(-1) >> shifts) & 0xF


def awq_tensors(qweight, qzeros, scales, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """AWQ GEMM tensors → (q [out, in], zeros [out, in/g], scales [out, in/g]) as integers/floats."""
    q = _unpack_int32(qweight)[..., _AWQ_UNDO].reshape(qweight.shape[0], -1)  # [in, out]
    z = _unpack_int32(qzeros)[..., _AWQ_UNDO].reshape(qzeros.shape[0], -1)  # [in/g, out]
    if q.shape[0] != z.shape[0] * group or scales.shape != z.shape:
        raise ValueError(f"awq: shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)} do not fit group size {group}")
    return q.T, z.T, scales.T


def gptq_tensors(qweight, qzeros, scales, g_idx, group: int):
    """GPTQ v1 tensors → (q [out, in], zeros [out, in/g], scales [out, in/g], groups [in])."""
    q = _unpack_int32(qweight.T).reshape(qweight.shape[1], -1)  # [out, in]: word r holds inputs 8r..8r+7
    z = _unpack_int32(qzeros).reshape(qzeros.shape[0], -1) + 1  # [in/g, out]; v1 stores zero - 1
    if g_idx is None:
        g_idx = torch.arange(q.shape[1]) // group
    if scales.shape != z.shape or g_idx.shape[0] != q.shape[1] or int(g_idx.max()) >= z.shape[0]:
        raise ValueError(f"gptq: shapes qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)} do not fit group size {group}")
    return q, z.T, scales.T, g_idx.long()


def prepare(model: DecoderModel) -> None:
    """Drop the dense weights of the layers' projections (still on the meta device): their quantized
    weights come from :func:`load`."""
    if model.tp.enabled:
        raise ValueError("quantized checkpoints are not supported under tensor parallelism yet")
    for layer in model.model.layers:
        for proj, (parent, _) in PROJECTIONS.items():
            linear: Linear = getattr(getattr(layer, parent), proj)
            del linear.weight
            linear.register_parameter("weight", None)


def split(weights, scheme: QuantScheme):
    """(quantized tensors by (layer, part), an iterator of the others) from a checkpoint's (name, tensor)s."""
    quant: dict[tuple[int, str], dict[str, torch.Tensor]] = {}

    def rest():
        for name, tensor in weights:
            parts = name.split(".")
            if len(parts) >= 5 and parts[-2] in _PART and parts[1] == "layers" and parts[-1] != "bias":
                quant.setdefault((int(parts[2]), parts[-2]), {})[parts[-1]] = tensor
            else:
                yield name, tensor

    return quant, rest()


def load(model: DecoderModel, scheme: QuantScheme, quant: dict, device) -> None:
    """Put each layer projection's quantized weight (its parts concatenated along the output) in place
    (biases load as usual, with the dense tensors)."""
    for i, layer in enumerate(model.model.layers):
        for proj, (parent, parts) in PROJECTIONS.items():
            linear: Linear = getattr(getattr(layer, parent), proj)
            found = []
            for part in parts:
                t = quant.pop((i, part), None)
                if t is None:
                    raise ValueError(f"checkpoint lacks layer {i} {part}")
                found.append(t)
            qw = _fused(scheme, found, f"layer {i} {proj}")
            qw = _to(qw, device)
            if qw.out_in != (linear.out_features, linear.in_features):
                raise ValueError(f"layer {i} {proj}: quantized shape {qw.out_in} != "
                                 f"{(linear.out_features, linear.in_features)}")
            linear.quant = qw.weight
    if quant:
        raise ValueError(f"unexpected quantized tensors, e.g. {sorted(quant)[:3]}")
    log.info("quantized projections: %s, %.1f MiB", scheme.method, weight_bytes(model)["quantized"] / 2**20)


@dataclass
class _Fused:
    weight: QuantWeight
    out_in: tuple[int, int]


def _fused(scheme: QuantScheme, parts: list[dict[str, torch.Tensor]], where: str) -> _Fused:
    if scheme.method == "fp8":
        ws, ss = [], []
        for t in parts:
            w, s = t.get("weight"), t.get("weight_scale")
            if w is None or s is None or w.dtype != torch.float8_e4m3fn:
                raise ValueError(f"{where}: FP8 needs weight (float8_e4m3fn) and weight_scale, got {sorted(t)}")
            zp = t.get("weight_zero_point")
            if zp is not None and bool((zp != 0).any()):
                raise ValueError(f"{where}: asymmetric FP8 weights are not supported")
            s = s.float().reshape(-1)
            if s.numel() not in (1, w.shape[0]):
                raise ValueError(f"{where}: weight_scale of {s.numel()} values for {w.shape[0]} output channels")
            ws.append(w)
            ss.append(s.expand(w.shape[0]))
        w = torch.cat(ws)
        return _Fused(Fp8Weight(w, torch.cat(ss).contiguous()), tuple(w.shape))
    qs, zs, ss, gs = [], [], [], []
    for t in parts:
        need = {"qweight", "qzeros", "scales"}
        if not need <= t.keys():
            raise ValueError(f"{where}: {scheme.method} needs {sorted(need)}, got {sorted(t)}")
        if scheme.method == "awq":
            q, z, s = awq_tensors(t["qweight"], t["qzeros"], t["scales"], scheme.group_size)
            g = torch.arange(q.shape[1]) // scheme.group_size
        else:
            q, z, s, g = gptq_tensors(t["qweight"], t["qzeros"], t["scales"], t.get("g_idx"), scheme.group_size)
        qs.append(q), zs.append(z), ss.append(s), gs.append(g)
    if any(not torch.equal(g, gs[0]) for g in gs):  # fused parts share one input: one group map
        raise ValueError(f"{where}: the fused parts have different g_idx")
    q = torch.cat(qs)
    weight = Int4Weight(_pack_nibbles(q), torch.cat(ss).contiguous(),
                        torch.cat(zs).to(torch.uint8).contiguous(), gs[0].contiguous())
    return _Fused(weight, tuple(q.shape))


def _to(fused: _Fused, device) -> _Fused:
    w = fused.weight
    if isinstance(w, Fp8Weight):
        fused.weight = Fp8Weight(w.weight.to(device), w.scale.to(device))
    else:
        fused.weight = Int4Weight(w.packed.to(device), w.scales.to(device), w.zeros.to(device), w.groups.to(device))
    return fused


def weight_bytes(model: DecoderModel) -> dict[str, int]:
    """Bytes of the model's weights: ``quantized`` projections (with scales and zeros), ``dense``
    parameters (embeddings, norms, LM head, unquantized projections), and ``total``."""
    quantized = sum(m.quant.nbytes() for m in model.modules() if isinstance(m, Linear) and m.quant is not None)
    seen, dense = set(), 0
    for p in model.parameters():
        if id(p) not in seen:
            seen.add(id(p))
            dense += p.numel() * p.element_size()
    return {"quantized": quantized, "dense": dense, "total": quantized + dense}
