"""A sequence's tokens committed: the one finish rule, prefix-cache registration, and closing.

Every path that emits tokens (a plain step, a verified draft, a deferred step's bookkeeping under
async scheduling) commits them here, one token at a time, so the finish rule and what the prefix
cache and the KV tiers are offered never differ between them.
"""

from __future__ import annotations

import time

from runtime.histogram import REQUEST_LATENCY_BUCKETS, histogram
from runtime.messages import Usage

from .block_manager import BlockManager
from .handoff import Handoffs
from .scheduler import Scheduler
from .sequence import Sequence
from .speculator import Speculator

HANDOFF = "handoff"  # a prefill-only request's finish reason: its KV waits for a decode worker (see KvHandoff)


class Commits:
    """Commits tokens to the sequences of one engine (``seqs``: the running ones, by request id)."""

    def __init__(self, seqs: dict[str, Sequence], blocks: BlockManager, scheduler: Scheduler, spec: Speculator,
                 handoffs: Handoffs, max_model_len: int):
        self.seqs = seqs
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.scheduler = scheduler
        self.spec = spec
        self.handoffs = handoffs
        self.max_model_len = max_model_len
        self.tiers = None  # KV tiers below the device pool, offered every computed full block
        self.prefill_time = histogram(REQUEST_LATENCY_BUCKETS)  # first scheduled to first token, per request

    def attach_tiers(self, tiers) -> None:
        self.tiers = tiers

    def append(self, seq: Sequence, token: int) -> str | None:
        """A generated token joins ``seq`` (its first one ends the prefill phase: vLLM's
        request_prefill_time, from first scheduled to first token); returns its finish reason."""
        seq.token_ids.append(token)
        seq.num_generated += 1
        if seq.num_generated == 1 and seq.scheduled_at is not None:
            self.prefill_time.observe(time.monotonic() - seq.scheduled_at)
        return self.finish_reason(seq, token)

    def finish_reason(self, seq: Sequence, token: int) -> str | None:
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

    def register_blocks(self, seq: Sequence, upto: int | None = None) -> None:
        """Offer the full blocks among the first ``upto`` tokens (default: all known ones) whose KV is
        computed to the prefix cache (and the KV tiers)."""
        bs = self.block_size
        upto = min(seq.num_computed, len(seq) if upto is None else upto)
        full = upto // bs
        if full > seq.num_registered:
            hashes = seq.full_block_hashes(bs, upto)
            start = seq.num_registered
            parent = hashes[start - 1] if start else 0
            self.blocks.register(seq.block_table[start:full], hashes[start:full], parent)
            if self.tiers is not None:
                self.tiers.computed(seq.block_table[start:full], hashes[start:full], parent,
                                    seq.token_ids[start * bs : full * bs], seq.priority)
            seq.num_registered = full

    def close(self, seq: Sequence) -> Usage:
        """Remove a finished sequence (its blocks are freed, or parked for a decode worker when it
        was handed off); returns its usage."""
        spec = self.spec.usage(seq.request_id)
        self.spec.forget(seq.request_id)
        self.seqs.pop(seq.request_id, None)
        if seq.handed_off:
            self.handoffs.park(seq)  # its blocks stay for the decode worker: the scheduler frees none
        self.scheduler.finish(seq)
        return Usage(seq.num_prompt_tokens, seq.num_prefilled_outputs + seq.num_generated,
                     max(seq.num_cached_tokens, 0), spec)
