"""The engine: requests in, token deltas out, one :meth:`Engine.step` at a time.

Synchronous and single-threaded by design: the worker runs it in one dedicated thread so torch
never blocks the asyncio loop. Each step schedules a batch (continuous batching, chunked
prefill, preemption), runs one forward pass, registers newly computed full blocks with the
prefix cache, samples, and returns one :class:`TokenDelta` per request that produced a token or
finished. The last delta of a request carries ``finish_reason`` and ``usage``.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch

from runtime.errors import InvalidRequest
from runtime.messages import KvEvent, SamplingParams, SpecUsage, TokenDelta, TopLogprob, Usage

from .block_manager import BlockManager
from .cuda_graphs import GraphConfig
from .grammar import Grammar, GrammarBackend
from .model import DecoderModel
from .model_runner import ModelRunner
from .sampling import apply_token_bitmask, is_greedy, logprobs_of, mask_tokens, sample
from .scheduler import Scheduler
from .sequence import Sequence

log = logging.getLogger(__name__)

MAX_LOGPROBS = 20


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


class Engine:
    """Owns the scheduler, block manager and model runner of one model."""

    def __init__(self, model: DecoderModel, config: EngineConfig = EngineConfig(), worker_id: str = "",
                 eos_token_ids: tuple[int, ...] | None = None, grammars: GrammarBackend | None = None):
        cfg = model.cfg
        max_len = min(config.max_model_len or cfg.max_position_embeddings, model.max_positions)
        if cfg.sliding_window and max_len > cfg.sliding_window:
            log.warning("capping max_model_len to the sliding window (%d)", cfg.sliding_window)
            max_len = cfg.sliding_window
        num_blocks = config.num_blocks or max(1, config.kv_cache_bytes // ModelRunner.bytes_per_block(model, config.block_size))
        if num_blocks * config.block_size < max_len:
            if config.max_model_len is not None:
                raise ValueError(f"{num_blocks} blocks of {config.block_size} cannot hold max_model_len={max_len}")
            max_len = num_blocks * config.block_size
        self.config = config
        self.max_model_len = max_len
        self.vocab_size = cfg.vocab_size
        self.eos_token_ids = frozenset(cfg.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.blocks = BlockManager(num_blocks, config.block_size, worker_id, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.blocks, config.max_num_seqs, config.max_num_batched_tokens)
        self.runner = ModelRunner(model, num_blocks, config.block_size, self._graph_config(model), max_len)
        self.grammars = grammars  # structured outputs (None: requests with a grammar are refused)
        self.seqs: dict[str, Sequence] = {}
        self._immediate: list[tuple[str, TokenDelta]] = []
        log.info("engine: %d blocks of %d tokens, max_model_len %d", num_blocks, config.block_size, max_len)

    def _graph_config(self, model: DecoderModel) -> GraphConfig | None:
        """CUDA graphs for decode steps where they apply (CUDA, tensor-only attention)."""
        cfg = self.config
        if not (cfg.cuda_graphs and next(model.parameters()).is_cuda and model.static_capable):
            return None
        return GraphConfig(cfg.cuda_graph_max_batch or cfg.max_num_seqs, self._graph_query_lens(),
                           self._graph_hidden_layers())

    def _graph_query_lens(self) -> tuple[int, ...]:
        return (1,)

    def _graph_hidden_layers(self) -> tuple[int, ...]:
        return ()

    # ------------------------------------------------------------------ requests

    def validate(self, token_ids: list[int], params: SamplingParams, output_ids: list[int] = ()) -> None:
        """Raise :class:`InvalidRequest` (naming the field) for a request the engine cannot serve."""
        if not token_ids:
            raise InvalidRequest("the prompt has no tokens", field="prompt")
        if any(not 0 <= t < self.vocab_size for t in token_ids) or any(not 0 <= t < self.vocab_size for t in output_ids):
            raise InvalidRequest(f"token ids must be in [0, {self.vocab_size})", field="prompt")
        length = len(token_ids) + len(output_ids)
        if length >= self.max_model_len:
            raise InvalidRequest(f"the prompt ({length} tokens) does not fit the context length of "
                                 f"{self.max_model_len}", field="prompt")
        if params.max_tokens < 0:
            raise InvalidRequest(f"max_tokens must be >= 0, got {params.max_tokens}", field="max_tokens")
        if length + params.max_tokens > self.max_model_len:
            raise InvalidRequest(f"prompt ({length} tokens) plus max_tokens ({params.max_tokens}) exceeds the "
                                 f"context length of {self.max_model_len}", field="max_tokens")
        if not math.isfinite(params.temperature) or params.temperature < 0:
            raise InvalidRequest(f"temperature must be >= 0, got {params.temperature}", field="temperature")
        if not 0 < params.top_p <= 1:
            raise InvalidRequest(f"top_p must be in (0, 1], got {params.top_p}", field="top_p")
        if params.top_k < 0:
            raise InvalidRequest(f"top_k must be >= 0, got {params.top_k}", field="top_k")
        if not 0 <= params.min_tokens <= params.max_tokens:
            raise InvalidRequest(f"min_tokens must be in [0, max_tokens], got {params.min_tokens}", field="min_tokens")
        if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
            raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {params.logprobs}", field="logprobs")
        if params.structured is not None:
            if self.grammars is None:
                raise InvalidRequest("this worker does not support structured outputs", field="response_format")
            # a finished grammar allows only EOS: it must end the output, and may not be banned
            if params.ignore_eos:
                raise InvalidRequest("ignore_eos cannot be combined with structured outputs", field="ignore_eos")
            if params.min_tokens:
                raise InvalidRequest("min_tokens cannot be combined with structured outputs", field="min_tokens")

    def add_request(self, request_id: str, token_ids: list[int], params: SamplingParams,
                    output_ids: list[int] = (), grammar: Grammar | None = None) -> None:
        """Queue a request (after :meth:`validate`); ``output_ids`` continue a migrated request.
        ``grammar``: the request's compiled ``params.structured`` (compiled here when not given)."""
        if request_id in self.seqs:
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
            return
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        generator = None
        if params.seed is not None and not is_greedy(params.temperature):
            generator = torch.Generator(device=self.runner.device).manual_seed(params.seed)
        seq = Sequence(request_id, list(token_ids) + list(output_ids), len(token_ids), len(output_ids), params,
                       frozenset(t for t in stop if 0 <= t < self.vocab_size), generator, grammar=grammar)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)

    def abort(self, request_id: str) -> bool:
        """Drop a request and free its blocks; False if it is not running here."""
        seq = self.seqs.pop(request_id, None)
        if seq is None:
            return False
        self.scheduler.finish(seq)
        return True

    def has_work(self) -> bool:
        return bool(self._immediate) or self.scheduler.has_work()

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[tuple[str, TokenDelta]]:
        """One scheduling step and forward pass; returns (request id, delta) pairs."""
        outputs, self._immediate = self._immediate, []
        batch = self.scheduler.schedule()
        if not batch:
            return outputs
        bs = self.config.block_size
        sampling = [s.num_computed + n == len(s) for s, n in zip(batch.seqs, batch.num_tokens)]
        chunks = [(s.token_ids[s.num_computed : s.num_computed + n], s.num_computed, s.block_table)
                  for s, n in zip(batch.seqs, batch.num_tokens)]
        out = self.runner.forward(chunks, [1 if w else 0 for w in sampling])
        for seq, n in zip(batch.seqs, batch.num_tokens):
            seq.num_computed += n
            self._register_blocks(seq, bs)
        sampled = [s for s, w in zip(batch.seqs, sampling) if w]
        if sampled:
            outputs.extend(self._sample(sampled, out.logits))
        return outputs

    def _register_blocks(self, seq: Sequence, bs: int) -> None:
        full = seq.num_computed // bs
        if full > seq.num_registered:
            hashes = seq.full_block_hashes(bs, seq.num_computed)
            start = seq.num_registered
            parent = hashes[start - 1] if start else 0
            self.blocks.register(seq.block_table[start:full], hashes[start:full], parent)
            seq.num_registered = full

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor) -> list[tuple[str, TokenDelta]]:
        # logits [B, V] float32, one row per sequence
        params = [s.params for s in seqs]
        raw = logits
        banned = [(i, sorted(s.stop_ids)) for i, s in enumerate(seqs) if s.num_generated < s.params.min_tokens]
        if banned:
            logits = mask_tokens(logits.clone(), [i for i, _ in banned], [ids for _, ids in banned])
        guided = [i for i, s in enumerate(seqs) if s.grammar is not None]
        if guided:  # structured outputs: each such row keeps only what its grammar allows next
            masks = self.grammars.new_masks(len(guided))
            for j, i in enumerate(guided):
                seqs[i].grammar.fill(masks[j])
            logits = apply_token_bitmask(logits.clone() if logits is raw else logits, masks,
                                         None if len(guided) == len(seqs) else guided)
        if all(is_greedy(p.temperature) for p in params):  # no sampling tensors to send up, one sync
            tokens = logits.argmax(dim=-1).tolist()
        else:
            temperature = torch.tensor([p.temperature for p in params], device=logits.device)
            top_k = torch.tensor([p.top_k for p in params], dtype=torch.long, device=logits.device)
            top_p = torch.tensor([p.top_p for p in params], device=logits.device)
            tokens = sample(logits, temperature, top_k, top_p, [s.generator for s in seqs]).tolist()
        want_lp = [p.logprobs is not None for p in params]
        lp = None
        if any(want_lp):
            k = max(p.logprobs or 0 for p in params)
            chosen, top_ids, top_vals = logprobs_of(raw, torch.tensor(tokens, device=raw.device), k)
            lp = (chosen.tolist(), top_ids.tolist(), top_vals.tolist())
        for i in guided:
            seqs[i].grammar.accept((tokens[i],))
        outputs = []
        for i, (seq, token) in enumerate(zip(seqs, tokens)):
            seq.token_ids.append(token)
            seq.num_generated += 1
            finish = self._finish_reason(seq, token)
            logprobs = top = None
            if lp is not None and want_lp[i]:
                k = seq.params.logprobs
                logprobs = [lp[0][i]]
                top = [[TopLogprob(t, v) for t, v in zip(lp[1][i][:k], lp[2][i][:k])]] if k else None
            usage = self._close(seq) if finish else None
            outputs.append((seq.request_id, TokenDelta([token], logprobs, top, finish, usage)))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int) -> str | None:
        """The one finish rule, checked after each token ``token`` is appended to ``seq``: a stop
        token once ``min_tokens`` are out, else max_tokens or the context length."""
        if token in seq.stop_ids and seq.num_generated >= seq.params.min_tokens:
            return "stop"
        if seq.num_generated >= seq.params.max_tokens or len(seq) >= self.max_model_len:
            return "length"
        return None

    def _close(self, seq: Sequence, spec: SpecUsage | None = None) -> Usage:
        """Remove a finished sequence (its blocks are freed); returns its usage."""
        self.seqs.pop(seq.request_id, None)
        self.scheduler.finish(seq)
        return Usage(seq.num_prompt_tokens, seq.num_prefilled_outputs + seq.num_generated,
                     max(seq.num_cached_tokens, 0), spec)

    # ------------------------------------------------------------------ introspection

    def drain_kv_events(self) -> list[KvEvent]:
        return self.blocks.drain_events()

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
