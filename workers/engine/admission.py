"""Admission: a request checked, turned into a :class:`.sequence.Sequence` and queued, or aborted;
LoRA adapters loaded and unloaded; on a decode worker, a request whose prompt a prefill worker
computed admitted with the blocks its KV is pulled into (:class:`.handoff.Receiving`).
"""

from __future__ import annotations

import logging

import torch

from runtime.errors import InvalidRequest
from runtime.kv_hash import chain_root
from runtime.messages import KvHandoff, SamplingParams, TokenDelta, Usage
from runtime.validation import validate_request

from .block_manager import BlockManager
from .commits import Commits
from .grammar import Grammar, GrammarBackend
from .handoff import Receiving
from .lora import LoraError, LoraManager
from .sampling import is_greedy
from .scheduler import Scheduler
from .sequence import Sequence, SeqStatus
from .speculator import Speculator

log = logging.getLogger(__name__)


class Admission:
    """Requests in and out of one engine (``seqs``: the running ones, by request id)."""

    def __init__(self, seqs: dict[str, Sequence], spec: Speculator, blocks: BlockManager, scheduler: Scheduler,
                 commits: Commits, *, vocab_size: int, max_model_len: int, eos_token_ids: frozenset[int],
                 grammars: GrammarBackend | None, lora: LoraManager | None, device: torch.device):
        self.seqs = seqs
        self.spec = spec
        self.blocks = blocks
        self.scheduler = scheduler
        self.commits = commits
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.grammars = grammars  # structured outputs (None: requests with a grammar are refused)
        self.lora = lora
        self.device = device
        self.tiers = None  # KV tiers below the device pool: a request may wait for its disk-tier blocks
        self.immediate: list[tuple[str, TokenDelta]] = []  # requests that ended at once (max_tokens 0)
        self.added: list[Sequence] = []  # sequences added since the step loop last took them
        self.receiving: dict[str, Receiving] = {}
        self.joining: list[Sequence] = []  # received sequences that join the running batch after a step
        self.quarantined_blocks = 0

    def attach_tiers(self, tiers) -> None:
        self.tiers = tiers

    def validate(self, token_ids: list[int], params: SamplingParams, output_ids: list[int] = ()) -> None:
        """Raise :class:`InvalidRequest` (naming the field) for a request the engine cannot serve."""
        validate_request(token_ids, params, output_ids, vocab_size=self.vocab_size, max_model_len=self.max_model_len,
                         structured_outputs=self.grammars is not None)

    def add(self, request_id: str, token_ids: list[int], params: SamplingParams, output_ids: list[int],
            grammar: Grammar | None, speculation: tuple, prefill_only: bool, lora: str | None, priority: int = 0) -> None:
        """Queue a request (see ``Engine.add_request``); ``speculation``: (γ, tree top-k, tree depth[, draft hint])."""
        if lora:
            if self.lora is None:
                raise InvalidRequest("this worker serves no LoRA adapters", field="model")
            self.lora.check(lora)
        seq = self.new_sequence(request_id, token_ids, params, output_ids, grammar, speculation, lora)
        if seq is not None:
            seq.prefill_only = prefill_only
            seq.priority = priority if self.scheduler.by_priority else 0  # fcfs: no priority anywhere
            self.added.append(seq)  # (until the step loop takes them, or the next step begins)
            if self.tiers is None or not self.scheduler.reuse_cached_prefix or not self.tiers.hold(seq):
                self.scheduler.add(seq)  # (held: queued once its disk-tier blocks are read, see Engine.step)

    def new_sequence(self, request_id: str, token_ids: list[int], params: SamplingParams, output_ids, grammar,
                     speculation: tuple, lora: str | None = None) -> Sequence | None:
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
            self.immediate.append((request_id, TokenDelta(finish_reason="length", usage=usage)))
            return None
        stop = set(params.stop_token_ids) | (set() if params.ignore_eos else self.eos_token_ids)
        generator = None
        if params.seed is not None and not is_greedy(params.temperature):
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        seq = Sequence(request_id, list(token_ids) + list(output_ids), len(token_ids), len(output_ids), params,
                       frozenset(t for t in stop if 0 <= t < self.vocab_size), generator, grammar=grammar,
                       lora=lora or None, hash_root=chain_root(lora))
        self.seqs[request_id] = seq
        self.spec.add(request_id, *speculation, lora=lora or "")
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

    # ------------------------------------------------------------------ LoRA adapters

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

    # ------------------------------------------------------------------ prefill/decode disaggregation

    def receive(self, request_id: str, token_ids: list[int], params: SamplingParams, output_ids: list[int],
                handoff: KvHandoff, grammar: Grammar | None, speculation: tuple) -> Receiving | None:
        """Admit a request whose prompt a prefill worker computed (decode side).

        Takes this engine's cached prefix of the handed-off positions and fresh blocks for the rest,
        and returns what to pull into which blocks (:class:`Receiving`); the sequence waits outside
        the scheduler until :meth:`finish_receive`. None when the request ended at once, or when
        there is no room for its blocks: it is then queued to prefill here like any other.
        """
        n, bs = handoff.num_tokens, self.blocks.block_size
        if not 0 < n < len(token_ids) + len(output_ids) or len(handoff.block_ids) != -(-n // bs):
            raise InvalidRequest(f"kv_transfer covers {n} tokens in {len(handoff.block_ids)} blocks of a request of "
                                 f"{len(token_ids) + len(output_ids)}", field="kv_transfer")
        seq = self.new_sequence(request_id, token_ids, params, output_ids, grammar, speculation)
        if seq is None:
            return None
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
        """The pull of ``request_id``'s KV ended. ``ok``: the sequence runs from the next step, its
        prompt computed. Else it prefills here (recomputes); ``quarantine``: the failed pull may
        still land in its blocks later, so they are never reused (counted in ``quarantined_blocks``)."""
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
            self.commits.register_blocks(seq)
            self.joining.append(seq)  # runs from the next step (see join_received)
            return
        self.scheduler.finish(seq)
        seq.reset_for_recompute()
        seq.num_cached_tokens = -1
        self.scheduler.add(seq)

    def join_received(self) -> None:
        """Sequences whose pulled prompt is in place join the running batch after a step, as a
        sequence does after its local prefill step: a draft is asked for them before they decode."""
        joining, self.joining = self.joining, []
        for seq in joining:
            if self.seqs.get(seq.request_id) is seq:  # not aborted meanwhile
                seq.status = SeqStatus.RUNNING
                self.scheduler.running.append(seq)
