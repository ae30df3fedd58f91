"""The ``Proposer`` protocol every draft method implements, and helpers the model-based ones share.

A proposer keeps per-sequence state: the tokens the target has committed, and whatever it drafted
on top of them. The payloads it takes and returns are :mod:`workers.speculation.payloads`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..speculation.payloads import DraftInput, DraftOutput, SamplingSpec, SparseDist, VerifyResult

__all__ = ["DraftInput", "DraftOutput", "Proposer", "SamplingSpec", "SparseDist", "VerifyResult", "grow_blocks",
           "sample_draft", "sequence_for"]


class Proposer:
    """A draft method. Calls for one sequence arrive in order: propose, verified, propose, ..., release.

    Every method subclasses this; the class attributes below are its capabilities, with the
    defaults of a method that has none of them (the service reads them, it never probes)."""

    method: str = ""
    hidden_layers: Sequence[int] = ()  # target layers whose hidden states it needs (empty: none)
    hidden_dtype: str = ""  # the wire dtype it wants hidden states in ('': the target's choice)
    vocab_size: int = 0  # the vocabulary its drafts come from, when it knows it (0: unknown)
    device: torch.device = torch.device("cpu")  # where its tensors live
    drafts_ahead: bool = False  # implements :meth:`predraft`
    stages: bool = False  # drafts staged branches for the pipelined seam (:class:`.stager.Drafter`)
    distillable: bool = False  # an EAGLE-3 head online distillation can train (:meth:`load_weights`, ``recorder``)
    # Drafts in pure Python in microseconds (n-gram, suffix): the service calls it on its event loop,
    # where a hop to a worker thread and back would cost more than the call (and a turn of the loop)
    on_loop: bool = False

    def propose(self, batch: list[DraftInput]) -> list[DraftOutput]:
        """Draft for every sequence of the batch (one output per input, same order)."""
        raise NotImplementedError

    def verified(self, results: list[VerifyResult]) -> None:
        """Commit what the target accepted and emitted; roll back the rest."""
        raise NotImplementedError

    def release(self, seq_ids: list[str]) -> None:
        """Forget sequences that finished."""
        raise NotImplementedError

    def predraft(self, seq_ids: list[str], num_tokens: int) -> None:
        """Extend the drafted tails of ``seq_ids`` to ``num_tokens`` tokens ahead of the next request
        (only where :attr:`drafts_ahead`)."""
        raise NotImplementedError(f"draft method {self.method!r} does not draft ahead")

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Take new weights between proposal batches (only where :attr:`distillable`)."""
        raise ValueError(f"draft method {self.method!r} takes no new weights")


def sample_draft(logits: torch.Tensor, sampling: SamplingSpec, generator: torch.Generator | None,
                 max_support: int) -> tuple[int, SparseDist | None]:
    """One draft token from logits [V], and the distribution it was drawn from (None: greedy).

    Sampled drafts come from q = softmax(logits / T) over its top min(max_support, top_k) tokens,
    renormalised: a sparse q that travels whole, so the target's rejection test stays exact.
    """
    if sampling.greedy:
        return int(logits.argmax()), None
    k = min(max_support, sampling.top_k) if sampling.top_k > 0 else max_support
    top_vals, top_ids = (logits.float() / sampling.temperature).topk(min(k, logits.shape[-1]))
    probs = top_vals.softmax(-1)  # [k]
    choice = int(torch.multinomial(probs, 1, generator=generator))
    return int(top_ids[choice]), SparseDist(top_ids.tolist(), probs.tolist())


def sequence_for(seqs: dict, item: DraftInput, make, device: torch.device | str = "cpu"):
    """A proposer's state for ``item``'s sequence: ``make()`` on first sight (with a generator on
    ``device``, where the draft's draws are made, seeded from the request's seed, if any, in its
    ``generator``), its ``sampling`` refreshed from ``item``."""
    seq = seqs.get(item.seq_id)
    if seq is None:
        seq = seqs[item.seq_id] = make()
        if item.sampling.seed is not None:
            seq.generator = torch.Generator(device=device).manual_seed(item.sampling.seed)
    seq.sampling = item.sampling
    return seq


def grow_blocks(manager, blocks: list[int], num_tokens: int) -> bool:
    """Extend a block table (in place) to hold ``num_tokens`` tokens; False when the cache is full."""
    need = -(-num_tokens // manager.block_size) - len(blocks)
    if need <= 0:
        return True
    if not manager.can_allocate(need):
        return False
    blocks.extend(manager.allocate(need))
    return True
