"""Packed int4 checkpoint layouts read into one form: (q [out, in] integers 0..15, zeros and scales per
group), from AutoAWQ's GEMM words and GPTQ's v1 words; and that form packed two nibbles a byte for
:class:`.quant.Int4Weight`."""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # the output column AWQ puts in nibble k of a word
_AWQ_UNDO = torch.tensor([AWQ_ORDER.index(j) for j in range(8)])  # column j's nibble


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
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
