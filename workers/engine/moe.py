"""Mixture-of-experts layers: the router, the routed experts and a shared expert, over a flat batch
of tokens ``[T, hidden]`` (the maths per family: :mod:`workers.engine.moe_config`).

Every token goes to its top-k experts; an expert's output is weighted by the token's routing weight
and the k outputs summed (plus the shared expert's, where a family has one). The experts' weights
are stacked: ``gate_up_proj`` [E', 2I', H] (gate rows, then up rows), ``down_proj`` [E', H, I'], and
for gpt-oss their biases ``gate_up_bias`` [E', 2I'], ``down_bias`` [E', H].

**The expert loop** (CPU, and the reference). The (token, slot) pairs of the batch are sorted by
expert (one ``argsort`` and one ``bincount``, read on the host once per layer); each expert that got
tokens gathers its rows (``index_select``), runs its SwiGLU on them and adds them back weighted
(``index_add_``): a Python step per expert that has work, none per token.

**The fused path** (``fused=True``, GPU): the same maths in two Triton launches for all experts
(:mod:`workers.engine.triton_moe`: pairs sorted by expert on the device, the gate/up GEMM with the
activation, the down GEMM with the routing weights). Nothing is read on the host, so a model of
these layers can be captured in CUDA graphs.

**Parallelism** (``tp`` of size N > 1, the group of :mod:`workers.engine.parallel`); the router is
replicated and every rank routes every token, so each rank's output is a partial sum and one
all-reduce per layer completes it:

- tensor parallel (the default): every rank holds every expert, sliced Megatron-style over the
  intermediate size (gate/up rows, down columns), the shared expert likewise; a down bias is added
  on rank 0 only;
- expert parallel (``expert_parallel=True``, vLLM's ``--enable-expert-parallel``: experts over the
  tensor-parallel group): rank r holds experts [r·E/N, (r+1)·E/N) whole and computes only the pairs
  routed to them; E must divide by N. Attention and dense layers stay tensor-parallel.

:meth:`SparseMoe.checkpoint_slice` says which part of each checkpoint tensor a rank reads (an expert
it does not hold: nothing) and :meth:`SparseMoe.load` takes the tensor names a checkpoint may use:
per-expert (``experts.N.gate_proj`` for Qwen, ``block_sparse_moe.experts.N.w1/w2/w3`` for Mixtral,
what ``save_pretrained`` writes) and stacked (``experts.gate_up_proj`` [E, 2I, H] as transformers
holds Qwen's and Mixtral's in memory; gpt-oss's [E, H, 2I] with gate and up columns interleaved).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .moe_config import MoeConfig
from .parallel import SINGLE, TensorParallel, split_range

_PARTS = ("gate", "up", "down")
_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def route(logits: torch.Tensor, moe: MoeConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Routing weights [T, k] and expert ids [T, k] (long) from router logits [T, E], as the family's
    transformers code computes them (float32 softmax for ``softmax_topk``)."""
    if moe.scoring == "softmax_topk":
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, ids = torch.topk(probs, moe.top_k, dim=-1)
        if moe.norm_topk_prob:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights.to(logits.dtype), ids
    top, ids = torch.topk(logits, moe.top_k, dim=-1)
    return torch.softmax(top, dim=-1), ids


def expert_activation(gate_up: torch.Tensor, moe: MoeConfig) -> torch.Tensor:
    """gate_up [n, 2I] (gate columns, then up) → [n, I]: SwiGLU, or gpt-oss's clamped variant."""
    gate, up = gate_up.chunk(2, dim=-1)
    if moe.activation == "silu":
        return F.silu(gate) * up
    gate = gate.clamp(max=moe.swiglu_limit)
    up = up.clamp(min=-moe.swiglu_limit, max=moe.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * moe.swiglu_alpha))


class Experts(nn.Module):
    """This rank's routed experts, stacked: experts [first, first + count), intermediate columns
    [inter_start, inter_start + inter) of each."""

    def __init__(self, moe: MoeConfig, hidden: int, tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        super().__init__()
        self.moe = moe
        if expert_parallel and tp.enabled:
            self.first, self.count = moe.local_experts(tp.rank, tp.size)
            self.inter_start, self.inter = 0, moe.intermediate_size
        else:
            self.first, self.count = 0, moe.num_experts
            self.inter_start, self.inter = split_range(moe.intermediate_size, tp.rank, tp.size)
        # a down bias is a whole [H] vector: added by the rank that holds the expert's whole output
        # (its own expert under expert parallelism), by rank 0 alone when ranks hold slices of it
        self.add_down_bias = moe.expert_bias and (expert_parallel or tp.rank == 0)
        self.gate_up_proj = nn.Parameter(torch.empty(self.count, 2 * self.inter, hidden))
        self.down_proj = nn.Parameter(torch.empty(self.count, hidden, self.inter))
        if moe.expert_bias:
            self.gate_up_bias = nn.Parameter(torch.empty(self.count, 2 * self.inter))
            self.down_bias = nn.Parameter(torch.empty(self.count, hidden))

    def forward(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids / weights [T, k] → [T, H]: the weighted sum of this rank's experts' outputs
        (its share of them: a partial sum under parallelism)."""
        k = ids.shape[1]
        local = ids.reshape(-1) - self.first  # [T·k] the expert of each (token, slot) pair, this rank's numbering
        if self.count != self.moe.num_experts:  # pairs routed to another rank's experts sort last
            local = torch.where((local >= 0) & (local < self.count), local, self.count)
        order = torch.argsort(local, stable=True)  # [T·k] pairs grouped by expert
        counts = torch.bincount(local, minlength=self.count + 1)[: self.count].tolist()
        flat_weights = weights.reshape(-1)
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if not n:
                continue
            pairs = order[start : start + n]
            start += n
            tokens = torch.div(pairs, k, rounding_mode="floor")
            y = self.expert(e, x.index_select(0, tokens))
            out.index_add_(0, tokens, y * flat_weights.index_select(0, pairs)[:, None].to(y.dtype))
        return out

    def forward_fused(self, x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` through the grouped Triton kernels: the same sum, no host read."""
        from .triton_moe import fused_experts

        bias = self.moe.expert_bias
        return fused_experts(x, ids, weights, self.gate_up_proj, self.down_proj, first=self.first,
                             num_experts=self.moe.num_experts, gate_up_bias=self.gate_up_bias if bias else None,
                             down_bias=self.down_bias if self.add_down_bias else None,
                             activation=self.moe.activation, alpha=self.moe.swiglu_alpha, limit=self.moe.swiglu_limit)

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Local expert ``e`` on rows x [n, H] → [n, H]."""
        bias = self.moe.expert_bias
        h = expert_activation(F.linear(x, self.gate_up_proj[e], self.gate_up_bias[e] if bias else None), self.moe)
        return F.linear(h, self.down_proj[e], self.down_bias[e] if self.add_down_bias else None)


class SharedExpert(nn.Module):
    """A dense SwiGLU expert every token goes through (this rank's intermediate slice), without the
    row-parallel all-reduce: :class:`SparseMoe` reduces once for both."""

    def __init__(self, hidden: int, intermediate: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class SparseMoe(nn.Module):
    """A sparse layer's MLP: router ``gate`` [E, H] (+ bias for gpt-oss), routed ``experts``, and a
    ``shared_expert`` with its sigmoid ``shared_expert_gate`` where the family has one."""

    fused = False  # the grouped Triton kernels instead of the expert loop (GPU; set by the model)

    def __init__(self, moe: MoeConfig, hidden: int, tp: TensorParallel = SINGLE, expert_parallel: bool = False):
        super().__init__()
        self.moe = moe
        self.tp = [tp]  # a list keeps the group out of the module tree
        self.gate = nn.Linear(hidden, moe.num_experts, bias=moe.router_bias)
        self.experts = Experts(moe, hidden, tp, expert_parallel)
        self._mxfp4: dict[str, dict[str, torch.Tensor]] = {}  # MXFP4 halves waiting for their other half
        self.shared = None
        if moe.shared_intermediate_size:
            self.shared = split_range(moe.shared_intermediate_size, tp.rank, tp.size)
            self.shared_expert = SharedExpert(hidden, self.shared[1])
            self.shared_expert_gate = nn.Linear(hidden, 1, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = route(F.linear(x, self.gate.weight, self.gate.bias), self.moe)  # [T, k] each
        out = self.experts.forward_fused(x, ids, weights) if self.fused else self.experts(x, ids, weights)
        if self.shared is not None:  # sigmoid(g) times a partial sum is a partial sum of the whole
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return self.tp[0].all_reduce(out)

    # ------------------------------------------------------------------ checkpoint tensors

    @staticmethod
    def canonical(suffix: str) -> str:
        """A checkpoint name below a layer's MoE block (``mlp.`` / ``block_sparse_moe.`` cut off) in
        one spelling: Mixtral's w1/w3/w2 as gate/up/down_proj, gpt-oss's ``router`` as ``gate``."""
        parts = suffix.split(".")
        if parts[0] == "router":
            parts[0] = "gate"
        if len(parts) == 4 and parts[0] == "experts" and parts[2] in _MIXTRAL:
            parts[2] = _MIXTRAL[parts[2]]
        return ".".join(parts)

    def checkpoint_slice(self, suffix: str) -> tuple[int, int, int] | None:
        """(dim, start, length) of checkpoint tensor ``suffix`` this rank reads (length 0: none of it;
        None: all of it). Under tensor parallelism only; a size-1 group reads everything."""
        if not self.tp[0].enabled:
            return None
        ex = self.experts
        parts = self.canonical(suffix).split(".")
        i0, i = ex.inter_start, ex.inter
        if parts[0] == "shared_expert" and len(parts) == 3:
            start, count = self.shared
            return (0, start, count) if parts[1] in ("gate_proj", "up_proj") else (1, start, count)
        if parts[0] != "experts":
            return None  # router, shared expert gate: replicated
        if len(parts) == 4:  # experts.N.{gate,up,down}_proj.weight
            e = int(parts[1])
            if not ex.first <= e < ex.first + ex.count:
                return 0, 0, 0
            if ex.count != self.moe.num_experts:
                return None  # a whole expert
            return (0, i0, i) if parts[2] in ("gate_proj", "up_proj") else (1, i0, i)
        if ex.count != self.moe.num_experts:  # stacked, expert parallel: this rank's experts
            return 0, ex.first, ex.count
        gpt_oss = self.moe.activation == "swiglu_clamped"
        name = parts[1]
        if name.endswith(("_blocks", "_scales")):
            return None  # MXFP4 (gpt-oss): cut once dequantized
        if name == "down_proj":  # [E, I, H] (gpt-oss) or [E, H, I]
            return (1, i0, i) if gpt_oss else (2, i0, i)
        if name == "gate_up_proj" and gpt_oss:  # [E, H, 2I], gate and up interleaved: one run of columns
            return 2, 2 * i0, 2 * i
        if name == "gate_up_proj_bias":
            return 1, 2 * i0, 2 * i
        return None  # Qwen's stacked gate_up [E, 2I, H] (two runs of rows: cut on load), the down bias

    @torch.no_grad()
    def load(self, suffix: str, tensor: torch.Tensor) -> set[str]:
        """Copy checkpoint tensor ``suffix`` (as :meth:`checkpoint_slice` cut it) into this rank's
        parameters; the keys of :meth:`expected` it fills. Raises ValueError for unknown names/shapes."""
        name = self.canonical(suffix)
        parts = name.split(".")
        if parts[0] == "gate" and len(parts) == 2:
            _copy(getattr(self.gate, parts[1]), tensor, suffix)
            return {name}
        if parts[0] == "shared_expert_gate" and self.shared is not None:
            _copy(self.shared_expert_gate.weight, tensor, suffix)
            return {name}
        if parts[0] == "shared_expert" and self.shared is not None and len(parts) == 3:
            inter = self.shared[1]
            if parts[1] == "down_proj":
                _copy(self.shared_expert.down_proj.weight, tensor, suffix)
            elif parts[1] in ("gate_proj", "up_proj"):
                row = 0 if parts[1] == "gate_proj" else inter
                _copy(self.shared_expert.gate_up_proj.weight[row : row + inter], tensor, suffix)
            else:
                raise ValueError(f"unexpected checkpoint tensor {suffix!r}")
            return {name}
        if parts[0] != "experts":
            raise ValueError(f"unexpected checkpoint tensor {suffix!r}")
        if len(parts) == 4 and parts[2] in ("gate_proj", "up_proj", "down_proj") and parts[3] == "weight":
            return self._load_one(int(parts[1]), parts[2], tensor, suffix)
        if len(parts) == 2 and parts[1].endswith(("_blocks", "_scales")) and self.moe.activation == "swiglu_clamped":
            return self._load_mxfp4(parts[1], tensor, suffix)
        if len(parts) == 2:
            return self._load_stacked(parts[1], tensor, suffix, self.checkpoint_slice(suffix))
        raise ValueError(f"unexpected checkpoint tensor {suffix!r}")

    def _load_mxfp4(self, name: str, tensor: torch.Tensor, suffix: str) -> set[str]:
        """gpt-oss's MXFP4 experts: ``{gate_up,down}_proj_blocks`` and ``_scales`` come one at a time;
        once both halves of a projection are in, it is dequantized and loaded as the bf16 tensor."""
        proj, half = name.rsplit("_", 1)
        if proj not in ("gate_up_proj", "down_proj"):
            raise ValueError(f"unexpected checkpoint tensor {suffix!r}")
        pending = self._mxfp4.setdefault(proj, {})
        pending[half] = tensor
        if len(pending) < 2:
            return set()
        del self._mxfp4[proj]
        dense = dequantize_mxfp4(pending["blocks"], pending["scales"], self.gate.weight.dtype)
        return self._load_stacked(proj, dense, suffix, self.checkpoint_slice(suffix))

    def _load_one(self, e: int, proj: str, tensor: torch.Tensor, suffix: str) -> set[str]:
        ex = self.experts
        if not 0 <= e < self.moe.num_experts:
            raise ValueError(f"{suffix}: expert {e} out of range (num_experts {self.moe.num_experts})")
        if not ex.first <= e < ex.first + ex.count:
            return set()  # another rank's expert
        local, i = e - ex.first, ex.inter
        i0 = 0 if self.checkpoint_slice(suffix) is not None else ex.inter_start  # read cut to this rank's columns
        if proj == "down_proj":
            _copy(ex.down_proj[local], tensor[:, i0 : i0 + i], suffix)
        else:
            row = 0 if proj == "gate_proj" else i
            _copy(ex.gate_up_proj[local, row : row + i], tensor[i0 : i0 + i], suffix)
        return {f"experts.{e}.{proj[:-5]}"}

    def _load_stacked(self, name: str, tensor: torch.Tensor, suffix: str, cut) -> set[str]:
        """A stacked tensor, ``cut`` as it was read (this rank's experts on dim 0, or its columns)."""
        ex, moe = self.experts, self.moe
        gpt_oss = moe.activation == "swiglu_clamped"
        if cut is None or cut[0] != 0:
            tensor = tensor[ex.first : ex.first + ex.count]
        i0, i = (0 if cut is not None and cut[0] != 0 else ex.inter_start), ex.inter
        if name == "gate_up_proj" and gpt_oss:  # [E, H, 2I]: gate at even columns, up at odd
            cols = tensor[:, :, 2 * i0 : 2 * (i0 + i)]
            _copy(ex.gate_up_proj, torch.cat([cols[:, :, 0::2], cols[:, :, 1::2]], dim=2).transpose(1, 2), suffix)
            parts = ("gate", "up")
        elif name == "gate_up_proj":  # [E, 2I, H]: gate rows, then up rows
            full = moe.intermediate_size
            _copy(ex.gate_up_proj, torch.cat([tensor[:, i0 : i0 + i], tensor[:, full + i0 : full + i0 + i]], dim=1),
                  suffix)
            parts = ("gate", "up")
        elif name == "down_proj":  # [E, I, H] (gpt-oss) or [E, H, I]
            _copy(ex.down_proj, tensor[:, i0 : i0 + i].transpose(1, 2) if gpt_oss else tensor[:, :, i0 : i0 + i],
                  suffix)
            parts = ("down",)
        elif name == "gate_up_proj_bias" and moe.expert_bias:  # [E, 2I] interleaved
            cols = tensor[:, 2 * i0 : 2 * (i0 + i)]
            _copy(ex.gate_up_bias, torch.cat([cols[:, 0::2], cols[:, 1::2]], dim=1), suffix)
            parts = ("gate_bias", "up_bias")
        elif name == "down_proj_bias" and moe.expert_bias:
            _copy(ex.down_bias, tensor, suffix)
            parts = ("down_bias",)
        else:
            raise ValueError(f"unexpected checkpoint tensor {suffix!r}")
        return {f"experts.{e}.{p}" for e in range(ex.first, ex.first + ex.count) for p in parts}

    def expected(self) -> set[str]:
        """The keys :meth:`load` must have returned once the whole checkpoint is read."""
        ex = self.experts
        parts = _PARTS + (("gate_bias", "up_bias", "down_bias") if self.moe.expert_bias else ())
        keys = {f"experts.{e}.{p}" for e in range(ex.first, ex.first + ex.count) for p in parts}
        keys.add("gate.weight")
        if self.moe.router_bias:
            keys.add("gate.bias")
        if self.shared is not None:
            keys |= {"shared_expert.gate_proj.weight", "shared_expert.up_proj.weight",
                     "shared_expert.down_proj.weight", "shared_expert_gate.weight"}
        return keys


# the 16 values of an FP4 (E2M1) nibble
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """MXFP4 (OCP microscaling: 32 FP4 values share one power-of-two scale) as gpt-oss stores its
    experts: blocks [E, R, G, 16] uint8 (two values a byte, low nibble first), scales [E, R, G] uint8
    (exponent + 127) → [E, 32·G, R] in ``dtype``: row r of the stored matrix becomes column r, the
    layout of gpt-oss's bf16 ``gate_up_proj`` [E, H, 2I] and ``down_proj`` [E, I, H]."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != 16:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    lut = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    blocks = blocks.to(torch.uint8)
    values = torch.stack([lut[(blocks & 0x0F).long()], lut[(blocks >> 4).long()]], dim=-1)  # [E, R, G, 16, 2]
    values = torch.ldexp(values.flatten(-2), (scales.to(torch.int32) - 127)[..., None].float())  # [E, R, G, 32]
    return values.flatten(-2).transpose(1, 2).to(dtype).contiguous()


def _copy(dest: torch.Tensor, src: torch.Tensor, name: str) -> None:
    if dest.shape != src.shape:
        raise ValueError(f"{name}: shape {tuple(src.shape)} != expected {tuple(dest.shape)}")
    dest.copy_(src)
