"""Quantized checkpoints: FP8 (compressed-tensors) and INT4 (AWQ, GPTQ) linear weights, kept quantized.

Formats, read from ``config.json``'s ``quantization_config``:

- ``compressed-tensors``, format ``float-quantized`` (what llm-compressor writes for FP8 schemes):
  ``W.weight`` in ``float8_e4m3fn`` with ``W.weight_scale`` float32, ``[1]`` (strategy ``tensor``)
  or ``[out, 1]`` (``channel``); W ≈ weight · scale. The checkpoint's activation scheme
  (``input_activations``, a static ``input_scale``) is not read: ``dense`` keeps activations in the
  compute dtype, ``scaled_mm`` quantizes them dynamically per token (below).
- ``awq`` (AutoAWQ's GEMM layout, 4 bits, zero point): ``qweight`` int32 ``[in, out/8]`` packing 8
  output columns per word in the order 0 2 4 6 1 3 5 7, ``qzeros`` int32 ``[in/g, out/8]`` the same
  way, ``scales`` ``[in/g, out]``; W[o, i] = (q - z) · s of i's group.
- ``gptq`` (4 bits, the original "v1" checkpoint format): ``qweight`` int32 ``[in/8, out]`` packing 8
  input rows per word (low bits first), ``qzeros`` int32 ``[in/g, out/8]`` holding zero − 1 packed
  along the output, ``scales`` ``[in/g, out]``, ``g_idx`` ``[in]`` (each input's group; act-order
  checkpoints permute it); W[o, i] = (q - (z + 1)) · s[g_idx[i]].
- GGUF ``Q4_1`` (``load_model(..., gguf_quantized=True)``, the demo file's projections): blocks of
  32 inputs with a float16 scale and minimum, W = q · d + m (:class:`Q4_1Weight`), kept as the
  file's bytes; dequantized per matmul on every device.

A quantized projection keeps its weight in its stored width: 1 byte a weight for FP8, 4 bits for
INT4 (two per byte), plus the scales (and zeros); :func:`weight_bytes` counts it. Our fused
projections (q/k/v, gate/up) concatenate their parts along the output: per-tensor FP8 scales
become per-output-channel ones there, which is the same arithmetic.

Compute (``QuantWeight.kernel``, chosen by :func:`load` for the device, or :func:`use_kernel`):

- ``dense``: dequantize the weight to the activations' dtype for each matmul
  (:meth:`QuantWeight.dense`) — correct everywhere; on CPU slower than full-precision weights (a
  dequantization per matmul; the point is the memory). The CPU default.
- ``scaled_mm`` (FP8; the default on CUDA where a probe call succeeds, i.e. Hopper/Ada): activations
  are quantized dynamically **per token** to ``float8_e4m3fn`` (scale = row amax / 448), and
  ``torch._scaled_mm`` multiplies them by the FP8 weight (transposed: column-major, as cuBLASLt wants)
  with row-wise scales (per-token [M, 1] × per-channel [1, N]; a per-tensor checkpoint's scale is
  already expanded per channel), accumulating in float32. Needs K and N multiples of 16 (M is free);
  otherwise ``dense``. No host sync, no data-dependent shape: CUDA-graph capturable. It differs from
  ``dense`` by the activations' FP8 rounding (3 mantissa bits), as vLLM's and SGLang's FP8 paths do.
- ``triton`` (INT4; the default on CUDA): the dequant-GEMM of :mod:`.triton_quant` reads the 4-bit
  weight, zeros and group scales straight from memory (fp32 accumulation). Act-order GPTQ weights
  are stored with their inputs sorted by group, activations permuted to match (``perm``).
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
from .quant_formats import awq_tensors, gptq_tensors, pack_nibbles

log = logging.getLogger(__name__)

PROJECTIONS = {  # our projection -> (its parent under a layer, the checkpoint names of its parts)
    "qkv_proj": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "o_proj": ("self_attn", ("o_proj",)),
    "gate_up_proj": ("mlp", ("gate_proj", "up_proj")),
    "down_proj": ("mlp", ("down_proj",)),
}
_PART = {part: (parent, proj) for proj, (parent, parts) in PROJECTIONS.items() for part in parts}


@dataclass(frozen=True)
class QuantScheme:
    """A checkpoint's quantization: ``method`` fp8 | awq | gptq, and INT4's group size."""

    method: str  # fp8 | awq | gptq | gguf (a GGUF file's Q4_1 projections, see weights.load_model)
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


FP8_MAX = 448.0  # the largest finite float8_e4m3fn
KERNELS = ("dense", "scaled_mm", "triton")


class QuantWeight:
    """A quantized [out, in] weight; ``dense(dtype)`` is the dequantized weight; ``kernel`` says how
    :meth:`linear` multiplies (see the module docstring)."""

    kernel = "dense"

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return F.linear(x, self.dense(x.dtype), bias)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        raise NotImplementedError

    def kernels(self) -> tuple[str, ...]:
        """The kernels that can serve this weight's shapes (``dense`` always)."""
        return ("dense",)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    def tensors(self) -> list[torch.Tensor]:
        raise NotImplementedError


def quantize_fp8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] → (float8_e4m3fn [M, K], float32 scale [M, 1]) with x ≈ q · scale, scale = row amax / 448."""
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / FP8_MAX).clamp(min=1e-12)
    return (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn), scale


def fp8_scaled_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] · (weight [N, K] float8 · scale [N])ᵀ via ``torch._scaled_mm``, activations
    quantized per token. Out in x's dtype (CUDA computes in bfloat16 out: row-wise scaling has no
    other output type there)."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    xq, x_scale = quantize_fp8_per_token(x2)
    out_dtype = torch.bfloat16 if x.is_cuda else x.dtype
    y = torch._scaled_mm(xq, weight.t(), scale_a=x_scale, scale_b=scale.view(1, -1), out_dtype=out_dtype)
    y = y.to(x.dtype)
    if bias is not None:
        y = y + bias
    return y.view(*shape[:-1], weight.shape[0])


class Fp8Weight(QuantWeight):
    """FP8 E4M3 weight [out, in] with one float32 scale per output channel [out]."""

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        self.weight, self.scale = weight, scale

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.kernel == "scaled_mm":
            return fp8_scaled_linear(x, self.weight, self.scale, bias)
        return super().linear(x, bias)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.to(torch.float32) * self.scale[:, None]).to(dtype)

    def kernels(self) -> tuple[str, ...]:
        n, k = self.weight.shape
        return ("dense", "scaled_mm") if n % 16 == 0 and k % 16 == 0 else ("dense",)

    def tensors(self) -> list[torch.Tensor]:
        return [self.weight, self.scale]


class Int4Weight(QuantWeight):
    """4-bit weight: ``packed`` uint8 [out, in/2] (low nibble: even input), per-group ``scales`` and
    integer ``zeros`` [out, in/g], and each input's group ``groups`` [in]. ``perm`` (act-order
    checkpoints): stored input j is the layer's input perm[j] (the inputs sorted by group, so that
    groups are consecutive); None: the layer's order."""

    _group = 0  # the Triton kernel's group size (set by :meth:`kernels`)

    def __init__(self, packed: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, groups: torch.Tensor,
                 perm: torch.Tensor | None = None):
        self.packed, self.scales, self.zeros, self.groups, self.perm = packed, scales, zeros, groups, perm

    @property
    def group_size(self) -> int:
        """Inputs per group where groups are consecutive and equal (what the Triton kernel needs); 0 otherwise."""
        n_in, n_groups = self.packed.shape[1] * 2, self.scales.shape[1]
        if n_groups == 0 or n_in % n_groups:
            return 0
        g = n_in // n_groups
        want = torch.arange(n_in, device=self.groups.device) // g
        return g if torch.equal(self.groups, want) else 0

    def linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.perm is not None:
            x = x.index_select(-1, self.perm)
        if self.kernel == "triton":
            from .triton_quant import int4_matmul

            shape = x.shape
            y = int4_matmul(x.reshape(-1, shape[-1]), self.packed, self.scales, self.zeros, self._group)
            y = y.view(*shape[:-1], y.shape[-1])
            return y if bias is None else y + bias
        return F.linear(x, self._stored_dense(x.dtype), bias)

    def _stored_dense(self, dtype: torch.dtype) -> torch.Tensor:
        """The dequantized weight in stored input order."""
        q = torch.stack((self.packed & 0xF, self.packed >> 4), dim=-1).view(self.packed.shape[0], -1)  # [out, in]
        s = self.scales.index_select(1, self.groups).float()  # [out, in]
        z = self.zeros.index_select(1, self.groups).float()
        return ((q.float() - z) * s).to(dtype)

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        w = self._stored_dense(dtype)
        return w if self.perm is None else w.index_select(1, torch.argsort(self.perm))

    def kernels(self) -> tuple[str, ...]:
        from .triton_quant import block_k

        self._group = self.group_size
        return ("dense", "triton") if self._group and block_k(self._group) else ("dense",)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.packed, self.scales, self.zeros, self.groups, self.perm) if t is not None]


class Q4_1Weight(QuantWeight):
    """A GGUF ``Q4_1`` weight [out, in], as llama.cpp stores it: blocks of 32 inputs, each with a
    float16 scale d and minimum m, and 16 bytes whose low nibbles are the block's inputs 0-15 and
    high nibbles its inputs 16-31; W = q · d + m. ``qs`` uint8 [out, in/32, 16], ``d`` and ``m``
    float16 [out, in/32]: 20 bytes per 32 weights (5 bits a weight), the file's own bytes."""

    BLOCK = 32
    BYTES = 20  # per block in the file: d, m (float16), 16 bytes of nibbles

    def __init__(self, qs: torch.Tensor, d: torch.Tensor, m: torch.Tensor):
        self.qs, self.d, self.m = qs, d, m

    @staticmethod
    def from_gguf(raw: torch.Tensor) -> Q4_1Weight:
        """From a GGUF tensor's bytes, uint8 [out, in/32 · 20]."""
        blocks = raw.reshape(raw.shape[0], -1, Q4_1Weight.BYTES)
        return Q4_1Weight(blocks[..., 4:].contiguous(), blocks[..., 0:2].contiguous().view(torch.float16)[..., 0],
                          blocks[..., 2:4].contiguous().view(torch.float16)[..., 0])

    def dense(self, dtype: torch.dtype) -> torch.Tensor:
        q = torch.cat((self.qs & 0xF, self.qs >> 4), dim=-1).float()  # [out, in/32, 32]
        w = q * self.d.float()[..., None] + self.m.float()[..., None]
        return w.reshape(self.qs.shape[0], -1).to(dtype)

    def tensors(self) -> list[torch.Tensor]:
        return [self.qs, self.d, self.m]

    @staticmethod
    def cat(parts: list[Q4_1Weight]) -> Q4_1Weight:
        """Parts stacked along the output (a fused projection)."""
        return Q4_1Weight(*(torch.cat([getattr(p, k) for p in parts]) for k in ("qs", "d", "m")))

    def rows(self, index: torch.Tensor) -> Q4_1Weight:
        """The output rows ``index`` (llama.cpp permutes a Llama's q/k rows per head)."""
        return Q4_1Weight(self.qs[index], self.d[index], self.m[index])


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


def load(model: DecoderModel, scheme: QuantScheme, quant: dict, device, kernel: str = "auto") -> None:
    """Put each layer projection's quantized weight (its parts concatenated along the output) in place
    (biases load as usual, with the dense tensors), then choose its kernel (:func:`use_kernel`)."""
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
    kernels = use_kernel(model, kernel)
    log.info("quantized projections: %s, %.1f MiB, kernels %s", scheme.method,
             weight_bytes(model)["quantized"] / 2**20, kernels)


@dataclass
class _Fused:
    weight: QuantWeight
    out_in: tuple[int, int]


def _fused(scheme: QuantScheme, parts: list[dict[str, torch.Tensor]], where: str) -> _Fused:
    if scheme.method == "gguf":  # GGUF Q4_1 tensors kept as the file holds them
        w = Q4_1Weight.cat([t["q4_1"] for t in parts])
        return _Fused(w, (w.qs.shape[0], w.qs.shape[1] * Q4_1Weight.BLOCK))
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
    q, groups, perm = torch.cat(qs), gs[0], None
    if bool((groups[1:] < groups[:-1]).any()):  # act order: store the inputs sorted by group
        perm = torch.argsort(groups, stable=True)
        q, groups = q[:, perm], groups[perm]
    weight = Int4Weight(pack_nibbles(q), torch.cat(ss).contiguous(),
                        torch.cat(zs).to(torch.uint8).contiguous(), groups.contiguous(), perm)
    return _Fused(weight, tuple(q.shape))


def _to(fused: _Fused, device) -> _Fused:
    w = fused.weight
    if isinstance(w, Q4_1Weight):
        fused.weight = Q4_1Weight(w.qs.to(device), w.d.to(device), w.m.to(device))
    elif isinstance(w, Fp8Weight):
        fused.weight = Fp8Weight(w.weight.to(device), w.scale.to(device))
    else:
        fused.weight = Int4Weight(w.packed.to(device), w.scales.to(device), w.zeros.to(device), w.groups.to(device),
                                  None if w.perm is None else w.perm.to(device))
    return fused


def use_kernel(model: DecoderModel, kernel: str = "auto") -> dict[str, int]:
    """Set every quantized projection's kernel: ``dense``, ``scaled_mm`` (FP8), ``triton`` (INT4), or
    ``auto`` (:func:`auto_kernel`). A projection whose shapes the kernel cannot serve stays ``dense``.
    Returns how many projections got each kernel."""
    if kernel not in ("auto", *KERNELS):
        raise ValueError(f"kernel must be auto or one of {KERNELS}, got {kernel!r}")
    counts: dict[str, int] = {}
    for m in model.modules():
        qw = getattr(m, "quant", None) if isinstance(m, Linear) else None
        if qw is None:
            continue
        want = auto_kernel(qw) if kernel == "auto" else kernel
        qw.kernel = want if want == "dense" or want in qw.kernels() else "dense"
        counts[qw.kernel] = counts.get(qw.kernel, 0) + 1
    return counts


def auto_kernel(qw: QuantWeight) -> str:
    """CPU: ``dense``. CUDA: ``scaled_mm`` for FP8 where a probe call works (Hopper, Ada), ``triton``
    for INT4."""
    if isinstance(qw, Q4_1Weight):
        return "dense"
    t = qw.weight if isinstance(qw, Fp8Weight) else qw.packed
    if t.device.type != "cuda":
        return "dense"
    if isinstance(qw, Fp8Weight):
        return "scaled_mm" if _scaled_mm_works(t.device) else "dense"
    return "triton"


_PROBED: dict[str, bool] = {}


def _scaled_mm_works(device: torch.device) -> bool:
    """One small row-wise ``torch._scaled_mm`` on ``device`` (cuBLASLt refuses FP8 before Ada)."""
    key = str(device)
    if key not in _PROBED:
        try:
            w = torch.ones(32, 32, device=device).to(torch.float8_e4m3fn)
            y = fp8_scaled_linear(torch.ones(3, 32, device=device, dtype=torch.bfloat16), w,
                                  torch.ones(32, device=device))
            _PROBED[key] = bool(torch.allclose(y.float(), torch.full_like(y.float(), 32.0)))
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            log.warning("torch._scaled_mm unavailable on %s (%s): FP8 weights are dequantized per matmul", device, exc)
            _PROBED[key] = False
    return _PROBED[key]


@torch.no_grad()
def quantize_weight(w: torch.Tensor, method: str, group: int = 128) -> QuantWeight:
    """One dense [out, in] weight quantized as :func:`quantize_in_place` does (kernel ``dense``)."""
    w = w.detach().float()
    n, k = w.shape
    if method == "fp8":
        scale = (w.abs().amax(dim=1) / FP8_MAX).clamp(min=1e-12)
        q = (w / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        return Fp8Weight(q.contiguous(), scale.contiguous())
    if method != "awq":
        raise ValueError(f"method must be fp8 or awq, got {method!r}")
    if k % group:
        raise ValueError(f"{k} inputs do not split into groups of {group}")
    wg = w.view(n, k // group, group)
    lo, hi = wg.amin(-1).clamp(max=0), wg.amax(-1).clamp(min=0)
    scales = ((hi - lo) / 15).clamp(min=1e-8).half()
    zeros = (-lo / scales.float()).round().clamp(0, 15)
    q = (wg / scales.float()[..., None] + zeros[..., None]).round().clamp(0, 15).view(n, k)
    return Int4Weight(pack_nibbles(q), scales.contiguous(), zeros.to(torch.uint8).contiguous(),
                      torch.arange(k, device=w.device) // group)


@torch.no_grad()
def quantize_in_place(model: DecoderModel, method: str, group: int = 128, kernel: str = "auto") -> dict[str, int]:
    """Quantize a loaded dense model's layer projections in memory, as the checkpoint writers do:
    ``fp8``: per output channel, scale = amax / 448 (llm-compressor's min-max observer, symmetric);
    ``awq``: 4-bit asymmetric min-max per group of ``group`` inputs, scale = (max − min) / 15,
    zero = round(−min / scale) (AutoAWQ's zero-point scheme without the activation-aware search).
    The dense weights are freed; returns :func:`use_kernel`'s counts. For benches on shapes no
    checkpoint here has (a random 8B-shaped model) and for serving a dense checkpoint quantized."""
    if method not in ("fp8", "awq"):
        raise ValueError(f"method must be fp8 or awq, got {method!r}")
    for layer in model.model.layers:
        for proj, (parent, _) in PROJECTIONS.items():
            linear: Linear = getattr(getattr(layer, parent), proj)
            linear.quant = quantize_weight(linear.weight, method, group)
            del linear.weight
            linear.register_parameter("weight", None)
    return use_kernel(model, kernel)


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
