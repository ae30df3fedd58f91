"""Tensor parallelism: one model split over N ranks (one process per device), Megatron-style.

Each rank holds a slice of every large weight and the KV cache of its own heads:

- attention: rank r computes whole GQA groups, a KV head and the query heads that read it
  (:func:`split_heads`): with at least N KV heads, Hkv/N each (as evenly as they go when N does not
  divide Hkv: the demo model's 3 KV heads, 9 query heads over 2 ranks are 1+3 and 2+6); with fewer,
  each KV head is *replicated* on the ranks whose query heads read it (every rank holds one). The
  fused QKV projection is column-parallel (each rank's rows), ``o_proj`` row-parallel (each rank's
  input columns);
- MLP: gate/up column-parallel over the intermediate size (:func:`split_range`), ``down_proj``
  row-parallel;
- a row-parallel projection yields partial sums: one all-reduce each (two per layer), after which
  the residual stream (hidden size, not sharded) is the same on every rank. Hidden states handed to
  draft workers therefore have the full hidden size, on every rank;
- embedding and LM head are vocabulary-parallel: rank r holds vocabulary rows [r·V', (r+1)·V'),
  V' = ceil(V/N) (the last slice padded with zero rows). An embedding lookup is a masked lookup and
  one all-reduce; the logits are each rank's [N, V'] columns gathered (one all-gather) and cut to V.

:class:`TensorParallel` is the group a rank's model layers call their collectives on (size 1: no
collectives, the single-device model exactly);
:meth:`workers.engine.model.DecoderModel.checkpoint_slice` says which slice of a checkpoint tensor a
rank reads, so each rank loads about 1/N of the weights.
Collectives run on a process group built from a ``TCPStore`` (gloo on CPU, NCCL on CUDA), with a
timeout per operation: a rank that dies makes the others' next collective fail (gloo notices a
closed connection at once), a rank that hangs makes it fail after the timeout; never a hang.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


class TensorParallelFailed(RuntimeError):
    """A collective failed or a rank died: the group can serve no more steps."""


@dataclass(frozen=True)
class HeadSplit:
    """One rank's attention heads: query heads [q_start, q_start + q_count), KV heads likewise."""

    q_start: int
    q_count: int
    kv_start: int
    kv_count: int


def split_heads(num_heads: int, num_kv_heads: int, rank: int, size: int) -> HeadSplit:
    """Rank ``rank``'s heads of ``size``: whole GQA groups (a KV head and the query heads reading it)
    as evenly as they go. With at least ``size`` KV heads, rank r holds KV heads
    [⌊r·Hkv/N⌋, ⌊(r+1)·Hkv/N⌋) and their query heads (uneven when N does not divide Hkv, e.g. 3 KV
    heads over 2 ranks: 1 and 2). With fewer, rank r holds a copy of KV head ⌊r·Hkv/N⌋ and an even
    share of its query heads among the ranks that hold it. Raises ValueError when a rank would get no
    query head."""
    if not 0 <= rank < size:
        raise ValueError(f"rank {rank} out of range for tensor-parallel size {size}")
    group = num_heads // num_kv_heads
    if num_kv_heads >= size:
        kv_start, kv_stop = rank * num_kv_heads // size, (rank + 1) * num_kv_heads // size
        return HeadSplit(kv_start * group, (kv_stop - kv_start) * group, kv_start, kv_stop - kv_start)
    kv = rank * num_kv_heads // size
    sharers = [r for r in range(size) if r * num_kv_heads // size == kv]
    n, i = len(sharers), sharers.index(rank)
    if n > group:
        raise ValueError(f"{num_heads} attention heads ({num_kv_heads} KV heads) cannot give each of "
                         f"{size} tensor-parallel ranks a query head")
    q_start, q_stop = kv * group + i * group // n, kv * group + (i + 1) * group // n
    return HeadSplit(q_start, q_stop - q_start, kv, 1)


def split_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """(start, count) of rank's near-equal contiguous slice of ``total`` (the MLP's intermediate size)."""
    start, stop = rank * total // size, (rank + 1) * total // size
    if stop == start:
        raise ValueError(f"size {total} cannot give each of {size} tensor-parallel ranks a slice")
    return start, stop - start


def vocab_slice(vocab_size: int, rank: int, size: int) -> tuple[int, int, int]:
    """(start, rows held, rows padded to) of rank's vocabulary slice: V' = ceil(V/N) rows each, the
    last rank's slice cut at V (and padded with zero rows to V')."""
    per = -(-vocab_size // size)
    start = min(rank * per, vocab_size)
    return start, min(per, vocab_size - start), per


class TensorParallel:
    """A rank's place in its group and the collectives its model layers call.

    ``group`` is a ``torch.distributed`` process group object (``ProcessGroupGloo``/``NCCL``), or
    None for size 1. Collectives are called directly on it (no global default group), so that a
    process may build several (tests) and nothing else in it is affected.
    """

    def __init__(self, rank: int = 0, size: int = 1, group=None, backend: str = "none"):
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} out of range for tensor-parallel size {size}")
        if size > 1 and group is None:
            raise ValueError("a tensor-parallel group of size > 1 needs a process group")
        self.rank = rank
        self.size = size
        self.group = group
        self.backend = backend
        self.failed: str | None = None  # why the group can no longer run collectives
        self.on_fail: Callable[[str], None] | None = None  # called once, from the thread that saw it

    @classmethod
    def connect(cls, rank: int, size: int, host: str, port: int, backend: str, timeout: float,
                store=None) -> TensorParallel:
        """Join the group whose rank 0 serves a ``TCPStore`` at host:port (rank 0 passes its ``store``).

        ``timeout`` (seconds) bounds every collective and the wait for the other ranks to join."""
        import torch.distributed as dist

        delta = datetime.timedelta(seconds=timeout)
        if store is None:
            store = dist.TCPStore(host, port, size, is_master=False, timeout=delta)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = delta
            options._devices = [dist.ProcessGroupGloo.create_device(hostname=host)]  # the ranks' pairs on host
            group = dist.ProcessGroupGloo(store, rank, size, options)
        elif backend == "nccl":
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = delta
            group = dist.ProcessGroupNCCL(store, rank, size, options)
        else:
            raise ValueError(f"unknown tensor-parallel backend {backend!r} (gloo or nccl)")
        tp = cls(rank, size, group, backend)
        tp.all_reduce(torch.zeros(1, device=f"cuda:{torch.cuda.current_device()}" if backend == "nccl" else "cpu"))
        log.info("tensor-parallel rank %d of %d joined (%s)", rank, size, backend)
        return tp

    @property
    def enabled(self) -> bool:
        return self.size > 1

    def heads(self, num_heads: int, num_kv_heads: int) -> HeadSplit:
        return split_heads(num_heads, num_kv_heads, self.rank, self.size)

    def check(self) -> None:
        if self.failed is not None:
            raise TensorParallelFailed(self.failed)

    def fail(self, reason: str) -> None:
        """Mark the group unusable (a rank died, a collective failed); the first reason is kept."""
        if self.failed is None:
            self.failed = reason
            log.error("tensor-parallel group failed: %s", reason)
            if self.on_fail is not None:
                self.on_fail(reason)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (size 1: ``x``)."""
        if self.size == 1:
            return x
        self.check()
        try:
            self.group.allreduce([x]).wait()
        except RuntimeError as exc:
            self.fail(f"all-reduce failed: {exc}")
            raise TensorParallelFailed(self.failed) from exc
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., d] from every rank, concatenated in rank order: [..., size·d] (size 1: ``x``)."""
        if self.size == 1:
            return x
        self.check()
        x = x.contiguous()
        try:
            if self.backend == "nccl":  # one flat buffer: what NCCL (and a CUDA graph) wants
                out = x.new_empty((self.size,) + tuple(x.shape))
                self.group._allgather_base(out.view(-1), x.view(-1)).wait()
                parts = out.unbind(0)
            else:
                parts = [torch.empty_like(x) for _ in range(self.size)]
                self.group.allgather([parts], [x]).wait()
        except RuntimeError as exc:
            self.fail(f"all-gather failed: {exc}")
            raise TensorParallelFailed(self.failed) from exc
        return torch.cat(parts, dim=-1)


SINGLE = TensorParallel()  # size 1: the single-device model
