"""Building blocks of a Llama-family decoder: RMSNorm, rotary embedding (incl. Llama-3 scaling),
the SwiGLU MLP with fused gate/up projection, a Linear that picks the fastest CPU matmul, and the
tensor-parallel pieces (a row-parallel Linear, a vocabulary-parallel embedding; see
:mod:`workers.engine.parallel`). Tensors are flat over tokens: ``[T, ...]``.
"""

from __future__ import annotations

import logging
import math

import torch
import torch.nn.functional as F
from torch import nn

from runtime.config import cpu_linear

from .config import RopeConfig
from .parallel import SINGLE, TensorParallel, vocab_slice

log = logging.getLogger(__name__)


def _onednn_usable() -> bool:
    if cpu_linear() != "onednn":
        return False
    ops = torch.ops.mkldnn
    return (torch.backends.mkldnn.is_available() and hasattr(ops, "_linear_pointwise")
            and hasattr(ops, "_reorder_linear_weight"))


_ONEDNN = _onednn_usable()
_ONEDNN_MIN_WEIGHT = 1 << 18  # below this oneDNN's ~15 µs call overhead outweighs its faster kernel


class Linear(nn.Linear):
    """``nn.Linear`` (same parameters and state dict) whose CPU float32 inference runs on oneDNN.

    Decoding multiplies a handful of rows (1 per sequence, γ+1 when verifying) by large weights.
    For those shapes torch's default CPU path (MKL sgemm) is slow and, worse, doubles in cost
    from one row to two — exactly the decode → verify step. oneDNN's inner product over weights
    packed once into its blocked layout makes a 5-row verify cost about what a 1-row decode does,
    and every decode step cheaper (``bench/linear_bench.py``, docs/benchmarks.md). The packed copy
    is made on first use and remade if the weight changes. A server calls :meth:`release_dense`
    to keep the packed copy only (the dense weight is rebuilt from it if ever needed), so the
    weights are not held twice. Results equal ``F.linear`` up to float rounding.
    ``TANDEM_CPU_LINEAR=torch`` turns it off (for comparisons); small weights, other devices and
    dtypes, and autograd use ``F.linear``.
    """

    _packed: tuple[torch.Tensor, int, int] | None = None  # (packed weight, data_ptr, version) of the source
    _released = False  # the dense weight was freed: ``_packed`` is the weight
    # LoRA adapters of this projection (:mod:`workers.engine.lora`): lora(x, y) adds the batch's deltas to y
    lora = None
    # a quantized weight (:mod:`workers.engine.quant`) in place of ``weight`` (then None)
    quant = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self._linear(x, self.bias)
        return y if self.lora is None else self.lora(x, y)

    def _linear(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        global _ONEDNN
        if self.quant is not None:
            return self.quant.linear(x, bias)
        if _ONEDNN and x.device.type == "cpu" and x.dtype == torch.float32 and self._packable():
            try:
                return torch.ops.mkldnn._linear_pointwise(x, self._packed_weight(), bias, "none", [], "")
            except RuntimeError as exc:  # a CPU or build oneDNN cannot serve: the default path from now on
                _ONEDNN = False
                log.warning("oneDNN linear unavailable (%s); using torch's default CPU matmul", exc)
        return F.linear(x, self._packed[0].to_dense() if self._released else self.weight, bias)

    def _packable(self) -> bool:
        w = self.weight
        return self._released or (w.device.type == "cpu" and w.dtype == torch.float32
                                  and w.numel() >= _ONEDNN_MIN_WEIGHT and not torch.is_grad_enabled())

    def _packed_weight(self) -> torch.Tensor:
        if self._released:
            return self._packed[0]
        w = self.weight
        # An inference tensor (made under inference_mode) has no version counter: its storage is the key.
        key = (w.data_ptr(), -1 if w.is_inference() else w._version)
        if self._packed is None or self._packed[1:] != key:
            # the layout is tuned for 16 rows and serves any row count
            self._packed = (torch.ops.mkldnn._reorder_linear_weight(w.detach(), 16), *key)
        return self._packed[0]

    @torch.no_grad()
    def release_dense(self) -> bool:
        """Keep only the packed weight and free the dense one; False where the packed path does not apply.

        Do not call it on a weight shared with another module (tied embeddings). The parameter stays,
        empty, so the module keeps its device and dtype; the layer is then for inference only.
        """
        if self._released:
            return True
        if self.quant is not None or not (_ONEDNN and self._packable()):
            return False
        self._packed_weight()
        self.weight.data = self.weight.data.new_empty(0)
        self._released = True
        return True


class RowParallelLinear(Linear):
    """A Linear whose input features are split over the ranks of ``tp``: each rank multiplies its
    slice, one all-reduce sums the partial products, then the (whole, replicated) bias is added once.
    Size 1: exactly :class:`Linear`."""

    def __init__(self, in_features: int, out_features: int, bias: bool, tp: TensorParallel = SINGLE):
        super().__init__(in_features, out_features, bias=bias)
        self.tp = [tp]  # a list keeps the group out of the module tree

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tp = self.tp[0]
        if not tp.enabled:
            y = self._linear(x, self.bias)
            return y if self.lora is None else self.lora(x, y)
        y = tp.all_reduce(self._linear(x, None))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` whose rows are split over the ranks of ``tp`` (see :func:`.parallel.vocab_slice`):
    each rank looks up the ids in its slice (zero rows for the others) and one all-reduce adds them
    up. ``weight`` is this rank's [V', hidden] slice (the whole table at size 1)."""

    def __init__(self, vocab_size: int, hidden: int, tp: TensorParallel = SINGLE):
        super().__init__()
        self.start, self.rows, padded = vocab_slice(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(padded, hidden))
        self.tp = [tp]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        tp = self.tp[0]
        if not tp.enabled:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.rows)
        x = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return tp.all_reduce(x.masked_fill(outside[:, None], 0))


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x²) + eps) * weight, computed in float32."""

    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def rope_inv_freq(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] for ``rope`` (default, linear, llama3 or yarn)."""
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if rope.rope_type == "yarn":
        return _yarn_inv_freq(rope, head_dim, inv_freq)
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        old_len = rope.original_max_position_embeddings
        low_wavelen = old_len / rope.low_freq_factor
        high_wavelen = old_len / rope.high_freq_factor
        wavelen = 2 * math.pi / inv_freq
        # long wavelengths are divided by the factor, short ones kept, the band between interpolated
        scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)
        smooth = (old_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
        smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
        medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
        return torch.where(medium, smoothed, scaled)
    return inv_freq


def _yarn_inv_freq(rope: RopeConfig, head_dim: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """YaRN (arXiv 2309.00071): frequencies that turn fewer than ``beta_slow`` times over the original
    context are interpolated (divided by ``factor``), those that turn more than ``beta_fast`` times
    kept, a linear ramp over the dimensions between; as transformers computes it."""

    def dim_for(rotations: float) -> float:  # the dimension whose frequency turns ``rotations`` times
        return (head_dim * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
                / (2 * math.log(rope.theta)))

    low, high = dim_for(rope.beta_fast), dim_for(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    interpolated = 1.0 / (rope.factor * (1.0 / inv_freq))
    return interpolated * (1 - extrapolate) + inv_freq * extrapolate


def rope_attention_scale(rope: RopeConfig) -> float:
    """The factor YaRN multiplies cos and sin by (1 for the other rope types)."""
    if rope.rope_type != "yarn":
        return 1.0
    if rope.attention_factor is not None:
        return rope.attention_factor

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim)
    return mscale(rope.factor)


class RotaryEmbedding(nn.Module):
    """Rotates query/key heads by position, NeoX style (halves, not interleaved pairs)."""

    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        inv_freq = rope_inv_freq(rope, head_dim)
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        scale = rope_attention_scale(rope)  # yarn scales cos and sin (so q·k by its square); else 1
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)  # [P, D/2]
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)  # [P, D/2]

    # (positions, dtype, cos, sin) of the latest call: every layer of one forward passes the same
    # positions tensor, so the tables are gathered once per forward, not once per layer
    _last: tuple | None = None

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        last = self._last
        if last is not None and last[0] is positions and last[1] == dtype:
            return last[2], last[3]
        cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D/2]
        sin = self.sin[positions].unsqueeze(1).to(dtype)
        self._last = (positions, dtype, cos, sin)
        return cos, sin

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated by position (queries and keys may come as one tensor)."""
        cos, sin = self.tables(positions, x.dtype)
        return _rotate(x, cos, sin)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, H, D]; k [T, Hkv, D]
        cos, sin = self.tables(positions, q.dtype)
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one matmul. Under tensor parallelism
    ``intermediate`` is this rank's slice: gate/up column-parallel, down row-parallel."""

    fused = False  # SwiGLU in one Triton kernel (GPU; set by the model)

    def __init__(self, hidden: int, intermediate: int, bias: bool, tp: TensorParallel = SINGLE):
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=bias)
        self.down_proj = RowParallelLinear(intermediate, hidden, bias, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fused:
            from .triton_ops import silu_mul

            return self.down_proj(silu_mul(self.gate_up_proj(x)))
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
