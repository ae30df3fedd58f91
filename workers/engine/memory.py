"""How big the KV cache may be under ``--gpu-memory-utilization``: plain arithmetic, no torch.

vLLM's rule: the worker may use ``utilization × total`` bytes of its device; the KV cache gets
what is left of that after what the worker already holds (weights: measured, what the allocator
has reserved) and what its steps will still need (the activations of the largest step, and the
CUDA graphs' memory pool, whose size is about the activations of the largest graphed step):

    kv = utilization × total − held − reserve,   and never more than  free − reserve

(the second bound: other processes on the device, e.g. a draft worker beside the target, may have
taken more than the budget leaves). ``reserve`` includes :data:`ALLOCATOR_SLACK`. The CUDA context
(a few hundred MiB outside the allocator) is not the allocator's: it counts among what is not free. The activation estimate (:func:`step_activation_bytes`) is an
upper bound of one forward pass's live tensors, the logits in float32 included; the engine logs
what the device holds once the cache is allocated and the graphs captured.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1 << 30
MIB = 1 << 20
# Kept besides the estimates: the caching allocator's rounding (2 MiB segments for small tensors, whole
# segments for large ones) and what an estimate, not a measurement, of the activations may miss.
ALLOCATOR_SLACK = 128 * MIB


class NoMemoryForCache(ValueError):
    """The utilization leaves nothing (or less than one block) for the KV cache."""


@dataclass(frozen=True)
class DeviceMemory:
    """Bytes of one device: its total, what is free now, what this process's allocator holds."""

    total: int
    free: int
    held: int

    def __post_init__(self) -> None:
        if self.total <= 0 or not 0 <= self.free <= self.total or self.held < 0:
            raise ValueError(f"implausible device memory: total {self.total}, free {self.free}, held {self.held}")


def step_activation_bytes(num_tokens: int, logits_rows: int, *, hidden_size: int, intermediate_size: int,
                          q_size: int, kv_size: int, vocab_size: int, itemsize: int) -> int:
    """An upper bound of the live activations of one forward pass over ``num_tokens`` tokens that
    returns ``logits_rows`` rows of logits: the residual stream and a normed copy, q/k/v and the
    attention output, the MLP's gate, up and product (one layer's worth live at a time), then the
    logits in the model's dtype and in float32 for sampling."""
    per_token = 3 * hidden_size + q_size + 2 * kv_size + q_size + 3 * intermediate_size
    return num_tokens * per_token * itemsize + logits_rows * vocab_size * (itemsize + 4 + 4)


def kv_cache_bytes(memory: DeviceMemory, utilization: float, reserve: int) -> int:
    """The KV cache's bytes for ``utilization`` (0, 1] of ``memory.total``, ``reserve`` bytes kept
    for activations and graphs (see the module's docstring). Raises :class:`NoMemoryForCache`."""
    if not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {utilization}")
    if reserve < 0:
        raise ValueError(f"reserve must be >= 0, got {reserve}")
    budget = int(utilization * memory.total) - memory.held - reserve
    room = memory.free - reserve
    kv = min(budget, room)
    if kv <= 0:
        why = (f"{utilization:g} of {memory.total / GIB:.2f} GiB is {utilization * memory.total / GIB:.2f} GiB; the weights "
               f"and the rest this worker holds take {memory.held / GIB:.2f} GiB and its steps need about "
               f"{reserve / GIB:.2f} GiB more" if budget <= room else
               f"only {memory.free / GIB:.2f} GiB of the device is free (other processes hold the rest) and this "
               f"worker's steps need about {reserve / GIB:.2f} GiB")
        raise NoMemoryForCache(f"--gpu-memory-utilization {utilization:g} leaves no memory for the KV cache: {why}; "
                               f"raise it, or lower --max-num-batched-tokens / --max-num-seqs")
    return kv
