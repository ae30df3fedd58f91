"""The engine: requests in, token deltas out, one :meth:`Engine.step` at a time, plain or speculative.

Synchronous and single-threaded by design: the worker runs it in one dedicated thread, and nothing
else touches torch. A step:

1. attaches the proposals a draft worker returned for sequences that decode next, after checking
   them (:class:`.speculator.Speculator`; none = a plain step);
2. schedules a batch (continuous batching, chunked prefill, preemption) and runs ONE forward pass
   over it: a drafted sequence computes its last committed token and every draft node (a chain, or
   a token tree under a tree attention mask); the hidden states of the offered layers go to the
   :class:`.hidden.HiddenStore`;
3. turns every logits row into the request's scores through the one pipeline of :mod:`.logits`
   (min_tokens, logit_bias, penalties, grammar, temperature, min_p, top-k/top-p), so verification
   uses exactly the distribution plain sampling would;
4. samples the plain rows (:mod:`.sampling`) and verifies the drafted ones, all at once
   (:mod:`.verifier`: lossless rejection sampling), commits the accepted tokens, and moves KV
   (and hidden rows) of accepted tree paths and copy-on-write blocks in one batched copy each.

It returns one :class:`TokenDelta` per request that produced tokens or finished (the last carries
``finish_reason`` and ``usage``); what a draft worker hears next comes from :meth:`draft_news`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from runtime.messages import KvEvent, KvHandoff, SamplingParams, TokenDelta

from ..speculation.payloads import DraftInput, DraftOutput, VerifyResult
from .admission import Admission
from .block_manager import BlockManager
from .commits import HANDOFF, Commits
from .cuda_graphs import GraphConfig
from .grammar import Grammar, GrammarBackend
from .handoff import Handoffs, Receiving
from .hidden import HiddenStore
from .logits import Row, penalised, process
from .lora import LoraManager
from .model import DecoderModel
from .model_runner import PENDING_TOKEN, ModelRunner
from .news import DraftNews
from .outputs import Outputs
from .pending import PendingStep
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence
from .sizing import EngineConfig, graph_config, log_device_memory, plan_cache
from .speculator import Drafted, Speculator

log = logging.getLogger(__name__)

__all__ = ["HANDOFF", "Engine", "EngineConfig", "StepStats"]


class Engine:
    """Owns the scheduler, block manager, model runner and speculation state of one model.

    Speculation: ``num_speculative_tokens`` (γ: a chain's length, or a tree's node budget, per
    request unless it asks otherwise), ``tree_topk``/``tree_depth`` (the tree shape asked of the
    draft; 0: the draft worker's setting), ``adaptive`` and ``load_aware`` budgets (see
    :mod:`.speculator`). ``hidden_layers``: the target layers whose hidden states are kept for draft
    workers that read them (Hugging Face numbering, see :mod:`.model`); fixed for the engine's life.
    ``followers``: a tensor-parallel ``model``'s other ranks (:class:`.followers.Followers`), which
    repeat every model call; this engine is rank 0's and the only one. ``lora``: the model's LoRA
    adapters (:mod:`.lora`); a request names one with ``add_request(..., lora=name)``. Speculation
    stays lossless with adapters: a draft proposes as it does for the base model and the target
    verifies under the request's adapter (its logits are the adapter's).

    The parts, each its own module: what the draft hears (:class:`.news.DraftNews`), tokens
    committed (:class:`.commits.Commits`), a step's outputs (:class:`.outputs.Outputs`), the cache's
    size (:mod:`.sizing`); the engine admits requests and runs steps.
    """

    def __init__(self, model: DecoderModel, config: EngineConfig = EngineConfig(), worker_id: str = "",
                 eos_token_ids: tuple[int, ...] | None = None, grammars: GrammarBackend | None = None, *,
                 num_speculative_tokens: int = 4, hidden_layers: tuple[int, ...] = (), adaptive: bool = True,
                 pause_steps: int = 8, tree_topk: int = 0, tree_depth: int = 0, load_aware: bool = False,
                 followers=None, lora: LoraManager | None = None):
        cfg = model.cfg
        layers = tuple(sorted(set(hidden_layers)))  # what the store keeps
        if any(not 0 <= k <= cfg.num_layers for k in layers):
            raise ValueError(f"hidden layers must be in [0, {cfg.num_layers}], got {list(layers)}")
        self.spec = Speculator(cfg.vocab_size, num_speculative_tokens, adaptive=adaptive, pause_steps=pause_steps,
                               tree_topk=tree_topk, tree_depth=tree_depth, load_aware=load_aware)
        self.config = config
        cache = plan_cache(model, config, len(layers), num_speculative_tokens)
        self.max_model_len = max_len = cache.max_model_len
        self.kv_cache_bytes = cache.num_blocks * cache.block_bytes  # the cache's (and its hidden rows') bytes
        self.vocab_size = cfg.vocab_size
        self.hidden_layers = tuple(hidden_layers)  # as given: see DraftNews.hidden_layers
        self.eos_token_ids = frozenset(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.blocks = BlockManager(cache.num_blocks, config.block_size, worker_id, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens, lora=lora,
                                   policy=config.scheduling_policy)
        self.runner = ModelRunner(model, cache.num_blocks, config.block_size, self._graph_config(model), max_len,
                                  followers, lora=lora)
        self.lora = lora
        param = next(model.parameters())
        slots = self.runner.kv_caches[0][0].shape[0] * config.block_size  # the graphs' scratch block too
        self.hidden = HiddenStore(layers, slots, cfg.hidden_size, param.dtype, param.device) if layers else None
        self.seqs: dict[str, Sequence] = {}
        self.news = DraftNews(self.spec, self.hidden, self.hidden_layers, config.block_size, self.runner.device)
        # prefill/decode disaggregation: blocks handed off (prefill side) and being pulled (decode side)
        self.handoffs = Handoffs(self.blocks)
        self.commits = Commits(self.seqs, self.blocks, self.scheduler, self.spec, self.handoffs, max_len)
        self.outputs = Outputs(self.commits, self.news, self.spec, self.blocks, self.runner, self.hidden)
        self.admission = Admission(self.seqs, self.spec, self.blocks, self.scheduler, self.commits,
                                   vocab_size=cfg.vocab_size, max_model_len=max_len, eos_token_ids=self.eos_token_ids,
                                   grammars=grammars, lora=lora, device=self.runner.device)
        self.time_steps = True  # the cost model times step(); a serving loop times whole cycles instead
        self.last_batch: list[str] = []  # request ids of the latest step's batch (what a failure concerns)
        self.last_step = StepStats()
        # async scheduling (not under tensor parallelism: the other ranks take token ids from the host)
        self.async_scheduling = config.async_scheduling and followers is None
        if config.async_scheduling and followers is not None:
            log.warning("async scheduling is off under tensor parallelism: every step is synchronous")
        self._pending: PendingStep | None = None  # the launched step whose tokens are still on the device
        self.tiers = None  # KV tiers below the device pool (attach_tiers)
        log.info("engine: %d blocks of %d tokens, max_model_len %d, hidden layers %s", cache.num_blocks,
                 config.block_size, max_len, list(layers) or "none")
        log_device_memory(model, config)

    def _graph_config(self, model: DecoderModel) -> GraphConfig | None:
        """The CUDA graphs captured at start-up (:func:`.sizing.graph_config`; tests run them eagerly)."""
        return graph_config(model, self.config, self.hidden_layers, self.spec.num_speculative_tokens)

    @property
    def grammars(self) -> GrammarBackend | None:
        """Structured outputs (None: requests with a grammar are refused)."""
        return self.admission.grammars

    @grammars.setter
    def grammars(self, grammars: GrammarBackend | None) -> None:
        self.admission.grammars = grammars

    @property
    def prefill_time(self):
        """First scheduled to first token, per request (a histogram)."""
        return self.commits.prefill_time

    # ------------------------------------------------------------------ requests

    def validate(self, token_ids: list[int], params: SamplingParams, output_ids: list[int] = ()) -> None:
        """Raise :class:`InvalidRequest` (naming the field) for a request the engine cannot serve."""
        self.admission.validate(token_ids, params, output_ids)

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    output_ids: list[int] = (), grammar: Grammar | None = None, *,
                    num_speculative_tokens: int | None = None, tree_topk: int | None = None,
                    tree_depth: int | None = None, prefill_only: bool = False, lora: str | None = None,
                    priority: int = 0, draft: str = "") -> None:
        """Queue a request (after :meth:`validate`); ``output_ids`` continue a migrated request.
        ``grammar``: the request's compiled ``params.structured`` (compiled here when not given).
        ``num_speculative_tokens``, ``tree_topk``, ``tree_depth``: this request's speculation (None:
        the engine's settings). ``prefill_only``: a prefill worker's request, which ends after its
        first token with finish reason :data:`HANDOFF`, its blocks kept for a decode worker to pull
        (:class:`.handoff.Handoffs`). ``lora``: the LoRA adapter it runs with (None: the base model).
        ``priority``: vLLM's (lower first), read under ``EngineConfig.scheduling_policy`` "priority".
        ``draft``: the draft worker to speculate with, when the target streams to it (a router's hint)."""
        self.admission.add(request_id, token_ids, params, output_ids, grammar,
                           (num_speculative_tokens, tree_topk, tree_depth, draft), prefill_only, lora, priority)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is not running here. (A request whose KV
        is still being pulled keeps its blocks until :meth:`finish_receive` says the pull ended.)"""
        return self.admission.abort(request_id)

    def load_lora(self, name: str, path: str) -> None:
        """Register a LoRA adapter (:meth:`.admission.Admission.load_lora`)."""
        self.admission.load_lora(name, path)

    def unload_lora(self, name: str) -> None:
        """Unregister an adapter no running request uses (raises :class:`.lora.LoraError`)."""
        self.admission.unload_lora(name)

    def has_work(self) -> bool:
        return (bool(self.admission.immediate or self.admission.joining) or self.scheduler.has_work()
                or self._pending is not None or (self.tiers is not None and bool(self.tiers.held)))

    def attach_tiers(self, tiers) -> None:
        """Keep KV blocks below the device pool (:class:`.kv_tiers.KvTiers`, built over this engine's cache)."""
        self.tiers = tiers
        self.scheduler.attach_tiers(tiers)
        self.commits.attach_tiers(tiers)
        self.admission.attach_tiers(tiers)

    # ------------------------------------------------------------------ speculation: the draft worker's side

    @property
    def counters(self):
        """Spec-decode counters per draft worker id."""
        return self.spec.counters

    def reset_drafts(self) -> None:
        """A new draft worker knows none of our sequences: start every one from scratch."""
        self.news.reset()

    def draft_inputs(self, layers: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
                     plane=None) -> list[DraftInput]:
        """Proposal requests for every running sequence that decodes next and speculates, with the
        hidden states of ``layers`` as :meth:`take_verdicts` carries them."""
        if self._pending is not None:  # the draft proposes from the latest tokens: bring them to the host
            self.admission.immediate.extend(self.flush())  # (their deltas come with the next step)
        return self.news.inputs(self.scheduler.running, self.max_model_len, layers, dtype, plane)

    def take_added(self) -> list[Sequence]:
        """The sequences added since the last call."""
        added, self.admission.added = self.admission.added, []
        return added

    def prompt_inputs(self, added: list[Sequence]) -> list[DraftInput]:
        """Pipelined seam: proposal requests for sequences just added (:meth:`take_added`), carrying
        their prompts, before their prefill runs (:meth:`.news.DraftNews.prompt_inputs`)."""
        return self.news.prompt_inputs(added, self.seqs, self.max_model_len)

    def take_verdicts(self, layers: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
                      plane=None) -> list[VerifyResult]:
        """The latest steps' verdicts, with the hidden states of ``layers`` (None: all offered) on the
        CPU in ``dtype``, or, given a data ``plane`` (:class:`workers.speculation.hidden_plane.PlaneWriter`),
        written to it as one block and referred to by ``hidden_ref``."""
        return self.news.take_verdicts(layers, dtype, plane)

    def offer(self, proposals: list[DraftOutput]) -> None:
        """Pipelined seam: proposals streamed ahead, checked and kept until a step they fit."""
        self.spec.offer(proposals)

    def take_released(self) -> list[str]:
        return self.news.take_released()

    def draft_news(self, layers: tuple[int, ...] | None, dtype: torch.dtype | None, plane, ask: bool,
                   why: str = "draft_backoff") -> tuple[list[VerifyResult], list[str], list[DraftInput]]:
        """One draft stream's verdicts, released sequences and, when ``ask``, requests (:meth:`.news.DraftNews.news`)."""
        if ask and self._pending is not None:  # the draft proposes from the latest tokens: bring them to the host
            self.admission.immediate.extend(self.flush())  # (their deltas come with the next step)
        return self.news.news(self.scheduler.running, self.max_model_len, layers, dtype, plane, ask, why)

    def draft_news_by(self, groups: dict[str, tuple], asking: dict[str, tuple]) -> tuple[dict, dict, dict]:
        """Several draft streams (workers.target.placement): per draft worker id, the latest verdicts and
        released sequences (``groups``: each one's (layers, dtype, plane), as :meth:`draft_inputs` takes
        them), then this round's requests (``asking``: the groups asked). Verdicts go to the draft that
        proposed even if the sequence was placed on another since."""
        verdicts, released = self.news.take_verdicts_by(groups), self.news.take_released_by()
        if self._pending is not None:  # the draft proposes from the latest tokens: bring them to the host
            self.admission.immediate.extend(self.flush())  # (their deltas come with the next step)
        return verdicts, released, self.news.inputs_by(self.scheduler.running, self.max_model_len, asking)

    # ------------------------------------------------------------------ stepping

    def step(self, proposals: dict[str, DraftOutput] | None = None) -> list[tuple[str, TokenDelta]]:
        """One scheduling step and forward pass, verifying ``proposals`` (by request id) for the
        sequences that decode next; returns (request id, delta) pairs."""
        started = time.perf_counter()
        outputs, self.admission.immediate = self.admission.immediate, []
        self.admission.added.clear()  # their prefill starts now: too late to tell the draft their prompts first
        self.last_batch = []
        self.last_step = StepStats()
        if self._pending is not None and (proposals or self.spec.staged):  # verify steps run on host-known tokens
            outputs.extend(self.flush())
        drafted = self.spec.attach(proposals or {}, self.scheduler.running, self.max_model_len, self.grammars)
        batch = self.scheduler.schedule()
        self.last_batch = [s.request_id for s in batch.seqs]
        _fit_drafts(drafted, batch)
        if batch:
            outputs.extend(self._run(batch, drafted))
        else:
            outputs.extend(self.flush())
        stats = self.last_step
        if self.time_steps:
            self.spec.observe_cycle(stats.tokens, stats.verified, stats.decoding, stats.emitted,
                                    time.perf_counter() - started)
        self.admission.join_received()
        if self.tiers is not None:  # blocks computed in this step go down; sequences whose disk reads ended queue
            for seq in self.tiers.after_step(idle=not batch):
                if self.seqs.get(seq.request_id) is seq:
                    self.scheduler.add(seq)
        return outputs

    def observe_cycle(self, seconds: float, asked: bool = False) -> None:
        """Feed the cost model the latest step as part of a serving cycle that took ``seconds``
        (``asked``: proposals were asked for that step, whether or not they came in time)."""
        s = self.last_step
        self.spec.observe_cycle(s.tokens, s.verified, s.decoding, s.emitted, seconds, asked)

    def _run(self, batch: ScheduledBatch, drafted: dict[str, Drafted]) -> list[tuple[str, TokenDelta]]:
        chunks, wants, trees = [], [], []
        pending, sources = self._pending, []  # async scheduling: per chunk, its last token's row in pending
        rows_of = pending.row_of() if pending is not None else {}
        for s, n in zip(batch.seqs, batch.num_tokens):
            d = drafted.get(s.request_id)
            chunk = s.token_ids[s.num_computed : s.num_computed + n]
            sources.append(-1)
            if len(chunk) < n:  # its last token is the pending step's, still on the device
                if n - len(chunk) != 1 or id(s) not in rows_of:
                    raise RuntimeError(f"request {s.request_id}: {n - len(chunk)} tokens not on the host")
                chunk.append(PENDING_TOKEN)
                sources[-1] = rows_of[id(s)]
            chunks.append((chunk, s.num_computed, s.block_table))
            last = s.num_computed + n == len(s) + s.num_pending
            wants.append(len(d.tokens) + 1 if d is not None else (1 if last else 0))
            trees.append(d.parents or None if d is not None else None)
        lora = {"adapters": [s.lora_slot for s in batch.seqs]} if self.lora is not None else {}
        out = self.runner.forward(chunks, wants, self.hidden.layers if self.hidden is not None else (), trees,
                                  (pending.tokens, sources) if pending is not None else None, **lora)
        if self.hidden is not None:  # held until a draft reads them (a graph's rows are its buffers: copied now)
            self.hidden.write(out.slots, out.hidden, views=self.runner.graphs is not None)
        # the cost model learns from decode and verify steps only: prefill chunks cost differently
        decoding = all(n == 1 or s.request_id in drafted for s, n in zip(batch.seqs, batch.num_tokens))
        self.last_step = StepStats(sum(batch.num_tokens) if decoding else 0, len(drafted), len(batch.seqs))
        # one logits row per plain sampling sequence, 1 + k rows per drafted one (root, then nodes)
        rows: list[Row] = []
        plain: list[tuple[Sequence, int]] = []  # (sequence, its row)
        verified: list[tuple[Drafted, int]] = []  # (proposal, its root row)
        mask_rows, masks = [], []
        for s, n, want in zip(batch.seqs, batch.num_tokens, wants):
            s.num_computed += n
            d = drafted.get(s.request_id)
            if d is not None:
                verified.append((d, len(rows)))
                penalties = penalised(s)
                for depth, path in zip([0] + d.depths(), d.ancestors() if penalties else [()] * (len(d.tokens) + 1)):
                    rows.append(Row(s, depth, path))
                if d.masks is not None:
                    mask_rows.extend(range(len(rows) - len(d.tokens) - 1, len(rows)))
                    masks.append(d.masks)
            else:
                self.commits.register_blocks(s)
                if want:
                    if n == 1:  # a decode step without a draft (prefill's first token is no such step)
                        self.spec.count_plain(s)
                    plain.append((s, len(rows)))
                    if s.grammar is not None:
                        m = self.grammars.new_masks(1)
                        s.grammar.fill(m[0])
                        mask_rows.append(len(rows))
                        masks.append(m)
                    rows.append(Row(s, s.num_pending))  # pending tokens count as generated (min_tokens)
        if not rows:
            return self.flush()
        scores, greedy = process(out.logits, rows, torch.cat(masks) if masks else None, mask_rows)
        if plain and not verified and self._defers(plain):
            self.last_step.emitted = len(plain)
            launched = self.outputs.defer(plain, scores, greedy, out.logits, self.max_model_len)
            previous = self.flush()  # the step before: its bookkeeping runs now
            self._pending = launched
            return previous
        previous = self.flush()  # async scheduling: the step before, while this one runs
        outputs = self.outputs.sample(plain, scores, greedy, out.logits) if plain else []
        if verified:
            outputs.extend(self.outputs.verify(verified, scores, greedy, out.logits))
        self.last_step.emitted = sum(len(delta.token_ids) for _, delta in outputs)
        return previous + outputs

    def _defers(self, plain: list[tuple[Sequence, int]]) -> bool:
        """Whether this plain step's host bookkeeping may run one step behind (async scheduling):
        not when a sampled sequence's next step needs this step's token on the host, i.e. a grammar
        (its next mask), penalties (counts over the output so far), or a connected draft worker that
        proposes from it (a speculating sequence)."""
        if not self.async_scheduling:
            return False
        drafting = bool(self.spec.draft_id)
        for s, _ in plain:
            if s.grammar is not None or penalised(s) or s.prefill_only:  # a handoff is its first token
                return False
            st = self.spec.states.get(s.request_id) if drafting else None
            if st is not None and st.num_speculative_tokens > 0:
                return False
        return True

    def flush(self) -> list[tuple[str, TokenDelta]]:
        """Finish the pending step (async scheduling): wait for its tokens on the host and do its
        bookkeeping (:meth:`.outputs.Outputs.finish_pending`); returns its deltas, [] when no step
        is pending."""
        p, self._pending = self._pending, None
        return [] if p is None else self.outputs.finish_pending(p)

    # ------------------------------------------------------------------ prefill/decode disaggregation

    def receive(self, request_id: str, token_ids: list[int], params: SamplingParams, output_ids: list[int],
                handoff: KvHandoff, grammar: Grammar | None = None, *, num_speculative_tokens: int | None = None,
                tree_topk: int | None = None, tree_depth: int | None = None) -> Receiving | None:
        """Admit a request whose prompt a prefill worker computed (decode side): what to pull into
        which blocks, or None (:meth:`.admission.Admission.receive`)."""
        return self.admission.receive(request_id, token_ids, params, output_ids, handoff, grammar,
                                      (num_speculative_tokens, tree_topk, tree_depth))

    def finish_receive(self, request_id: str, ok: bool, quarantine: bool = False) -> None:
        """The pull of ``request_id``'s KV ended (:meth:`.admission.Admission.finish_receive`)."""
        self.admission.finish_receive(request_id, ok, quarantine)

    @property
    def receiving(self) -> dict[str, Receiving]:
        return self.admission.receiving

    @property
    def quarantined_blocks(self) -> int:
        return self.admission.quarantined_blocks

    # ------------------------------------------------------------------ introspection

    def drain_kv_events(self) -> list[KvEvent]:
        events = self.blocks.drain_events()
        return events + self.tiers.drain_events() if self.tiers is not None else events

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def generate(self, prompts: dict[str, list[int]], params: SamplingParams | dict[str, SamplingParams]) -> dict[str, list[int]]:
        """Run requests to completion (tests, benchmarks); returns generated tokens per request."""
        result: dict[str, list[int]] = {rid: [] for rid in prompts}
        for rid, tokens in prompts.items():
            self.add_request(rid, tokens, params[rid] if isinstance(params, dict) else params)
        while self.has_work():
            for rid, delta in self.step():
                result[rid].extend(delta.token_ids)
        return result


def _fit_drafts(drafted: dict[str, Drafted], batch: ScheduledBatch) -> None:
    """Cut proposals of sequences the scheduler preempted or only partly scheduled to what fits."""
    scheduled = {s.request_id: n for s, n in zip(batch.seqs, batch.num_tokens)}
    for rid in list(drafted):
        d = drafted[rid]
        n = scheduled.get(rid, 0)
        if n < len(d.tokens) + 1:
            keep = max(0, n - 1)
            del d.seq.token_ids[len(d.seq) - len(d.tokens) + keep :]
            if keep:
                drafted[rid] = d.keep(keep)
            else:
                del drafted[rid]


@dataclass
class StepStats:
    """What the latest step ran: query tokens of a decode/verify step (0 when it had prefill
    chunks), sequences verified, sequences in the batch, tokens emitted."""

    tokens: int = 0
    verified: int = 0
    decoding: int = 0
    emitted: int = 0

