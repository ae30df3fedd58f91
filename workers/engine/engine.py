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
``finish_reason`` and ``usage``). Verdicts for the draft worker wait in :meth:`take_verdicts`, and
the next round's requests come from :meth:`draft_inputs`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from runtime.errors import InvalidRequest
from runtime.histogram import REQUEST_LATENCY_BUCKETS, histogram
from runtime.kv_hash import chain_root
from runtime.messages import KvEvent, KvHandoff, SamplingParams, TokenDelta, TopLogprob, Usage
from runtime.validation import validate_request

from ..speculation.payloads import DraftInput, DraftOutput, HiddenRef, SamplingSpec, VerifyResult
from .block_manager import BlockManager
from .cuda_graphs import GraphConfig
from .grammar import Grammar, GrammarBackend
from .handoff import Handoffs, Receiving
from .hidden import HiddenStore
from .memory import ALLOCATOR_SLACK, GIB, DeviceMemory, kv_cache_bytes, step_activation_bytes
from .logits import Row, penalised, process
from .lora import LoraError, LoraManager
from .model import DecoderModel
from .model_runner import PENDING_TOKEN, ModelRunner
from .pending import PendingStep
from .sampling import is_greedy, logprobs_of, sample
from .scheduler import ScheduledBatch, Scheduler
from .sequence import Sequence, SeqStatus
from .speculator import Drafted, SpecState, Speculator
from .verifier import Candidate, verify

log = logging.getLogger(__name__)

HANDOFF = "handoff"  # a prefill-only request's finish reason: its KV waits for a decode worker (see KvHandoff)


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits. ``num_blocks`` None: as many as ``kv_cache_bytes`` holds."""

    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # on CUDA with Triton kernels: decode/verify steps replay captured graphs
    cuda_graph_max_batch: int | None = None  # largest graphed batch (None: max_num_seqs)
    # graphs for every verify length 2..γ+1 (False: γ+1 only, shorter verifies padded to it)
    cuda_graph_every_length: bool = True
    # launch step N+1 from step N's tokens on the device; N's host bookkeeping runs one step behind
    async_scheduling: bool = False
    # CUDA: the share of the device this engine may use; the KV cache gets the rest after weights,
    # activations and graphs (:mod:`.memory`). None, or on the CPU: kv_cache_bytes. num_blocks wins.
    gpu_memory_utilization: float | None = None

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch <= 0:
            raise ValueError(f"cuda_graph_max_batch must be positive, got {self.cuda_graph_max_batch}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


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
        max_len = min(config.max_model_len or cfg.max_position_embeddings, model.max_positions)
        if cfg.sliding_window and max_len > cfg.sliding_window:
            log.warning("capping max_model_len to the sliding window (%d)", cfg.sliding_window)
            max_len = cfg.sliding_window
        param = next(model.parameters())
        slot_bytes = HiddenStore.bytes_per_slot(len(layers), cfg.hidden_size, param.element_size())
        block_bytes = ModelRunner.bytes_per_block(model, config.block_size) + slot_bytes * config.block_size
        self.config = config
        kv_bytes = config.kv_cache_bytes
        if config.num_blocks is None and config.gpu_memory_utilization is not None:
            kv_bytes = self._kv_bytes_for_utilization(model, block_bytes)
        num_blocks = config.num_blocks or max(1, kv_bytes // block_bytes)
        if num_blocks * config.block_size < max_len:
            if config.max_model_len is not None:
                raise ValueError(f"{num_blocks} blocks of {config.block_size} cannot hold max_model_len={max_len}")
            max_len = num_blocks * config.block_size
        self.max_model_len = max_len
        self.kv_cache_bytes = num_blocks * block_bytes  # the cache's (and its hidden rows') bytes, as sized
        self.vocab_size = cfg.vocab_size
        # as given: a draft reads its layers in its own order, repeats included (EAGLE-3 on a 4-layer
        # target reads [2, 2, 1]); draft_inputs and take_verdicts default to this list
        self.hidden_layers = tuple(hidden_layers)
        self.eos_token_ids = frozenset(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.blocks = BlockManager(num_blocks, config.block_size, worker_id, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.prefill_time = histogram(REQUEST_LATENCY_BUCKETS)  # first scheduled to first token, per request
        self.runner = ModelRunner(model, num_blocks, config.block_size, self._graph_config(model), max_len, followers)
        self.lora = lora
        self.runner.lora = self.scheduler.lora = lora
        slots = self.runner.kv_caches[0][0].shape[0] * config.block_size  # the graphs' scratch block too
        self.hidden = HiddenStore(layers, slots, cfg.hidden_size, param.dtype, param.device) if layers else None
        self.grammars = grammars  # structured outputs (None: requests with a grammar are refused)
        self.seqs: dict[str, Sequence] = {}
        self._immediate: list[tuple[str, TokenDelta]] = []
        # verdicts waiting for take_verdicts: (seq, round, accepted, emitted, first hidden-row position)
        self._verdicts: list[tuple[Sequence, int, int, list[int], int]] = []
        self._added: list[Sequence] = []  # sequences added since the step loop last took them (take_added)
        self.time_steps = True  # the cost model times step(); a serving loop times whole cycles instead
        self.last_batch: list[str] = []  # request ids of the latest step's batch (what a failure concerns)
        # prefill/decode disaggregation: blocks handed off (prefill side) and being pulled (decode side)
        self.handoffs = Handoffs(self.blocks)
        self.receiving: dict[str, Receiving] = {}
        self._joining: list[Sequence] = []  # received sequences that join the running batch after a step
        self.quarantined_blocks = 0
        self.last_step = StepStats()
        # async scheduling (not under tensor parallelism: the other ranks take token ids from the host)
        self.async_scheduling = config.async_scheduling and followers is None
        if config.async_scheduling and followers is not None:
            log.warning("async scheduling is off under tensor parallelism: every step is synchronous")
        self._pending: PendingStep | None = None  # the launched step whose tokens are still on the device
        self.tiers = None  # KV tiers below the device pool (attach_tiers)
        log.info("engine: %d blocks of %d tokens, max_model_len %d, hidden layers %s", num_blocks, config.block_size,
                 max_len, list(layers) or "none")
        if config.num_blocks is None and config.gpu_memory_utilization is not None and param.is_cuda:
            torch.cuda.synchronize(param.device)
            free, total = torch.cuda.mem_get_info(param.device)
            log.info("device memory with the KV cache allocated and the graphs captured: this worker's allocator "
                     "holds %.2f GiB, %.2f GiB of %.2f GiB free (--gpu-memory-utilization %g: %.2f GiB)",
                     torch.cuda.memory_reserved(param.device) / GIB, free / GIB, total / GIB,
                     config.gpu_memory_utilization, config.gpu_memory_utilization * total / GIB)

    def _kv_bytes_for_utilization(self, model: DecoderModel, block_bytes: int) -> int:
        """The KV cache's bytes under ``gpu_memory_utilization`` (CUDA; the CPU keeps kv_cache_bytes)."""
        config, param = self.config, next(model.parameters())
        if not param.is_cuda:
            log.debug("--gpu-memory-utilization applies on CUDA: on the CPU the KV cache takes --kv-cache-gb "
                     "(%.2f GiB)", config.kv_cache_bytes / GIB)
            return config.kv_cache_bytes
        cfg, gamma = model.cfg, self.spec.num_speculative_tokens
        shape = dict(hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                     q_size=cfg.num_heads * cfg.head_dim, kv_size=cfg.num_kv_heads * cfg.head_dim,
                     vocab_size=cfg.vocab_size, itemsize=param.element_size())
        rows = min(config.max_num_batched_tokens, config.max_num_seqs * (gamma + 1))
        reserve = step_activation_bytes(config.max_num_batched_tokens, rows, **shape) + ALLOCATOR_SLACK
        if config.cuda_graphs and model.static_capable:  # the graphs' pool (the largest graphed step) and
            graphed = (config.cuda_graph_max_batch or config.max_num_seqs) * (gamma + 1)  # their scratch block
            reserve += step_activation_bytes(graphed, graphed, **shape) + block_bytes
        torch.cuda.synchronize(param.device)
        free, total = torch.cuda.mem_get_info(param.device)
        memory = DeviceMemory(total, free, torch.cuda.memory_reserved(param.device))
        kv = kv_cache_bytes(memory, config.gpu_memory_utilization, reserve)
        log.info("KV cache %.2f GiB from --gpu-memory-utilization %g of %.2f GiB: this worker holds %.2f GiB "
                 "(weights), keeps %.2f GiB for activations and graphs; %.2f GiB free", kv / GIB,
                 config.gpu_memory_utilization, total / GIB, memory.held / GIB, reserve / GIB, free / GIB)
        return kv

    def _graph_config(self, model: DecoderModel) -> GraphConfig | None:
        """CUDA graphs for decode and verify steps (CUDA, tensor-only attention), captured at start-up
        with the hidden layers the engine keeps, so that no draft worker causes a recapture."""
        cfg = self.config
        if not (cfg.cuda_graphs and next(model.parameters()).is_cuda and model.static_capable):
            return None
        gamma = self.spec.num_speculative_tokens
        lens = tuple(range(1, gamma + 2)) if cfg.cuda_graph_every_length else (1, gamma + 1)
        return GraphConfig(cfg.cuda_graph_max_batch or cfg.max_num_seqs, lens if gamma else (1,),
                           tuple(sorted(set(self.hidden_layers))), trees=gamma > 1)

    # ------------------------------------------------------------------ requests

    def validate(self, token_ids: list[int], params: SamplingParams, output_ids: list[int] = ()) -> None:
        """Raise :class:`InvalidRequest` (naming the field) for a request the engine cannot serve."""
        validate_request(token_ids, params, output_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                         structured_outputs=self.grammars is not None)

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    output_ids: list[int] = (), grammar: Grammar | None = None, *,
                    num_speculative_tokens: int | None = None, tree_topk: int | None = None,
                    tree_depth: int | None = None, prefill_only: bool = False, lora: str | None = None) -> None:
        """Queue a request (after :meth:`validate`); ``output_ids`` continue a migrated request.
        ``grammar``: the request's compiled ``params.structured`` (compiled here when not given).
        ``num_speculative_tokens``, ``tree_topk``, ``tree_depth``: this request's speculation (None:
        the engine's settings). ``prefill_only``: a prefill worker's request, which ends after its
        first token with finish reason :data:`HANDOFF`, its blocks kept for a decode worker to pull
        (:class:`.handoff.Handoffs`). ``lora``: the LoRA adapter it runs with (None: the base model)."""
        if lora:
            if self.lora is None:
                raise InvalidRequest("this worker serves no LoRA adapters", field="model")
            self.lora.check(lora)
        seq = self._new_sequence(request_id, token_ids, params, output_ids, grammar, num_speculative_tokens,
                                 tree_topk, tree_depth, lora)
        if seq is not None:
            seq.prefill_only = prefill_only
            self._added.append(seq)  # (until the step loop takes them, or the next step begins)
            if self.tiers is None or not self.scheduler.reuse_cached_prefix or not self.tiers.hold(seq):
                self.scheduler.add(seq)  # (held: queued once its disk-tier blocks are read, see step)

    def _new_sequence(self, request_id: str, token_ids: list[int], params: SamplingParams, output_ids, grammar,
                      num_speculative_tokens, tree_topk, tree_depth, lora: str | None = None) -> Sequence | None:
        """A checked, registered sequence not yet queued; None for a request that ended at once."""
        if request_id in self.seqs or request_id in self.receiving:
            raise InvalidRequest(f"request id {request_id!r} is already running", field="request_id")
        self.validate(token_ids, params, output_ids)
        if params.structured is not None:
            grammar = grammar or self.grammars.grammar(params.structured)
            if not grammar.accept(output_ids):
                raise InvalidRequest("output_ids do not follow the request's grammar", field="output_ids")
        else:
            grammar = None
        if params.max_tokens == 0:
            usage = Usage(len(token_ids), len(output_ids), 0)
            self._immediate.append((request_id, TokenDelta(finish_reason="length", usage=usage)))
            return None
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        generator = None
        if params.seed is not None and not is_greedy(params.temperature):
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(request_id, list(token_ids) + list(output_ids), len(token_ids), len(output_ids), params,
                       frozenset(t for t in stop if 0 <= t < self.vocab_size), generator, grammar=grammar,
                       lora=lora or None, hash_root=chain_root(lora))
        self.seqs[request_id] = seq
        self.spec.add(request_id, num_speculative_tokens, tree_topk, tree_depth)
        return seq

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is not running here. (A request whose KV
        is still being pulled keeps its blocks until :meth:`finish_receive` says the pull ended.)"""
        self.spec.forget(request_id)
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        if request_id not in self.receiving:
            self.scheduler.finish(seq)
        return True

    def load_lora(self, name: str, path: str) -> None:
        """Register a LoRA adapter (raises :class:`.lora.LoraError`). A name served before may now
        have other weights: the prefix cache is cleared then, so no block of the old one is a hit."""
        if self.lora is None:
            raise InvalidRequest("this worker serves no LoRA adapters (start it with --max-loras)", field="lora_name")
        again = name in self.lora.ever_loaded
        self.lora.register(name, path)
        if again:
            self.blocks.clear()

    def unload_lora(self, name: str) -> None:
        """Unregister an adapter no running request uses (raises :class:`.lora.LoraError`)."""
        if self.lora is None:
            raise InvalidRequest("this worker serves no LoRA adapters", field="lora_name")
        users = sum(1 for s in self.seqs.values() if s.lora == name)
        if users:
            raise LoraError(f"adapter {name!r} is in use by {users} requests", "lora_name")
        self.lora.unregister(name)

    def has_work(self) -> bool:
        return (bool(self._immediate or self._joining) or self.scheduler.has_work() or self._pending is not None
                or (self.tiers is not None and bool(self.tiers.held)))

    def attach_tiers(self, tiers) -> None:
        """Keep KV blocks below the device pool (:class:`.kv_tiers.KvTiers`, built over this engine's cache)."""
        self.tiers = tiers
        self.scheduler.tiers = tiers

    # ------------------------------------------------------------------ speculation: the draft worker's side

    @property
    def counters(self):
        """Spec-decode counters per draft worker id."""
        return self.spec.counters

    @property
    def draft_id(self) -> str:
        return self.spec.draft_id

    @draft_id.setter
    def draft_id(self, draft_id: str) -> None:
        self.spec.draft_id = draft_id

    def reset_drafts(self) -> None:
        """A new draft worker knows none of our sequences: start every one from scratch."""
        self.spec.reset()
        self._verdicts.clear()

    def draft_inputs(self, layers: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
                     plane=None) -> list[DraftInput]:
        """Proposal requests for every running sequence that decodes next and speculates, with the
        hidden states of ``layers`` (offered ones; None: all of them) on the CPU in ``dtype``, or,
        given a data ``plane`` (:class:`workers.speculation.hidden_plane.PlaneWriter`), written to it
        as one block and referred to by ``hidden_ref``."""
        if self._pending is not None:  # the draft proposes from the latest tokens: bring them to the host
            self._immediate.extend(self.flush())  # (their deltas come with the next step)
        requests = self.spec.requests(self.scheduler.running, self.max_model_len)
        if not requests:  # the plan drafts nothing (the usual step when drafting does not pay)
            return []
        layers = self.hidden_layers if layers is None else tuple(layers)
        spans = []  # per request: positions whose hidden rows it carries (those before its new tokens)
        for r in requests:
            spans.append((max(r.state.told - 1, 0), len(r.seq) - 1) if layers else (0, 0))
        if plane is not None:
            refs = self._hidden_block([r.seq for r in requests], spans, plane)
            hidden = [[] for _ in requests]
        else:
            hidden = self._hidden_rows([r.seq for r in requests], spans, layers, dtype)
            refs = [None] * len(requests)
        return [self._tell(r.seq, r.state, r.num_tokens, hidden_states=rows, tree_topk=r.state.tree_topk,
                           tree_depth=r.state.tree_depth, max_depth=r.max_depth, hidden_ref=ref)
                for r, rows, ref in zip(requests, hidden, refs)]

    @staticmethod
    def _tell(seq: Sequence, st: SpecState, num_tokens: int, **extra) -> DraftInput:
        """A proposal request for ``seq`` carrying its tokens the draft has not heard of, for the next
        round; the draft has heard of them all from now on."""
        p = seq.params
        request = DraftInput(seq.request_id, st.round, seq.token_ids[st.told :], num_tokens,
                             SamplingSpec(p.temperature, p.top_p, p.top_k, p.seed), **extra)
        st.told = len(seq)
        st.round += 1
        return request

    def take_added(self) -> list[Sequence]:
        """The sequences added since the last call."""
        added, self._added = self._added, []
        return added

    def prompt_inputs(self, added: list[Sequence]) -> list[DraftInput]:
        """Pipelined seam, a draft that needs no hidden states: proposal requests for sequences just
        added (:meth:`take_added`), carrying their prompts, before their prefill runs. The
        draft answers with a proposal that begins with its guess of the prefill's token; when that
        guess comes true, the first decode step verifies the rest instead of decoding plainly (a
        request's first round is otherwise asked only once its prefill has committed that token)."""
        out = []
        for seq in added:
            st = self.spec.states.get(seq.request_id)
            if (st is None or st.told or st.cap <= 0 or st.tree_topk > 1 or seq.prefill_only
                    or seq.num_computed or self.seqs.get(seq.request_id) is not seq):
                continue
            # what the first decode step may verify: none deeper than can still be emitted after the
            # prefill's token and the step's own
            k = min(st.cap, seq.params.max_tokens - seq.num_generated - 2, self.max_model_len - len(seq) - 2)
            if k <= 0:
                continue
            out.append(self._tell(seq, st, k))  # (told nothing yet: the whole prompt)
        return out

    def take_verdicts(self, layers: tuple[int, ...] | None = None, dtype: torch.dtype | None = None,
                      plane=None) -> list[VerifyResult]:
        """The latest steps' verdicts, with the hidden states of ``layers`` (None: all offered), or
        their ``hidden_ref`` on a data ``plane`` (see :meth:`draft_inputs`)."""
        verdicts, self._verdicts = self._verdicts, []
        if not verdicts:  # every step that verified nothing
            return []
        verdicts = [v for v in verdicts if v[0].request_id in self.spec.states]  # finished since: released
        layers = self.hidden_layers if layers is None else tuple(layers)
        spans = [(v[4], v[4] + len(v[3])) if layers else (0, 0) for v in verdicts]
        if plane is not None:
            refs = self._hidden_block([v[0] for v in verdicts], spans, plane)
            return [VerifyResult(seq.request_id, rnd, accepted, emitted, [], ref)
                    for (seq, rnd, accepted, emitted, _), ref in zip(verdicts, refs)]
        hidden = self._hidden_rows([v[0] for v in verdicts], spans, layers, dtype)
        return [VerifyResult(seq.request_id, rnd, accepted, emitted, rows)
                for (seq, rnd, accepted, emitted, _), rows in zip(verdicts, hidden)]

    def offer(self, proposals: list[DraftOutput]) -> None:
        """Pipelined seam: proposals streamed ahead, checked and kept until a step they fit."""
        self.spec.offer(proposals)

    def take_released(self) -> list[str]:
        out, self.spec.released = self.spec.released, []
        return out

    def _hidden_rows(self, seqs: list[Sequence], spans: list[tuple[int, int]], layers: tuple[int, ...],
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

    def _slots(self, seqs: list[Sequence], spans: list[tuple[int, int]]) -> torch.Tensor:
        """The cache slots of positions [start, stop) of each sequence, concatenated: [sum of spans] long."""
        bs = self.config.block_size
        slots: list[int] = []
        for seq, (start, stop) in zip(seqs, spans):  # a range per block, not a Python step per position
            for b in range(start // bs, -(-stop // bs)):
                base = seq.block_table[b] * bs
                slots.extend(range(base + max(start - b * bs, 0), base + min(stop - b * bs, bs)))
        return torch.tensor(slots, dtype=torch.long, device=self.runner.device)

    def _hidden_block(self, seqs: list[Sequence], spans: list[tuple[int, int]], plane) -> list:
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

    # ------------------------------------------------------------------ stepping

    def step(self, proposals: dict[str, DraftOutput] | None = None) -> list[tuple[str, TokenDelta]]:
        """One scheduling step and forward pass, verifying ``proposals`` (by request id) for the
        sequences that decode next; returns (request id, delta) pairs."""
        started = time.perf_counter()
        outputs, self._immediate = self._immediate, []
        self._added.clear()  # their prefill starts now: too late to tell the draft their prompts first
        self.last_batch = []
        self.last_step = StepStats()
        if self._pending is not None and (proposals or self.spec.staged):  # verify steps run on host-known tokens
            outputs.extend(self.flush())
        drafted = self.spec.attach(proposals or {}, self.scheduler.running, self.max_model_len, self.grammars)
        batch = self.scheduler.schedule()
        self.last_batch = [s.request_id for s in batch.seqs]
        self._fit_drafts(drafted, batch)
        if batch:
            outputs.extend(self._run(batch, drafted))
        else:
            outputs.extend(self.flush())
        stats = self.last_step
        if self.time_steps:
            self.spec.observe_cycle(stats.tokens, stats.verified, stats.decoding, stats.emitted,
                                    time.perf_counter() - started)
        self._join_received()
        if self.tiers is not None:  # blocks computed in this step go down; sequences whose disk reads ended queue
            for seq in self.tiers.after_step(idle=not batch):
                if self.seqs.get(seq.request_id) is seq:
                    self.scheduler.add(seq)
        return outputs

    def _join_received(self) -> None:
        """Sequences whose pulled prompt is in place join the running batch after a step, as a
        sequence does after its local prefill step: a draft is asked for them before they decode."""
        joining, self._joining = self._joining, []
        for seq in joining:
            if self.seqs.get(seq.request_id) is seq:  # not aborted meanwhile
                seq.status = SeqStatus.RUNNING
                self.scheduler.running.append(seq)

    def observe_cycle(self, seconds: float, asked: bool = False) -> None:
        """Feed the cost model the latest step as part of a serving cycle that took ``seconds``
        (``asked``: proposals were asked for that step, whether or not they came in time)."""
        s = self.last_step
        self.spec.observe_cycle(s.tokens, s.verified, s.decoding, s.emitted, seconds, asked)

    @staticmethod
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

    def _run(self, batch: ScheduledBatch, drafted: dict[str, Drafted]) -> list[tuple[str, TokenDelta]]:
        bs = self.config.block_size
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
                self._register_blocks(s, bs)
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
            return self._defer(plain, scores, greedy, out.logits)
        previous = self.flush()  # async scheduling: the step before, while this one runs
        outputs = self._sample(plain, scores, greedy, out.logits) if plain else []
        if verified:
            outputs.extend(self._verify(verified, scores, greedy, out.logits))
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
            if st is not None and st.gamma > 0:
                return False
        return True

    def _defer(self, plain: list[tuple[Sequence, int]], scores: torch.Tensor, greedy: list[bool],
               logits: torch.Tensor) -> list[tuple[str, TokenDelta]]:
        """Sample on the device and leave the tokens there for the next step (:class:`PendingStep`);
        returns the deltas of the step before, whose bookkeeping runs now (:meth:`flush`)."""
        seqs = [s for s, _ in plain]
        tokens = self._draw(plain, scores, greedy)
        asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        found = None
        if asking:
            rows = torch.tensor([plain[i][1] for i in asking], device=logits.device)
            picked = tokens.index_select(0, torch.tensor(asking, device=tokens.device))
            found = logprobs_of(logits.index_select(0, rows), picked, max(seqs[i].params.logprobs for i in asking))
        launched = PendingStep.launch(seqs, tokens, asking, found)
        for s in seqs:
            s.num_pending += 1
            # its new token ends it whatever it is: schedule nothing after it
            s.ends_at_pending = (s.num_generated + s.num_pending >= s.params.max_tokens
                                 or len(s) + s.num_pending >= self.max_model_len or s.prefill_only)
        previous = self.flush()
        self._pending = launched
        return previous

    def flush(self) -> list[tuple[str, TokenDelta]]:
        """Finish the pending step (async scheduling): wait for its tokens on the host and do its
        bookkeeping (append, finish checks, prefix-cache registration, deltas); returns its deltas,
        [] when no step is pending. A sequence that finished or was aborted meanwhile drops its token
        (the step was launched before the host knew); a preempted one keeps it (it recomputes)."""
        p, self._pending = self._pending, None
        if p is None:
            return []
        tokens, found = p.wait()
        lp = iter(self._logprob_lists(found, [(p.seqs[i].params.logprobs, 1) for i in p.asking]) if found else [])
        bs = self.config.block_size
        outputs = []
        for seq, token in zip(p.seqs, tokens):
            seq.num_pending -= 1
            if not seq.num_pending:
                seq.ends_at_pending = False
            logprobs, top = next(lp) if seq.params.logprobs is not None else (None, None)
            if seq.status is SeqStatus.FINISHED:
                continue
            self._append(seq, token)
            finish = self._finish_reason(seq, token)
            # the KV of every token before it is computed (a finishing token's never is); done before
            # _close frees the blocks, so the prefix cache keeps what the synchronous engine keeps
            self._register_blocks(seq, bs, len(seq) - 1 if finish else len(seq))
            usage = self._close(seq) if finish else None
            outputs.append((seq.request_id, TokenDelta([token], logprobs, top, finish, usage)))
        return outputs

    def _register_blocks(self, seq: Sequence, bs: int, upto: int | None = None) -> None:
        """Offer the full blocks among the first ``upto`` tokens (default: all known ones) whose KV is
        computed to the prefix cache."""
        upto = min(seq.num_computed, len(seq) if upto is None else upto)
        full = upto // bs
        if full > seq.num_registered:
            hashes = seq.full_block_hashes(bs, upto)
            start = seq.num_registered
            parent = hashes[start - 1] if start else 0
            self.blocks.register(seq.block_table[start:full], hashes[start:full], parent)
            if self.tiers is not None:
                self.tiers.computed(seq.block_table[start:full], hashes[start:full], parent,
                                    seq.token_ids[start * bs : full * bs])
            seq.num_registered = full

    def _append(self, seq: Sequence, token: int) -> None:
        """A generated token joins ``seq``; its first one ends the prefill phase (vLLM's
        request_prefill_time: from first scheduled to first token)."""
        seq.token_ids.append(token)
        seq.num_generated += 1
        if seq.num_generated == 1 and seq.scheduled_at is not None:
            self.prefill_time.observe(time.monotonic() - seq.scheduled_at)

    @staticmethod
    def _draw(plain: list[tuple[Sequence, int]], scores: torch.Tensor, greedy: list[bool]) -> torch.Tensor:
        """One token per plain sequence ([B] long, on the scores' device)."""
        index = [r for _, r in plain]
        every = len(index) == scores.shape[0]  # a decode-only step: no gather
        picked = scores if every else scores[index]
        return sample(picked, [greedy[r] for r in index], [s.generator for s, _ in plain])

    def _sample(self, plain: list[tuple[Sequence, int]], scores: torch.Tensor, greedy: list[bool],
                logits: torch.Tensor) -> list[tuple[str, TokenDelta]]:
        seqs = [s for s, _ in plain]
        index = [r for _, r in plain]
        tokens = self._draw(plain, scores, greedy).tolist()
        asking = [i for i, s in enumerate(seqs) if s.params.logprobs is not None]
        lp = iter(self._logprobs(logits, [index[i] for i in asking], [tokens[i] for i in asking],
                                 [(seqs[i].params.logprobs, 1) for i in asking]))
        outputs = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            logprobs, top = next(lp) if seq.params.logprobs is not None else (None, None)
            if seq.status is SeqStatus.FINISHED:
                continue  # async scheduling: it finished at the step before, which the host saw after this launch
            if seq.grammar is not None:
                seq.grammar.accept((token,))
            self._append(seq, token)
            finish = self._finish_reason(seq, token)
            usage = self._close(seq) if finish else None
            outputs.append((seq.request_id, TokenDelta([token], logprobs, top, finish, usage)))
        return outputs

    def _verify(self, verified: list[tuple[Drafted, int]], scores: torch.Tensor, greedy: list[bool],
                logits: torch.Tensor) -> list[tuple[str, TokenDelta]]:
        candidates = [Candidate(d.tokens, d.parents, d.dists, row, greedy[row], d.seq.generator) for d, row in verified]
        outcomes = verify(scores, candidates)
        bs = self.config.block_size
        moves: list[tuple[int, int]] = []  # (src, dst) slots of accepted tree paths, for the whole batch
        copies: list[tuple[int, int]] = []  # copy-on-write blocks after rollbacks
        lp_rows: list[int] = []
        lp_tokens: list[int] = []
        lp_counts: list[tuple[int, int]] = []  # (top-k asked, rows) per sequence that wants logprobs
        results = []
        for (d, root), outcome in zip(verified, outcomes):
            seq, accepted = d.seq, len(outcome.path)
            base = len(seq) - len(d.tokens)  # committed length before this round
            table = seq.block_table
            for j, i in enumerate(outcome.path):
                if i != j:  # a tree path: its KV (and hidden rows) move to consecutive positions
                    src, dst = base + i, base + j
                    moves.append((table[src // bs] * bs + src % bs, table[dst // bs] * bs + dst % bs))
            del seq.token_ids[base:]
            kept, finish = [], None
            for token in outcome.tokens:
                kept.append(token)
                self._append(seq, token)
                finish = self._finish_reason(seq, token)
                if finish:
                    break
            if seq.grammar is not None:
                seq.grammar.accept(kept)
            seq.num_computed = min(base + accepted, len(seq))
            copies.extend(self.blocks.truncate(seq.block_table, seq.num_computed))
            self._register_blocks(seq, bs)
            st = self.spec.record(d, accepted)
            if seq.params.logprobs is not None:
                lp_rows.extend(([root] + [root + 1 + i for i in outcome.path])[: len(kept)])
                lp_tokens.extend(kept)
                lp_counts.append((seq.params.logprobs, len(kept)))
            results.append((d, seq, kept, finish, accepted, base, st))
        if moves:
            src = torch.tensor([s for s, _ in moves], device=self.runner.device)
            dst = torch.tensor([t for _, t in moves], device=self.runner.device)
            self.runner.copy_slots(src, dst)
            if self.hidden is not None:
                self.hidden.copy(src, dst)
        self.runner.copy_blocks(copies)
        lp = iter(self._logprobs(logits, lp_rows, lp_tokens, lp_counts))
        outputs = []
        for d, seq, kept, finish, accepted, base, st in results:
            logprobs, top = next(lp) if seq.params.logprobs is not None else (None, None)
            usage = None
            if finish:
                usage = self._close(seq)
            else:
                # verdict: accepted count, emitted tokens, hidden rows of positions base - 1 .. (read later)
                self._verdicts.append((seq, st.round - 1, accepted, kept, base - 1))
                st.told = len(seq)
            outputs.append((seq.request_id, TokenDelta(kept, logprobs, top, finish, usage)))
        return outputs

    @staticmethod
    def _logprobs(logits: torch.Tensor, rows: list[int], tokens: list[int], counts: list[tuple[int, int]]):
        """(logprobs, top logprobs) per sequence that asked for them, in order, from the raw model
        distribution (logits [R, V]); ``counts[i]`` = (top-k it asked for, how many of the concatenated
        ``rows`` and ``tokens`` are its: 1 for a plain step, the root and accepted nodes for a verified one)."""
        if not counts:
            return []
        k = max(n for n, _ in counts)
        found = logprobs_of(logits[rows], torch.tensor(tokens, device=logits.device), k)
        return Engine._logprob_lists(tuple(t.tolist() for t in found), counts)

    @staticmethod
    def _logprob_lists(found: tuple[list, list, list], counts: list[tuple[int, int]]):
        """:meth:`_logprobs`' result from (chosen, top ids, top logprobs) already on the host."""
        chosen, top_ids, top_vals = found
        out, at = [], 0
        for n, count in counts:
            span = range(at, at + count)
            top = [[TopLogprob(t, v) for t, v in zip(top_ids[j][:n], top_vals[j][:n])] for j in span] if n else None
            out.append(([chosen[j] for j in span], top))
            at += count
        return out

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """The one finish rule, checked after each token ``token`` is appended to ``seq``: a stop
        token once ``min_tokens`` are out, else max_tokens or the context length."""
        if token in seq.stop_ids and seq.num_generated >= seq.params.min_tokens:
            return "stop"
        if seq.num_generated >= seq.params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        if seq.prefill_only:
            seq.handed_off = True
            return HANDOFF
        return None

    def _close(self, seq: Sequence) -> Usage:
        """Remove a finished sequence (its blocks are freed); returns its usage."""
        spec = self.spec.usage(seq.request_id)
        self.spec.forget(seq.request_id)
        self.seqs.pop(seq.request_id, None)
        if seq.handed_off:
            self.handoffs.park(seq)  # its blocks stay for the decode worker: the scheduler frees none
        self.scheduler.finish(seq)
        return Usage(seq.num_prompt_tokens, seq.num_prefilled_outputs + seq.num_generated,
                     max(seq.num_cached_tokens, 0), spec)

    # ------------------------------------------------------------------ prefill/decode disaggregation

    def receive(self, request_id: str, token_ids: list[int], params: SamplingParams, output_ids: list[int],
                handoff: KvHandoff, grammar: Grammar | None = None, *, num_speculative_tokens: int | None = None,
                tree_topk: int | None = None, tree_depth: int | None = None) -> Receiving | None:
        """Admit a request whose prompt a prefill worker computed (decode side).

        Takes this engine's cached prefix of the handed-off positions and fresh blocks for the rest,
        and returns what to pull into which blocks (:class:`Receiving`); the sequence waits outside
        the scheduler until :meth:`finish_receive`. None when the request ended at once, or when
        there is no room for its blocks: it is then queued to prefill here like any other.
        """
        n = handoff.num_tokens
        if not 0 < n < len(token_ids) + len(output_ids) or len(handoff.block_ids) != -(-n // self.config.block_size):
            raise InvalidRequest(f"kv_transfer covers {n} tokens in {len(handoff.block_ids)} blocks of a request of "
                                 f"{len(token_ids) + len(output_ids)}", field="kv_transfer")
        seq = self._new_sequence(request_id, token_ids, params, output_ids, grammar, num_speculative_tokens,
                                 tree_topk, tree_depth)
        if seq is None:
            return None
        bs = self.config.block_size
        hits = self.blocks.match_prefix(seq.full_block_hashes(bs, n))
        need = -(-n // bs) - len(hits)
        reclaimed = sum(1 for b in hits if self.blocks.ref_count[b] == 0)
        if not self.blocks.can_allocate(need + reclaimed):
            self.scheduler.add(seq)
            return None
        self.blocks.acquire(hits)
        seq.block_table = hits + self.blocks.allocate(need)
        seq.num_registered = len(hits)
        seq.num_cached_tokens = len(hits) * bs
        receiving = Receiving(seq, n, len(hits), seq.block_table[len(hits):], handoff.block_ids[len(hits):])
        self.receiving[request_id] = receiving
        return receiving

    def finish_receive(self, request_id: str, ok: bool, quarantine: bool = False) -> None:
        """The pull of ``request_id``'s KV ended. ``ok``: the sequence runs from here, its prompt
        computed. Else it prefills here (recomputes); ``quarantine``: the failed pull may still land
        in its blocks later, so they are never reused (counted in ``quarantined_blocks``)."""
        r = self.receiving.pop(request_id)
        seq = r.seq
        if quarantine:
            kept = len(seq.block_table) - r.first_block
            self.quarantined_blocks += kept
            log.error("request %s: a KV pull that could not be cancelled: %d blocks taken out of use",
                      request_id, kept)
            self.blocks.free(seq.block_table[: r.first_block])
            seq.block_table = []
        if self.seqs.get(request_id) is not seq:  # aborted meanwhile
            self.scheduler.finish(seq)
            return
        if ok:
            seq.num_computed = r.num_tokens
            self._register_blocks(seq, self.config.block_size)
            self._joining.append(seq)  # runs from the next step (see _join_received)
            return
        self.scheduler.finish(seq)
        seq.reset_for_recompute()
        seq.num_cached_tokens = -1
        self.scheduler.add(seq)

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


@dataclass
class StepStats:
    """What the latest step ran: query tokens of a decode/verify step (0 when it had prefill
    chunks), sequences verified, sequences in the batch, tokens emitted."""

    tokens: int = 0
    verified: int = 0
    decoding: int = 0
    emitted: int = 0

