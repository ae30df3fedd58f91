"""The one interface every draft method implements (:class:`Drafter`), what it is asked
(:class:`Branch`) and answers (:class:`Draft`), what it can do (:class:`Capabilities`), and helpers the
model-based drafters share.

A drafter keeps per-sequence state: the tokens the target committed (with, for a head, the target's
hidden rows of their positions) and whatever it drafted past them. Calls for one sequence arrive in
order: :meth:`~Drafter.commit` (first the prompt, later the tokens committed since), ``draft``,
:meth:`~Drafter.verified` (a verdict: what the target accepted and emitted), ``commit``, ``draft``, ...,
:meth:`~Drafter.release`.

A :class:`Branch` is one question: after the committed tokens followed by ``extra`` (tokens the
target has not committed yet), what comes next? Both seams ask it, through :meth:`Drafter.draft`:

- the synchronous seam (:meth:`Drafter.propose`): one branch per sequence, answered per round,
  ``extra`` empty, in the shape the request asks (a chain or a tree), a chain drawn as the request
  samples (with the distributions it was drawn from, for the target's rejection test);
- the pipelined seam (:class:`.stager.Stager`): several greedy chains per sequence, each assuming an
  outcome of the proposal in flight, with the draft's next likeliest tokens at each depth.

Drafting ahead is asking early, and only that: a branch longer than the round needs (the synchronous
seam's rolling tail, ``2γ + 1`` tokens, which a drafter that ``drafts_ahead`` keeps past the committed
tokens for the next round) or for an outcome not known yet (staging).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ..speculation.payloads import DraftInput, DraftOutput, SamplingSpec, SparseDist, VerifyResult
from .tree_search import tree_shape

__all__ = ["Branch", "Capabilities", "Draft", "DraftInput", "DraftOutput", "Drafter", "Ready", "SamplingSpec",
           "SparseDist", "VerifyResult", "grow_blocks", "sample_draft", "sequence_for"]


@dataclass(frozen=True)
class Capabilities:
    """What a drafter is and can do, declared once when it is built; the service reads it, never probes."""

    method: str
    hidden_layers: tuple[int, ...] = ()  # target layers whose hidden rows it reads (empty: none)
    hidden_dtype: str = ""  # the wire dtype it wants hidden rows in ('': the target's choice)
    vocab_size: int = 0  # the vocabulary its drafts come from, when it knows it (0: unknown)
    # Drafts in pure Python in microseconds (n-gram, suffix): the service calls it on its event loop,
    # where a hop to a worker thread and back would cost more than the call
    on_loop: bool = False
    stages: bool = False  # drafts greedy chains past assumed tokens, many per sequence (the pipelined seam)
    drafts_ahead: bool = False  # keeps a chain drafted past what a round asked for, so drafting ahead pays
    distillable: bool = False  # an EAGLE-3 head online distillation can train (:meth:`Drafter.load_weights`)

    def __post_init__(self) -> None:
        if not self.method:
            raise ValueError("a drafter needs a method name")
        if self.vocab_size < 0:
            raise ValueError(f"vocab_size must be >= 0, got {self.vocab_size}")
        object.__setattr__(self, "hidden_layers", tuple(self.hidden_layers))


@dataclass(frozen=True)
class Branch:
    """Draft ``num_tokens`` tokens (a tree: nodes) after a sequence's committed tokens followed by
    ``extra``: a chain with up to ``alternatives`` other likely tokens per depth, or, with ``tree``
    (top-k, depth), a token tree; ``sampled``: a chain drawn as the sequence's request samples (else
    greedy)."""

    seq_id: str
    extra: tuple[int, ...] = ()
    num_tokens: int = 0
    alternatives: int = 0
    tree: tuple[int, int] | None = None
    sampled: bool = False


@dataclass(frozen=True)
class Draft:
    """What a branch drafted: ``tokens`` (a tree: with ``parents``, ROOT or an earlier index each), per
    depth of a chain the ``alternatives`` to each (best first), per token ``confidence`` (P(it and those
    before are right); [] none) and, for a sampled chain, the distribution each was drawn from ([]:
    greedy)."""

    tokens: list[int]
    alternatives: list[list[int]] = field(default_factory=list)
    confidence: list[float] = field(default_factory=list)
    parents: list[int] = field(default_factory=list)
    dists: list[SparseDist] = field(default_factory=list)


Ready = Callable[[list[Draft]], None]  # the drafts so far, in the branches' order (see Drafter.draft)


class Drafter:
    """A draft method (n-gram, suffix, draft model, EAGLE/EAGLE-3, Medusa, MLP speculator, oracle).

    Every method subclasses this, sets :attr:`caps` and implements the four calls; the synchronous seam
    (:meth:`propose`) is built on them here, once."""

    caps: Capabilities
    device: torch.device = torch.device("cpu")  # where its tensors live
    tree_topk: int = 1  # tree shape for requests that do not ask for one (1: chains)
    tree_depth: int = 0  # 0: as deep as the node budget allows

    def commit(self, seq_id: str, tokens: Sequence[int], hidden_states: Sequence[torch.Tensor] = (),
               sampling: SamplingSpec = SamplingSpec()) -> None:
        """The target committed ``tokens`` after the ones already heard of (the first call: the prompt),
        for a request that samples as ``sampling``. ``hidden_states``: per layer of
        ``caps.hidden_layers``, [len(tokens), H] (the first call: one row fewer), the target's hidden
        state at the position before each token (see :class:`workers.speculation.payloads.DraftInput`)."""
        raise NotImplementedError

    def verified(self, results: list[VerifyResult]) -> None:
        """Commit what the target accepted and emitted (with hidden rows [len(emitted), H] per layer,
        where it reads them); drop what it drafted that the target did not emit."""
        raise NotImplementedError

    def release(self, seq_ids: list[str]) -> None:
        """Forget sequences that finished."""
        raise NotImplementedError

    def draft(self, branches: list[Branch], ready: Ready | None = None) -> list[Draft]:
        """One draft per branch, drafted together (a model: one batched pass per depth). A drafter that
        pays per depth may call ``ready`` once, with the chains so far, as soon as each holds all its
        tokens but the last (a guess of what follows, which the stager does not stream)."""
        raise NotImplementedError

    def load_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Take new weights between drafting calls (only where ``caps.distillable``)."""
        raise ValueError(f"draft method {self.caps.method!r} takes no new weights")

    def branch(self, item: DraftInput) -> Branch:
        """The one branch the synchronous seam asks for ``item``: a tree when the request (or this
        drafter's default) asks for one, else a chain of ``item.chain_budget`` drawn as it samples."""
        shape = tree_shape(item, self.tree_topk, self.tree_depth)
        if shape is not None:
            return Branch(item.seq_id, (), item.num_speculative_tokens, tree=shape)
        return Branch(item.seq_id, (), max(0, item.chain_budget), sampled=True)

    def propose(self, batch: list[DraftInput]) -> list[DraftOutput]:
        """The synchronous seam: each request's news committed, then one branch per sequence drafted in
        one call; one proposal per input, same order."""
        for item in batch:
            self.commit(item.seq_id, item.new_tokens, item.hidden_states, item.sampling)
        drafts = self.draft([self.branch(item) for item in batch])
        return [DraftOutput(item.seq_id, item.round, d.tokens, d.dists, d.parents, confidence=d.confidence)
                for item, d in zip(batch, drafts)]


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


def sequence_for(seqs: dict, seq_id: str, sampling: SamplingSpec, make, device: torch.device | str = "cpu"):
    """A drafter's state for ``seq_id``: ``make()`` on first sight (with a generator on ``device``, where
    the draft's draws are made, seeded from the request's seed, if any, in its ``generator``), its
    ``sampling`` refreshed."""
    seq = seqs.get(seq_id)
    if seq is None:
        seq = seqs[seq_id] = make()
        if sampling.seed is not None:
            seq.generator = torch.Generator(device=device).manual_seed(sampling.seed)
    seq.sampling = sampling
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
