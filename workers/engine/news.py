"""What a draft worker hears from the engine: proposal requests, verdicts and releases.

Each carries the hidden rows of the target layers the draft reads (EAGLE, Medusa, MLP heads), read
from the :class:`.hidden.HiddenStore` in one gather per batch: copied to the host in the dtype asked,
or written to a data plane as one block and referred to by a :class:`HiddenRef`. A request tells the
draft every token it has not heard of yet (``SpecState.told``), so a draft keeps its own copy of each
sequence in step with the target's.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..speculation.payloads import DraftInput, HiddenRef, SamplingSpec, VerifyResult
from .hidden import HiddenStore
from .sequence import Sequence
from .speculator import SpecState, Speculator


@dataclass(frozen=True, slots=True)
class Verdict:
    """One verified round of a sequence that goes on: ``accepted`` draft tokens of round ``round``
    and the ``emitted`` tokens; its hidden rows are those of positions ``first_row`` onwards, one per
    emitted token (the root's row, then the accepted nodes')."""

    seq: Sequence
    round: int
    accepted: int
    emitted: list[int]
    first_row: int


Span = tuple[int, int]  # positions [start, stop) of one sequence
# What a draft stream takes hidden rows as: the layers it reads (None: all offered), the host dtype,
# and the data plane they are written to (None: inline)
Carry = tuple[tuple[int, ...] | None, torch.dtype | None, object]


class DraftNews:
    """The engine's messages to its draft worker, and the hidden rows they carry; plain values in."""

    def __init__(self, spec: Speculator, hidden: HiddenStore | None, hidden_layers: tuple[int, ...],
                 block_size: int, device: torch.device):
        self.spec = spec
        self.hidden = hidden
        # as given: a draft reads its layers in its own order, repeats included (EAGLE-3 on a 4-layer
        # target reads [2, 2, 1]); requests and verdicts default to this list
        self.hidden_layers = hidden_layers
        self.block_size = block_size
        self.device = device
        self.verdicts: list[Verdict] = []  # waiting for take_verdicts

    def add(self, verdict: Verdict) -> None:
        """A verified round of a sequence that goes on: the draft hears it with :meth:`take_verdicts`."""
        self.verdicts.append(verdict)

    def reset(self) -> None:
        """A new draft worker knows none of our sequences: start every one from scratch."""
        self.spec.reset()
        self.verdicts.clear()

    def inputs(self, running: list[Sequence], max_model_len: int, layers: tuple[int, ...] | None,
               dtype: torch.dtype | None, plane=None) -> list[DraftInput]:
        """Proposal requests for the ``running`` sequences that decode next and speculate this round
        (:meth:`.speculator.Speculator.requests`), with their hidden rows (see :meth:`take_verdicts`)."""
        requests = self.spec.requests(running, max_model_len)
        if not requests:  # the plan drafts nothing (the usual step when drafting does not pay)
            return []
        return self._inputs(requests, self.hidden_layers if layers is None else tuple(layers), dtype, plane)

    def news(self, running: list[Sequence], max_model_len: int, layers: tuple[int, ...] | None,
             dtype: torch.dtype | None, plane, ask: bool, why: str) -> tuple[list, list[str], list[DraftInput]]:
        """One draft stream's news: the verdicts (:meth:`take_verdicts`) and released sequences since
        the last call, and when ``ask`` this round's requests (:meth:`inputs`); else the sequences that
        decode next do so plainly for ``why``. A round with none of them touches nothing else."""
        verdicts = self.take_verdicts(layers, dtype, plane) if self.verdicts else []
        released = self.take_released() if self.spec.released else []
        if not ask:
            self.spec.unasked(running, why)
            return verdicts, released, []
        return verdicts, released, self.inputs(running, max_model_len, layers, dtype, plane)

    def inputs_by(self, running: list[Sequence], max_model_len: int, groups: dict[str, Carry] | None,
                  carry: Carry = (None, None, None)) -> dict[str | None, list[DraftInput]]:
        """:meth:`inputs` per draft worker (``groups``: each one's :data:`Carry`; a sequence placed on
        none is not asked); ``groups`` None: every request in one list (key None), carried as ``carry``."""
        requests = self.spec.requests(running, max_model_len)
        if not requests:
            return {}
        return {key: self._inputs(part, layers, dtype, plane)
                for key, (layers, dtype, plane), part in self._split(requests, lambda r: r.state, groups, carry)}

    def _inputs(self, requests: list, layers: tuple[int, ...], dtype: torch.dtype | None, plane) -> list[DraftInput]:
        seqs = [r.seq for r in requests]
        # per request: positions whose hidden rows it carries (those before its new tokens)
        spans = [(max(r.state.told - 1, 0), len(r.seq) - 1) if layers else (0, 0) for r in requests]
        hidden, refs = self._carried(seqs, spans, layers, dtype, plane)
        return [tell(r.seq, r.state, r.num_speculative_tokens, hidden_states=rows, tree_topk=r.state.tree_topk,
                     tree_depth=r.state.tree_depth, max_depth=r.max_depth, hidden_ref=ref)
                for r, rows, ref in zip(requests, hidden, refs)]

    def _split(self, items: list, state_of, groups: dict[str, Carry] | None, carry: Carry):
        """(key, carry with its layers resolved, items) per group: by each item's draft worker, or all as one."""
        if groups is None:
            parts = {None: (carry, items)}
        else:
            parts = {}
            for item in items:
                key = self.spec.draft_of(state_of(item))
                if key in groups:
                    parts.setdefault(key, (groups[key], []))[1].append(item)
        for key, ((layers, dtype, plane), part) in parts.items():
            yield key, (self.hidden_layers if layers is None else tuple(layers), dtype, plane), part

    def prompt_inputs(self, added: list[Sequence], seqs: dict[str, Sequence], max_model_len: int) -> list[DraftInput]:
        """Pipelined seam, a draft that needs no hidden states: proposal requests for sequences just
        added, carrying their prompts, before their prefill runs. The draft answers with a proposal
        that begins with its guess of the prefill's token; when that guess comes true, the first
        decode step verifies the rest instead of decoding plainly (a request's first round is
        otherwise asked only once its prefill has committed that token)."""
        out = []
        for seq in added:
            st = self.spec.states.get(seq.request_id)
            if (st is None or st.told or st.adapted <= 0 or st.tree_topk > 1 or seq.prefill_only
                    or seq.num_computed or seqs.get(seq.request_id) is not seq):
                continue
            # what the first decode step may verify: none deeper than can still be emitted after the
            # prefill's token and the step's own
            k = min(st.adapted, seq.params.max_tokens - seq.num_generated - 2, max_model_len - len(seq) - 2)
            if k > 0:
                out.append(tell(seq, st, k))  # (told nothing yet: the whole prompt)
        return out

    def take_verdicts(self, layers: tuple[int, ...] | None, dtype: torch.dtype | None,
                      plane=None) -> list[VerifyResult]:
        """The verdicts since the last call, of sequences still running, with the hidden states of
        ``layers`` (None: all offered) on the host in ``dtype``, or, given a data ``plane``
        (:class:`workers.speculation.hidden_plane.PlaneWriter`), written to it as one block and
        referred to by ``hidden_ref``."""
        if not self.verdicts:  # every step that verified nothing
            return []
        return self.take_verdicts_by(None, (layers, dtype, plane)).get(None, [])

    def take_verdicts_by(self, groups: dict[str, Carry] | None,
                         carry: Carry = (None, None, None)) -> dict[str | None, list[VerifyResult]]:
        """:meth:`take_verdicts` per draft worker (see :meth:`inputs_by`); a verdict on a sequence of a
        draft worker in no group is dropped (its stream ended: the sequence is told afresh elsewhere)."""
        verdicts, self.verdicts = self.verdicts, []
        if not verdicts:  # every step that verified nothing
            return {}
        states = self.spec.states
        verdicts = [v for v in verdicts if v.seq.request_id in states]  # finished since: released
        out = {}
        for key, (layers, dtype, plane), part in self._split(verdicts, lambda v: states[v.seq.request_id],
                                                             groups, carry):
            spans = [(v.first_row, v.first_row + len(v.emitted)) if layers else (0, 0) for v in part]
            hidden, refs = self._carried([v.seq for v in part], spans, layers, dtype, plane)
            out[key] = [VerifyResult(v.seq.request_id, v.round, v.accepted, v.emitted, rows, ref)
                        for v, rows, ref in zip(part, hidden, refs)]
        return out

    def take_released(self) -> list[str]:
        """Sequences the draft worker knew that ended since the last call: it may forget them."""
        out, self.spec.released = self.spec.released, []
        self.spec.released_from.clear()
        return out

    def take_released_by(self) -> dict[str, list[str]]:
        """Sequences the draft workers knew that ended (or moved) since the last call, per draft worker."""
        spec, out = self.spec, {}
        for rid in spec.released:
            out.setdefault(spec.released_from.pop(rid, spec.draft_id), []).append(rid)
        spec.released = []
        return out

    def _carried(self, seqs: list[Sequence], spans: list[Span], layers: tuple[int, ...],
                 dtype: torch.dtype | None, plane) -> tuple[list[list[torch.Tensor]], list[HiddenRef | None]]:
        """Per sequence: (its rows on the host, [] on a plane) and (its plane reference, or None)."""
        if plane is not None:
            return [[] for _ in seqs], self.block(seqs, spans, plane)
        return self.rows(seqs, spans, layers, dtype), [None] * len(seqs)

    def rows(self, seqs: list[Sequence], spans: list[Span], layers: tuple[int, ...],
             dtype: torch.dtype | None) -> list[list[torch.Tensor]]:
        """Per sequence, per layer, hidden rows [stop - start, hidden] for positions [start, stop), read
        from the store in one gather per layer."""
        if not layers or self.hidden is None or not seqs:
            return [[] for _ in seqs]
        rows = self.hidden.read(self._slots(seqs, spans), layers, dtype)
        out, at = [], 0
        for start, stop in spans:
            out.append([layer_rows[at : at + stop - start] for layer_rows in rows])
            at += stop - start
        return out

    def block(self, seqs: list[Sequence], spans: list[Span], plane) -> list[HiddenRef | None]:
        """Every sequence's rows for positions [start, stop) written to ``plane`` as one block (one
        gather for the batch); per sequence, its :class:`HiddenRef` into the block."""
        if self.hidden is None or not seqs:
            return [None for _ in seqs]
        slots = self._slots(seqs, spans)
        offset, streamed = plane.write(slots.shape[0], lambda rows: self.hidden.gather(slots, plane.layers, rows))
        refs, at = [], offset
        for start, stop in spans:
            refs.append(HiddenRef(at, stop - start, streamed))
            at += stop - start
        return refs

    def _slots(self, seqs: list[Sequence], spans: list[Span]) -> torch.Tensor:
        """The cache slots of positions [start, stop) of each sequence, concatenated: [sum of spans] long."""
        bs = self.block_size
        slots: list[int] = []
        for seq, (start, stop) in zip(seqs, spans):  # a range per block, not a Python step per position
            for b in range(start // bs, -(-stop // bs)):
                base = seq.block_table[b] * bs
                slots.extend(range(base + max(start - b * bs, 0), base + min(stop - b * bs, bs)))
        return torch.tensor(slots, dtype=torch.long, device=self.device)


def tell(seq: Sequence, st: SpecState, num_speculative_tokens: int, **extra) -> DraftInput:
    """A proposal request for ``seq`` carrying its tokens the draft has not heard of, for the next
    round; the draft has heard of them all from now on."""
    p = seq.params
    request = DraftInput(seq.request_id, st.round, seq.token_ids[st.told :], num_speculative_tokens,
                         SamplingSpec(p.temperature, p.top_p, p.top_k, p.seed), **extra)
    st.told = len(seq)
    st.round += 1
    return request
