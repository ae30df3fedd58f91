"""The engine with speculative verification: ONE forward pass over γ+1 positions per sequence.

Between steps the worker asks :meth:`SpecEngine.draft_inputs` what to draft, gets proposals from a
draft worker, and passes them to :meth:`SpecEngine.step`. For every decoding sequence with a
proposal x_1..x_k the step computes the last committed token and the k drafts in the same forward
pass as everything else in the batch, turns the k+1 logits rows into the request's sampling
distributions, and applies :func:`workers.speculation.rejection.rejection_sample`. Accepted drafts plus one
recovered or bonus token are committed (stop tokens and max_tokens still apply token by token);
the KV of rejected positions is rolled back by truncating the block table to the committed length.
Verdicts (and target hidden states for methods that need them) wait in :meth:`take_verdicts`.
Sequences without a proposal decode exactly as in :class:`Engine`, so no request depends on a
draft worker.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import msgspec
import torch

from runtime.messages import SamplingParams, SpecUsage, TokenDelta, TopLogprob
from runtime.spec_stats import SpecCounters

from ..engine.engine import Engine, EngineConfig
from ..engine.model import DecoderModel
from ..engine.sampling import apply_top_k_top_p, is_greedy, logprobs_of
from ..engine.sequence import Sequence
from ..speculation.payloads import PAD, DraftInput, DraftOutput, SamplingSpec, VerifyResult
from ..speculation.rejection import rejection_sample, sparse_to_dense

log = logging.getLogger(__name__)


@dataclass
class _SpecState:
    gamma: int
    told: int = 0  # tokens of the sequence the draft worker knows
    round: int = 0
    usage: SpecUsage = SpecUsage()
    hidden: list[list[torch.Tensor]] = field(default_factory=list)  # per layer: rows for positions hidden_base..
    hidden_base: int = 0
    cap: int = 0  # adaptive γ for the next round (≤ gamma); 0: paused
    pause: int = 0  # plain steps left before drafting is tried again


class SpecEngine(Engine):
    """:class:`Engine` plus draft verification; plain values in."""

    def __init__(self, model: DecoderModel, config: EngineConfig = EngineConfig(), worker_id: str = "",
                 eos_token_ids: tuple[int, ...] | None = None, *, num_speculative_tokens: int = 4,
                 hidden_layers: tuple[int, ...] = (), adaptive: bool = True, pause_steps: int = 8):
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        self.num_speculative_tokens = num_speculative_tokens
        self._hidden_layers = tuple(hidden_layers)
        super().__init__(model, config, worker_id, eos_token_ids)
        self.hidden_layers = self._hidden_layers
        # Adaptive γ per sequence: +2 after a fully accepted round, −1 otherwise; at 0 the sequence
        # decodes plainly for ``pause_steps`` steps and then tries one draft token again. A draft
        # that keeps missing then costs little; one that hits climbs back to γ within a few rounds.
        self.adaptive = adaptive
        self.pause_steps = pause_steps
        self._spec: dict[str, _SpecState] = {}
        self._verdicts: list[VerifyResult] = []
        self._released: list[str] = []
        self.draft_id = ""  # the draft worker proposing now (set by the worker)
        self.counters: dict[str, SpecCounters] = {}  # per draft worker

    @property
    def hidden_layers(self) -> tuple[int, ...]:
        """Target layers whose hidden states the draft worker reads (EAGLE); empty: none."""
        return self._hidden_layers

    @hidden_layers.setter
    def hidden_layers(self, layers) -> None:
        self._hidden_layers = tuple(layers)
        # a draft reading hidden states needs them for every position: no prefix-cache hits then
        self.scheduler.reuse_cached_prefix = not self._hidden_layers

    def _graph_query_lens(self) -> tuple[int, ...]:
        return (1, self.num_speculative_tokens + 1)  # decode; verify of up to γ drafts (fewer are padded)

    def _graph_hidden_layers(self) -> tuple[int, ...]:
        return self._hidden_layers

    # ------------------------------------------------------------------ requests

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    output_ids: list[int] = (), num_speculative_tokens: int | None = None) -> None:
        super().add_request(request_id, token_ids, params, output_ids)
        if request_id in self.seqs:
            gamma = max(0, self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens)
            self._spec[request_id] = _SpecState(gamma, cap=gamma)

    def abort(self, request_id: str) -> bool:
        self._forget(request_id)
        return super().abort(request_id)

    def _forget(self, request_id: str) -> None:
        st = self._spec.pop(request_id, None)
        if st is not None and st.told:
            self._released.append(request_id)

    def reset_drafts(self) -> None:
        """A new draft worker knows none of our sequences: start every one from scratch."""
        for st in self._spec.values():
            st.told = 0

    def take_verdicts(self) -> list[VerifyResult]:
        out, self._verdicts = self._verdicts, []
        return out

    def take_released(self) -> list[str]:
        out, self._released = self._released, []
        return out

    def draft_inputs(self) -> list[DraftInput]:
        """Proposal requests for every running sequence that decodes next and speculates."""
        out = []
        for seq in self.scheduler.running:
            st = self._spec.get(seq.request_id)
            if st is None or st.gamma <= 0 or seq.num_uncomputed != 1:
                continue
            if st.cap == 0:
                if st.pause > 0:
                    st.pause -= 1
                    continue
                st.cap = 1
            k = min(st.cap, seq.params.max_tokens - seq.num_generated - 1, self.max_model_len - len(seq) - 1)
            if k <= 0:
                continue
            p = seq.params
            hidden = self._hidden_rows(st, max(st.told - 1, 0), len(seq) - 1) if self.hidden_layers else []
            out.append(DraftInput(seq.request_id, st.round, seq.token_ids[st.told :], k,
                                  SamplingSpec(p.temperature, p.top_p, p.top_k, p.seed), hidden))
            st.told = len(seq)
            st.round += 1
        return out

    # ------------------------------------------------------------------ stepping

    def step(self, proposals: dict[str, DraftOutput] | None = None) -> list[tuple[str, TokenDelta]]:
        outputs, self._immediate = self._immediate, []
        drafted = self._attach(proposals or {})
        batch = self.scheduler.schedule()
        scheduled = {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens)}
        for rid in list(drafted):
            seq, drafts, dists = drafted[rid]
            n = scheduled.get(rid, 0)
            if n < len(drafts) + 1:  # preempted, or only partly scheduled: keep what fits
                keep = max(0, n - 1)
                del seq.token_ids[len(seq) - len(drafts) + keep :]
                if keep:
                    drafted[rid] = (seq, drafts[:keep], dists[:keep])
                else:
                    del drafted[rid]
        if not batch:
            return outputs
        bs = self.config.block_size
        starts = [s.num_computed for s in batch.seqs]
        wants = []
        for s, n in zip(batch.seqs, batch.num_tokens):
            if s.request_id in drafted:
                wants.append(len(drafted[s.request_id][1]) + 1)
            else:
                wants.append(1 if s.num_computed + n == len(s) else 0)
        chunks = [(s.token_ids[s.num_computed : s.num_computed + n], s.num_computed, s.block_table)
                  for s, n in zip(batch.seqs, batch.num_tokens)]
        out = self.runner.forward(chunks, wants, self.hidden_layers)
        plain, plain_rows, verify, verify_rows = [], [], [], []
        row = 0
        for seq, n, want in zip(batch.seqs, batch.num_tokens, wants):
            seq.num_computed += n
            if seq.request_id in drafted:
                verify.append(seq)
                verify_rows.append(list(range(row, row + want)))
            else:
                self._register_blocks(seq, bs)
                if want:
                    plain.append(seq)
                    plain_rows.append(row)
            row += want
        if self.hidden_layers:
            self._keep_hidden(batch.seqs, starts, batch.num_tokens, out.hidden)
        if plain:
            finished_plain = self._sample(plain, out.logits[plain_rows])
            outputs.extend(self._with_spec_usage(finished_plain))
        if verify:
            outputs.extend(self._verify(verify, [drafted[s.request_id] for s in verify], out.logits, verify_rows))
        return outputs

    def _attach(self, proposals: dict[str, DraftOutput]) -> dict[str, tuple[Sequence, list[int], list]]:
        drafted = {}
        for seq in self.scheduler.running:
            prop = proposals.get(seq.request_id)
            st = self._spec.get(seq.request_id)
            if prop is None or st is None or not prop.token_ids or seq.num_uncomputed != 1:
                continue
            k = min(len(prop.token_ids), max(st.cap, 1), seq.params.max_tokens - seq.num_generated - 1,
                    self.max_model_len - len(seq) - 1)
            tokens = [t for t in prop.token_ids[:k] if 0 <= t < self.vocab_size]
            if len(tokens) < k:  # a draft with out-of-vocabulary ids is ignored, not trusted
                continue
            if k > 0:
                seq.token_ids.extend(tokens)
                drafted[seq.request_id] = (seq, tokens, prop.distributions[:k])
        return drafted

    def _with_spec_usage(self, outputs: list[tuple[str, TokenDelta]]) -> list[tuple[str, TokenDelta]]:
        result = []
        for rid, delta in outputs:
            if delta.finish_reason:
                st = self._spec.get(rid)
                if st is not None and st.usage.num_drafts > 0 and delta.usage is not None:
                    delta = msgspec.structs.replace(delta, usage=msgspec.structs.replace(delta.usage, spec=st.usage))
                self._forget(rid)
            result.append((rid, delta))
        return result

    def _target_probs(self, seq: Sequence, logits: torch.Tensor) -> torch.Tensor:
        """The request's sampling distribution at each verified position. logits [k+1, V] -> [k+1, V]."""
        p = seq.params
        logits = logits.clone()
        for i in range(logits.shape[0]):  # stop tokens are banned until min_tokens
            if seq.num_generated + i < p.min_tokens and seq.stop_ids:
                logits[i, sorted(seq.stop_ids)] = float("-inf")
        if is_greedy(p.temperature):
            return logits.softmax(-1)
        scaled = logits / p.temperature
        if p.top_k > 0 or p.top_p < 1:
            rows = logits.shape[0]
            scaled = apply_top_k_top_p(scaled, torch.full((rows,), p.top_k, dtype=torch.long, device=logits.device),
                                       torch.full((rows,), p.top_p, device=logits.device))
        return scaled.softmax(-1)

    def _verify(self, seqs: list[Sequence], drafted: list[tuple], logits: torch.Tensor,
                rows: list[list[int]]) -> list[tuple[str, TokenDelta]]:
        batch, gamma, vocab = len(seqs), max(len(d[1]) for d in drafted), logits.shape[-1]
        dev = logits.device
        target = torch.zeros(batch, gamma + 1, vocab, device=dev)
        draft_probs = torch.zeros(batch, gamma, vocab, device=dev)
        tokens = torch.full((batch, gamma), PAD, dtype=torch.long, device=dev)
        num_draft = torch.zeros(batch, dtype=torch.long, device=dev)
        greedy = torch.zeros(batch, dtype=torch.bool, device=dev)
        uniforms = torch.empty(batch, gamma, device=dev)
        exps = torch.empty(batch, vocab, device=dev)
        for b, (seq, (_, drafts, dists), r) in enumerate(zip(seqs, drafted, rows)):
            k = len(drafts)
            target[b, : k + 1] = self._target_probs(seq, logits[r])
            tokens[b, :k] = torch.tensor(drafts, device=dev)
            num_draft[b] = k
            greedy[b] = is_greedy(seq.params.temperature)
            if dists and not greedy[b]:
                ids = [d.ids for d in dists]
                width = max(len(i) for i in ids)
                ids_t = torch.tensor([i + [PAD] * (width - len(i)) for i in ids])
                probs_t = torch.tensor([d.probs + [0.0] * (width - len(d.probs)) for d in dists])
                ids_t = torch.where(ids_t < vocab, ids_t, PAD)  # out-of-vocabulary ids carry no mass here
                draft_probs[b, :k] = sparse_to_dense(ids_t.to(dev), probs_t.to(dev), vocab)
            else:  # greedy draft: one-hot on its token
                draft_probs[b, torch.arange(k, device=dev), tokens[b, :k]] = 1.0
            uniforms[b].uniform_(generator=seq.generator)
            exps[b].exponential_(generator=seq.generator)
        sampler = rejection_sample
        if dev.type == "cuda":  # the fused kernel; on CPU the torch function is the reference
            from ..speculation.triton_rejection import rejection_sample_triton as sampler
        out_tokens, accepted = sampler(target, tokens, draft_probs, num_draft, greedy, uniforms, exps)
        out_tokens, accepted = out_tokens.cpu(), accepted.cpu()
        return [self._commit(seq, d[1], out_tokens[b], int(accepted[b]), logits[rows[b]])
                for b, (seq, d) in enumerate(zip(seqs, drafted))]

    def _commit(self, seq: Sequence, drafts: list[int], out: torch.Tensor, accepted: int,
                logits: torch.Tensor) -> tuple[str, TokenDelta]:
        k = len(drafts)
        base = len(seq) - k  # committed length before this round
        del seq.token_ids[base:]
        emitted = out[: accepted + 1].tolist()
        finish, kept = None, []
        for token in emitted:
            kept.append(token)
            seq.token_ids.append(token)
            seq.num_generated += 1
            finish = self._finish_reason(seq, token)
            if finish:
                break
        seq.num_computed = min(base + accepted, len(seq))
        self.runner.copy_blocks(self.blocks.truncate(seq.block_table, seq.num_computed))
        self._register_blocks(seq, self.config.block_size)
        st = self._spec[seq.request_id]
        u = st.usage
        st.usage = msgspec.structs.replace(u, num_drafts=u.num_drafts + 1, num_draft_tokens=u.num_draft_tokens + k,
                                           num_accepted_tokens=u.num_accepted_tokens + accepted)
        self.counters.setdefault(self.draft_id, SpecCounters()).observe_draft(k, accepted)
        if self.adaptive:
            st.cap = min(st.gamma, st.cap + 2) if accepted == k else max(0, st.cap - 1)
            if st.cap == 0:
                st.pause = self.pause_steps
        logprobs = top = None
        if seq.params.logprobs is not None:
            chosen, top_ids, top_vals = logprobs_of(logits[: len(kept)], torch.tensor(kept, device=logits.device),
                                                    seq.params.logprobs)
            logprobs = chosen.tolist()
            if seq.params.logprobs:
                top = [[TopLogprob(t, v) for t, v in zip(i, v)] for i, v in zip(top_ids.tolist(), top_vals.tolist())]
        usage = None
        if finish:
            usage = self._close(seq, st.usage)
            self._forget(seq.request_id)
        else:
            hidden = self._hidden_rows(st, base - 1, base - 1 + len(kept)) if self.hidden_layers else []
            self._verdicts.append(VerifyResult(seq.request_id, st.round - 1, accepted, kept, hidden))
            st.told = len(seq)
        return seq.request_id, TokenDelta(kept, logprobs, top, finish, usage)

    # ------------------------------------------------------------------ hidden states (EAGLE)

    def _keep_hidden(self, seqs, starts, counts, hidden: dict[int, torch.Tensor]) -> None:
        offset = 0
        for seq, start, n in zip(seqs, starts, counts):
            st = self._spec.get(seq.request_id)
            if st is not None:
                if not st.hidden:
                    st.hidden = [[] for _ in self.hidden_layers]
                have = st.hidden_base + len(st.hidden[0])
                if start < have:  # recompute or rollback: positions from ``start`` are rewritten
                    for rows in st.hidden:
                        del rows[max(0, start - st.hidden_base):]
                    have = st.hidden_base + len(st.hidden[0])
                for layer_rows, layer in zip(st.hidden, self.hidden_layers):
                    layer_rows.extend(hidden[layer][offset + (have - start) : offset + n].unbind(0))
            offset += n

    def _hidden_rows(self, st: _SpecState, start: int, stop: int) -> list[torch.Tensor]:
        """Per layer, rows for positions [start, stop) as [stop - start, hidden]; drops older rows."""
        out = []
        for rows in st.hidden:
            picked = rows[start - st.hidden_base : stop - st.hidden_base]
            out.append(torch.stack(picked) if picked else torch.zeros(0))
        if st.hidden and start > st.hidden_base:
            for rows in st.hidden:
                del rows[: start - st.hidden_base]
            st.hidden_base = start
        return out
