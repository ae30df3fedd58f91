"""A launched step whose sampled tokens are still on their way to the host (async scheduling).

With async scheduling the engine launches step N+1 before step N's tokens reach the host: step N+1
reads them from the device tensor kept here (:attr:`PendingStep.tokens`), and step N's host
bookkeeping (appending tokens, finish checks, deltas, prefix-cache registration) runs after step
N+1 is launched, one step behind. The copy to the host is queued right after step N's sampling,
before step N+1's forward, so on a GPU it lands while step N+1 runs; :meth:`PendingStep.wait` is
the only place the host waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sequence import Sequence


@dataclass
class PendingStep:
    """Step N's sampled sequences (row order) and what it sampled for them.

    ``tokens`` [B] long on the device (what step N+1's inputs gather from); ``logprobs``: (chosen
    [L], top ids [L, k], top logprobs [L, k]) on the device for the L rows of ``asking`` (indices
    into ``seqs``), or None. ``host``: the same tensors' host copies, complete once ``ready`` has
    passed (None on CPU, where the copy is the tensor itself).
    """

    seqs: list[Sequence]
    tokens: torch.Tensor
    asking: list[int]
    logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None
    host: list[torch.Tensor]
    ready: torch.cuda.Event | None

    @classmethod
    def launch(cls, seqs: list[Sequence], tokens: torch.Tensor, asking: list[int],
               logprobs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None) -> PendingStep:
        """Queue the copies to the host (pinned buffers, non-blocking) behind step N's sampling."""
        tensors = [tokens, *(logprobs or ())]
        if not tokens.is_cuda:
            return cls(seqs, tokens, asking, logprobs, tensors, None)
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
        for h, t in zip(host, tensors):
            h.copy_(t, non_blocking=True)
        ready = torch.cuda.Event()
        ready.record()
        return cls(seqs, tokens, asking, logprobs, host, ready)

    def row_of(self) -> dict[int, int]:
        """Row of ``tokens`` per sequence (by ``id``: a sequence object, not its request id, which a
        new request may reuse after an abort)."""
        return {id(s): i for i, s in enumerate(self.seqs)}

    def wait(self) -> tuple[list[int], tuple[list, list, list] | None]:
        """Block until the copies landed; (tokens, (chosen, top ids, top logprobs) or None) as lists."""
        if self.ready is not None:
            self.ready.synchronize()
        lists = [h.tolist() for h in self.host]
        return lists[0], (tuple(lists[1:]) if self.logprobs is not None else None)
