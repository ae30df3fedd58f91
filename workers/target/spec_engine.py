"""The engine with speculative verification: ONE forward pass over γ+1 positions per sequence.

Between steps the worker asks :meth:`SpecEngine.draft_inputs` what to draft, gets proposals from a
draft worker, and passes them to :meth:`SpecEngine.step`. For every decoding sequence with a
proposal x_1..x_k the step computes the last committed token and the k drafts in the same forward
pass as everything else in the batch, turns the k+1 logits rows into the request's sampling
distributions, and applies :func:`workers.speculation.rejection.rejection_sample`. Accepted drafts plus one
recovered or bonus token are committed (stop tokens and max_tokens still apply token by token);
the KV of rejected positions is rolled back by truncating the block table to the committed length.
A proposal may be a token tree (:mod:`workers.speculation.tree`): its nodes are verified in the same
single pass under a tree attention mask, the longest valid path is accepted
(:func:`workers.speculation.tree_rejection.tree_rejection_sample`), and that path's KV is copied into
consecutive slots before the rest is rolled back.
Verdicts (and target hidden states for methods that need them) wait in :meth:`take_verdicts`.
Sequences without a proposal decode exactly as in :class:`Engine`, so no request depends on a
draft worker.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import msgspec
import torch

from runtime.messages import SamplingParams, SpecUsage, TokenDelta, TopLogprob
from runtime.spec_stats import SpecCounters

from ..engine.engine import Engine, EngineConfig
from ..engine.grammar import Grammar, GrammarBackend
from ..engine.model import DecoderModel
from ..engine.sampling import apply_token_bitmask, apply_top_k_top_p, is_greedy, logprobs_of
from ..engine.sequence import Sequence
from ..speculation.payloads import PAD, DraftInput, DraftOutput, SamplingSpec, VerifyResult
from ..speculation.rejection import rejection_sample, sparse_to_dense
from ..speculation.tree import chain_parents, parent_nodes, tree_depths, valid_parents
from ..speculation.tree_rejection import tree_rejection_sample
from .budget import Acceptance, RealizedRates, StepCost, plan
from .drafted import Drafted

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
    tree_topk: int = 0  # tree shape asked of the draft (0: the engine's setting)
    tree_depth: int = 0
    acceptance: Acceptance = field(default_factory=Acceptance)  # per-token acceptance, for load-aware budgets
    pause: int = 0  # plain steps left before drafting is tried again


class SpecEngine(Engine):
    """:class:`Engine` plus draft verification; plain values in."""

    def __init__(self, model: DecoderModel, config: EngineConfig = EngineConfig(), worker_id: str = "",
                 eos_token_ids: tuple[int, ...] | None = None, *, num_speculative_tokens: int = 4,
                 hidden_layers: tuple[int, ...] = (), adaptive: bool = True, pause_steps: int = 8,
                 tree_topk: int = 0, tree_depth: int = 0, load_aware: bool = False,
                 grammars: GrammarBackend | None = None):
        if num_speculative_tokens < 0:
            raise ValueError(f"num_speculative_tokens must be >= 0, got {num_speculative_tokens}")
        if tree_topk < 0 or tree_depth < 0:
            raise ValueError(f"tree_topk and tree_depth must be >= 0, got {tree_topk} and {tree_depth}")
        self.num_speculative_tokens = num_speculative_tokens  # chain length, or a tree's node budget
        # Tree shape asked of the draft (0: the draft worker's own setting); top-k 1 is a chain.
        self.tree_topk = tree_topk
        self.tree_depth = tree_depth
        self._hidden_layers = tuple(hidden_layers)
        super().__init__(model, config, worker_id, eos_token_ids, grammars)
        self.hidden_layers = self._hidden_layers
        # Adaptive γ per sequence: +2 after a fully accepted round, −1 otherwise; at 0 the sequence
        # decodes plainly for ``pause_steps`` steps and then tries one draft token again. A draft
        # that keeps missing then costs little; one that hits climbs back to γ within a few rounds.
        # A tree's node budget halves after a pass that accepts nothing and doubles after any hit.
        self.adaptive = adaptive
        self.pause_steps = pause_steps
        # Load-aware budgets (workers/target/budget.py): each step's γ per sequence, within its cap,
        # from a cost model of this engine's own steps and each sequence's acceptance.
        self.load_aware = load_aware
        self.cost = StepCost()
        self.realized = RealizedRates()  # the check on the cost model: tokens/s achieved, per batch size
        self.time_steps = True  # the cost model times step(); a serving loop times whole cycles instead
        self.planned_draft_tokens = 0  # draft tokens asked for in the latest step (a gauge)
        self.unplanned_steps = 0  # steps the load-aware plan chose not to speculate although it could
        self._spec: dict[str, _SpecState] = {}
        self._verdicts: list[VerifyResult] = []
        self._last_tokens = 0  # query tokens of the latest step's forward pass
        self._last_verified = 0  # sequences it verified drafts for
        self._last_decoding = 0  # sequences in it
        self._last_emitted = 0  # tokens it emitted
        self.acceptance = Acceptance(decay=0.99)  # engine-wide, the prior of a new sequence's
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
                    output_ids: list[int] = (), num_speculative_tokens: int | None = None,
                    tree_topk: int | None = None, tree_depth: int | None = None,
                    grammar: Grammar | None = None) -> None:
        """``num_speculative_tokens`` (γ, or a tree's node budget), ``tree_topk`` and ``tree_depth``:
        this request's speculation; None: the engine's settings."""
        super().add_request(request_id, token_ids, params, output_ids, grammar)
        if request_id in self.seqs:
            gamma = max(0, self.num_speculative_tokens if num_speculative_tokens is None else num_speculative_tokens)
            prior = self.acceptance.alpha
            self._spec[request_id] = _SpecState(gamma, cap=gamma, tree_topk=tree_topk or self.tree_topk,
                                                tree_depth=tree_depth or self.tree_depth,
                                                acceptance=Acceptance(2 * prior, 2 * (1 - prior)))

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
        caps: dict[str, int] = {}
        rooms: dict[str, int] = {}  # drafted tokens that can still be emitted
        for seq in self.scheduler.running:
            st = self._spec.get(seq.request_id)
            if st is None or st.gamma <= 0 or seq.num_uncomputed != 1:
                continue
            if st.cap == 0:
                if st.pause > 0:
                    st.pause -= 1
                    continue
                st.cap = 1
            # A chain is no longer than what can still be emitted; a tree keeps its node budget (its
            # nodes take KV slots, hence max_model_len) and grows no deeper than that (max_depth).
            room = seq.params.max_tokens - seq.num_generated - 1
            k = min(st.cap, self.max_model_len - len(seq) - 1)
            if k > 0 and room > 0:
                caps[seq.request_id], rooms[seq.request_id] = k, room
        if self.load_aware and caps:
            base = sum(1 for s in self.scheduler.running if s.num_uncomputed == 1)
            planned = plan(caps, {sid: self._spec[sid].acceptance.alpha for sid in caps}, base, self.cost)
            if any(planned.values()) and not self.realized.allow(base):
                planned = {}  # speculating did worse here than the model thinks, or plain is due a measure
            if not any(planned.values()):
                self.unplanned_steps += 1
            caps = {sid: k for sid, k in planned.items() if k > 0}
        self.planned_draft_tokens = sum(caps.values())
        out = []
        for seq in self.scheduler.running:
            k = caps.get(seq.request_id, 0)
            if k <= 0:
                continue
            st, p, room = self._spec[seq.request_id], seq.params, rooms[seq.request_id]
            hidden = self._hidden_rows(st, max(st.told - 1, 0), len(seq) - 1) if self.hidden_layers else []
            out.append(DraftInput(seq.request_id, st.round, seq.token_ids[st.told :], k,
                                  SamplingSpec(p.temperature, p.top_p, p.top_k, p.seed), hidden,
                                  st.tree_topk, st.tree_depth, max_depth=room if room < k else 0))
            st.told = len(seq)
            st.round += 1
        return out

    # ------------------------------------------------------------------ stepping

    def step(self, proposals: dict[str, DraftOutput] | None = None) -> list[tuple[str, TokenDelta]]:
        started = time.perf_counter()
        outputs = self._step(proposals)
        self._last_emitted = sum(len(delta.token_ids) for _, delta in outputs)
        if self.time_steps:
            self.observe_cycle(time.perf_counter() - started)
        return outputs

    def observe_cycle(self, seconds: float) -> None:
        """Feed the cost model one step (or a whole serving cycle around it) that took ``seconds``."""
        if self._last_tokens:
            self.cost.observe(self._last_tokens, seconds, self._last_verified)
            self.realized.observe(self._last_decoding, self._last_verified > 0, self._last_emitted, seconds)

    def _step(self, proposals: dict[str, DraftOutput] | None) -> list[tuple[str, TokenDelta]]:
        self._last_tokens = self._last_verified = 0
        outputs, self._immediate = self._immediate, []
        drafted = self._attach(proposals or {})
        batch = self.scheduler.schedule()
        scheduled = {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens)}
        for rid in list(drafted):
            d = drafted[rid]
            n = scheduled.get(rid, 0)
            if n < len(d.tokens) + 1:  # preempted, or only partly scheduled: keep what fits
                keep = max(0, n - 1)
                del d.seq.token_ids[len(d.seq) - len(d.tokens) + keep :]
                if keep:
                    drafted[rid] = d.keep(keep)
                else:
                    del drafted[rid]
        if not batch:
            return outputs
        # the cost model learns from decode and verify steps only: prefill chunks cost differently
        # per token, and what it decides is how many draft tokens to add to decoding sequences
        decoding = all(n == 1 or s.request_id in drafted for s, n in zip(batch.seqs, batch.num_tokens))
        self._last_tokens = sum(batch.num_tokens) if decoding else 0
        self._last_verified = len(drafted)
        self._last_decoding = len(batch.seqs)
        bs = self.config.block_size
        starts = [s.num_computed for s in batch.seqs]
        wants = []
        for s, n in zip(batch.seqs, batch.num_tokens):
            if s.request_id in drafted:
                wants.append(len(drafted[s.request_id].tokens) + 1)
            else:
                wants.append(1 if s.num_computed + n == len(s) else 0)
        chunks = [(s.token_ids[s.num_computed : s.num_computed + n], s.num_computed, s.block_table)
                  for s, n in zip(batch.seqs, batch.num_tokens)]
        trees = [drafted[s.request_id].parents or None if s.request_id in drafted else None for s in batch.seqs]
        out = self.runner.forward(chunks, wants, self.hidden_layers, trees)
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
            every_row = len(plain_rows) == out.logits.shape[0]  # a decode-only step: no gather
            finished_plain = self._sample(plain, out.logits if every_row else out.logits[plain_rows])
            outputs.extend(self._with_spec_usage(finished_plain))
        if verify:
            outputs.extend(self._verify([drafted[s.request_id] for s in verify], out.logits, verify_rows))
        return outputs

    def _attach(self, proposals: dict[str, DraftOutput]) -> dict[str, Drafted]:
        drafted = {}
        for seq in self.scheduler.running:
            prop = proposals.get(seq.request_id)
            st = self._spec.get(seq.request_id)
            if prop is None or st is None or not prop.token_ids or seq.num_uncomputed != 1:
                continue
            # A malformed tree or out-of-vocabulary ids: the proposal is ignored, not trusted.
            if not valid_parents(prop.parents, len(prop.token_ids)) or any(
                    not 0 <= t < self.vocab_size for t in prop.token_ids):
                continue
            if prop.distributions and len(prop.distributions) != len(prop.token_ids):
                continue
            room = seq.params.max_tokens - seq.num_generated - 1  # drafts that can still be emitted
            k = min(len(prop.token_ids), max(st.cap, 1), self.max_model_len - len(seq) - 1)
            d = Drafted(seq, list(prop.token_ids), list(prop.distributions),
                         list(prop.parents) if prop.is_tree else [])
            if d.parents:  # nodes within the budget (a prefix), and no deeper than can be emitted
                d = d.keep(k)
                depth = tree_depths(d.parents)
                d = d.subset([i for i in range(len(d.tokens)) if depth[i] <= room])
            else:
                d = d.keep(min(k, room))
            if d.tokens and seq.grammar is not None:
                # Structured output: the grammar's masks for every node, and nothing below a token it
                # forbids (that token is rejected for certain; it stays, its rejection uses its q).
                d.masks = self.grammars.new_masks(len(d.tokens) + 1)
                d = d.subset(seq.grammar.fill_draft(d.masks, d.tokens, d.parents))
            if d.tokens:
                seq.token_ids.extend(d.tokens)
                drafted[seq.request_id] = d
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

    def _target_probs(self, seq: Sequence, logits: torch.Tensor, depths: list[int],
                      masks: torch.Tensor | None = None) -> torch.Tensor:
        """The request's sampling distribution after each verified node. logits [k+1, V] -> [k+1, V];
        ``depths[i]``: tokens between the last committed one and row i's next token (0 for the root);
        ``masks`` [k+1, W] int32: the grammar's mask at each node (structured outputs), or None."""
        p = seq.params
        logits = logits.clone()
        for i, depth in enumerate(depths):  # stop tokens are banned until min_tokens
            if seq.num_generated + depth < p.min_tokens and seq.stop_ids:
                logits[i, sorted(seq.stop_ids)] = float("-inf")
        if masks is not None:  # a draft token the grammar forbids gets p = 0: it is rejected
            apply_token_bitmask(logits, masks)
        if is_greedy(p.temperature):
            return logits.softmax(-1)
        scaled = logits / p.temperature
        if p.top_k > 0 or p.top_p < 1:
            rows = logits.shape[0]
            scaled = apply_top_k_top_p(scaled, torch.full((rows,), p.top_k, dtype=torch.long, device=logits.device),
                                       torch.full((rows,), p.top_p, device=logits.device))
        return scaled.softmax(-1)

    def _verify(self, drafted: list[Drafted], logits: torch.Tensor,
                rows: list[list[int]]) -> list[tuple[str, TokenDelta]]:
        batch, width, vocab = len(drafted), max(len(d.tokens) for d in drafted), logits.shape[-1]
        dev = logits.device
        trees = any(d.parents for d in drafted)
        target = torch.zeros(batch, width + 1, vocab, device=dev)
        draft_probs = torch.zeros(batch, width, vocab, device=dev)
        tokens = torch.full((batch, width), PAD, dtype=torch.long, device=dev)
        num_draft = torch.zeros(batch, dtype=torch.long, device=dev)
        greedy = torch.zeros(batch, dtype=torch.bool, device=dev)
        uniforms = torch.empty(batch, width, device=dev)
        exps = torch.empty(batch, vocab, device=dev)
        for b, (d, r) in enumerate(zip(drafted, rows)):
            k, seq = len(d.tokens), d.seq
            depths = [0] + (tree_depths(d.parents) if d.parents else list(range(1, k + 1)))
            target[b, : k + 1] = self._target_probs(seq, logits[r], depths, d.masks)
            tokens[b, :k] = torch.tensor(d.tokens, device=dev)
            num_draft[b] = k
            greedy[b] = is_greedy(seq.params.temperature)
            if d.dists and not greedy[b]:
                ids = [x.ids for x in d.dists]
                span = max(len(i) for i in ids)
                ids_t = torch.tensor([i + [PAD] * (span - len(i)) for i in ids])
                probs_t = torch.tensor([x.probs + [0.0] * (span - len(x.probs)) for x in d.dists])
                ids_t = torch.where(ids_t < vocab, ids_t, PAD)  # out-of-vocabulary ids carry no mass here
                draft_probs[b, :k] = sparse_to_dense(ids_t.to(dev), probs_t.to(dev), vocab)
            else:  # greedy draft: one-hot on its token
                draft_probs[b, torch.arange(k, device=dev), tokens[b, :k]] = 1.0
            uniforms[b].uniform_(generator=seq.generator)
            exps[b].exponential_(generator=seq.generator)
        if trees:  # chains too, in the same batch, as degenerate trees
            parents = parent_nodes([d.parents or chain_parents(len(d.tokens)) for d in drafted], width, dev)
            out_tokens, path, accepted = tree_rejection_sample(target, tokens, parents, draft_probs, greedy, uniforms,
                                                               exps)
            path = path.cpu()
        else:
            sampler = rejection_sample
            if dev.type == "cuda":  # the fused kernel; on CPU the torch function is the reference
                from ..speculation.triton_rejection import rejection_sample_triton as sampler
            out_tokens, accepted = sampler(target, tokens, draft_probs, num_draft, greedy, uniforms, exps)
            path = None
        out_tokens, accepted = out_tokens.cpu(), accepted.cpu()
        results = []
        for b, (d, r) in enumerate(zip(drafted, rows)):
            n = int(accepted[b])
            chosen = path[b, :n].tolist() if path is not None else list(range(n))
            results.append(self._commit(d, out_tokens[b], chosen, logits[[r[0]] + [r[1 + i] for i in chosen]]))
        return results

    def _commit(self, d: Drafted, out: torch.Tensor, path: list[int], logits: torch.Tensor) -> tuple[str, TokenDelta]:
        """Commit the accepted drafts (token indices ``path``, in order) and the final token;
        ``logits`` [len(path) + 1, V] are the rows of the root and of the accepted nodes."""
        seq, k, accepted = d.seq, len(d.tokens), len(path)
        base = len(seq) - k  # committed length before this round
        moves = [(base + i, base + j) for j, i in enumerate(path) if i != j]
        if moves:  # a tree path: its KV (and hidden states) move to consecutive positions
            self.runner.copy_slots([(self._slot(seq, src), self._slot(seq, dst)) for src, dst in moves])
            self._move_hidden(seq.request_id, moves)
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
        if seq.grammar is not None:
            seq.grammar.accept(kept)
        seq.num_computed = min(base + accepted, len(seq))
        self.runner.copy_blocks(self.blocks.truncate(seq.block_table, seq.num_computed))
        self._register_blocks(seq, self.config.block_size)
        st = self._spec[seq.request_id]
        u = st.usage
        per_pos = list(u.accepted_per_pos) + [0] * (d.depth - len(u.accepted_per_pos))
        for i in range(accepted):
            per_pos[i] += 1
        st.usage = msgspec.structs.replace(u, num_drafts=u.num_drafts + 1, num_draft_tokens=u.num_draft_tokens + k,
                                           num_accepted_tokens=u.num_accepted_tokens + accepted,
                                           accepted_per_pos=per_pos)
        self.counters.setdefault(self.draft_id, SpecCounters()).observe_draft(k, accepted, d.depth)
        st.acceptance.observe(d.depth, accepted)
        self.acceptance.observe(d.depth, accepted)
        if self.adaptive:
            if d.parents:  # a tree: nodes off the accepted path are spent by design, so only a pass that
                # accepts nothing says the draft is off (the budget halves); any hit doubles it again
                st.cap = min(st.gamma, max(2 * st.cap, st.cap + 2)) if accepted else st.cap // 2
            else:
                st.cap = min(st.gamma, st.cap + 2) if accepted == d.depth else max(0, st.cap - 1)
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

    def _slot(self, seq: Sequence, position: int) -> int:
        bs = self.config.block_size
        return seq.block_table[position // bs] * bs + position % bs

    # ------------------------------------------------------------------ hidden states (EAGLE)

    def _move_hidden(self, request_id: str, moves: list[tuple[int, int]]) -> None:
        """Hidden-state rows follow their tokens when an accepted tree path moves (src, dst positions)."""
        st = self._spec.get(request_id)
        if st is None or not st.hidden:
            return
        for rows in st.hidden:
            for src, dst in moves:
                rows[dst - st.hidden_base] = rows[src - st.hidden_base]

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

