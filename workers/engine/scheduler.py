"""Continuous batching: which sequences run in the next step, and with how many tokens.

Each step has a token budget. Running sequences go first, oldest first: a decoding sequence takes
one token, a sequence still in prefill takes its next chunk (chunked prefill shares the step with
decodes). When a running sequence needs a block and none is free, the newest running sequence is
preempted by recompute (its blocks freed, it goes back to the front of the queue; its computed
blocks usually stay in the prefix cache, so the recompute is mostly a cache hit). Waiting
sequences are admitted while the budget, ``max_num_seqs`` and the free blocks allow; at
admission a sequence takes its cached prefix blocks (never the whole prompt: the last token is
always computed, so the step yields logits). Leading blocks past the cached prefix that a lower
KV tier holds (``tiers``) are copied into fresh blocks at admission and count as cached.

``policy`` is vLLM's ``--scheduling-policy``. ``fcfs`` (the default) is the above. ``priority``
orders the waiting queue by (``Sequence.priority``, arrival), lower first, as vLLM does; a
sequence that needs a block preempts the running sequence with the largest (priority, arrival)
rather than the newest; and a waiting sequence that finds the batch full (``max_num_seqs``) or no
blocks free preempts the running sequence with the largest key when that key is larger than its
own. A preempted sequence goes back to the waiting queue in key order and resumes by recompute
(its output continues exactly where it stopped). Blocks a sequence frees carry its priority into
the prefix cache's eviction order (:meth:`BlockManager.free`).
"""

from __future__ import annotations

import bisect
import logging
import time
from collections import deque
from dataclasses import dataclass

from runtime.histogram import REQUEST_LATENCY_BUCKETS, histogram

from .block_manager import BlockManager
from .sequence import Sequence, SeqStatus

log = logging.getLogger(__name__)

SCHEDULING_POLICIES = ("fcfs", "priority")


def priority_key(seq: Sequence) -> tuple[int, float]:
    """vLLM's order under the priority policy: lower priority value first, then earlier arrival."""
    return seq.priority, seq.queued_at


@dataclass
class ScheduledBatch:
    """The sequences of one step and how many new tokens each computes (same order)."""

    seqs: list[Sequence]
    num_tokens: list[int]
    preempted: list[Sequence]

    def __bool__(self) -> bool:
        return bool(self.seqs)


class Scheduler:
    """Waiting queue + running list over one :class:`BlockManager`; plain values in."""

    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, *, lora=None,
                 policy: str = "fcfs"):
        if max_num_seqs <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {SCHEDULING_POLICIES}, got {policy!r}")
        self.policy = policy
        self.by_priority = policy == "priority"
        self.num_priority_preemptions = 0  # running sequences preempted for a waiting one of higher priority
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        # vLLM's prefix-cache counters, in tokens: every admission queries its prompt, hits its cached part
        self.prefix_queries = 0
        self.prefix_hits = 0
        self.queue_time = histogram(REQUEST_LATENCY_BUCKETS)  # queued to first scheduled, per request
        # False while something needs every position computed (a draft that reads the target's hidden
        # states: a prefix-cache hit would skip them); cached blocks are still registered for later.
        self.reuse_cached_prefix = True
        self.tiers = None  # KV tiers below the device pool (workers/engine/kv_tiers.py), if any
        # LoRA slots (workers.engine.lora.LoraManager): a sequence holds its adapter's slot while it runs
        self.lora = lora

    def attach_tiers(self, tiers) -> None:
        """Admission copies prefix blocks the KV tiers hold into fresh blocks (they count as cached)."""
        self.tiers = tiers

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        if self.by_priority:
            self._insort(seq)
        else:
            self.waiting.append(seq)

    def _insort(self, seq: Sequence) -> None:
        """Into the waiting queue in (priority, arrival) order (behind equal keys)."""
        self.waiting.insert(bisect.bisect_right(self.waiting, priority_key(seq), key=priority_key), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def finish(self, seq: Sequence) -> None:
        """Remove a sequence (finished or aborted) and free its blocks."""
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SeqStatus.FINISHED

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        batch = ScheduledBatch([], [], [])
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed, budget)
            if n <= 0:
                i += 1
                continue
            if not self._grow(seq, seq.num_computed + n, batch):
                continue  # seq itself was preempted; the list shifted under index i
            batch.seqs.append(seq)
            batch.num_tokens.append(n)
            budget -= n
            # (the priority policy may have preempted a sequence before this one: find its place again)
            i = self.running.index(seq) + 1 if self.by_priority else i + 1
        if not batch.preempted:
            # a sequence whose pending token ends it (async scheduling) no longer takes a place
            ending = sum(1 for s in self.running if s.ends_at_pending)
            parked: list[Sequence] = []  # their adapter has no slot this step: the ones behind go first
            while self.waiting and budget > 0:
                seq = self.waiting[0]
                if len(self.running) - ending >= self.max_num_seqs:
                    freed = self._preempt_for(seq, batch)  # the priority policy: a lower one makes room
                    if freed is None:
                        break
                    budget += freed
                    continue
                if self.lora is not None and not self.lora.can_acquire(seq):
                    parked.append(self.waiting.popleft())
                    continue
                n = self._admit(seq, budget)
                if n == 0:
                    freed = self._preempt_for(seq, batch)
                    if freed is None:
                        break
                    budget += freed
                    continue
                self.waiting.popleft()
                if seq.scheduled_at is None:
                    seq.scheduled_at = time.monotonic()
                    self.queue_time.observe(seq.scheduled_at - seq.queued_at)
                seq.status = SeqStatus.RUNNING
                self.running.append(seq)
                batch.seqs.append(seq)
                batch.num_tokens.append(n)
                budget -= n
            self.waiting.extendleft(reversed(parked))
        return batch

    # ------------------------------------------------------------------ internals

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Give ``seq`` blocks for ``num_tokens`` tokens, preempting newer sequences if needed (under the
        priority policy, the lowest-priority ones)."""
        need = self._blocks_for(num_tokens) - len(seq.block_table)
        while need > 0 and not self.blocks.can_allocate(need):
            victim = max(self.running, key=priority_key) if self.by_priority else self.running[-1]
            self._preempt(victim, batch)
            if victim is seq:
                return False
        if need > 0:
            seq.block_table.extend(self.blocks.allocate(need))
        return True

    def _preempt_for(self, seq: Sequence, batch: ScheduledBatch) -> int | None:
        """Under the priority policy, preempt the running sequence with the largest key if it is larger
        than waiting ``seq``'s; returns the step's tokens it gave back (None: nothing preempted)."""
        if not self.by_priority:
            return None
        candidates = [s for s in self.running if not s.ends_at_pending]  # (those free their place anyway)
        if not candidates:
            return None
        victim = max(candidates, key=priority_key)
        if priority_key(victim) <= priority_key(seq):
            return None
        self.num_priority_preemptions += 1
        log.info("request %s (priority %d): preempted for request %s (priority %d)", victim.request_id,
                 victim.priority, seq.request_id, seq.priority)
        return self._preempt(victim, batch)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> int:
        """Preempt ``seq`` by recompute; returns the tokens it had in ``batch`` (0: none)."""
        self.running.remove(seq)
        given_back = 0
        if seq in batch.seqs:
            k = batch.seqs.index(seq)
            given_back = batch.num_tokens[k]
            del batch.seqs[k], batch.num_tokens[k]
        self._release(seq)
        seq.reset_for_recompute()
        if self.by_priority:
            self._insort(seq)
        else:
            self.waiting.appendleft(seq)
        batch.preempted.append(seq)
        self.num_preemptions += 1
        log.info("request %s: preempted (recompute), %d blocks free", seq.request_id, self.blocks.num_free_blocks)
        return given_back

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Take cached prefix blocks and blocks for the first chunk; 0 if they do not fit."""
        bs = self.block_size
        hashes = seq.full_block_hashes(bs, len(seq))[: (len(seq) - 1) // bs]
        hits = self.blocks.match_prefix(hashes) if self.reuse_cached_prefix else []
        # blocks after the device hits that a lower KV tier holds: loaded into fresh blocks below
        lower = self.tiers.take_prefix(hashes, len(hits)) if self.tiers is not None and self.reuse_cached_prefix else 0
        num_cached = (len(hits) + lower) * bs
        n = min(len(seq) - num_cached, budget)
        need = self._blocks_for(num_cached + n) - len(hits)
        reclaimed = sum(1 for b in hits if self.blocks.ref_count[b] == 0)  # hits that sit in the free queue
        if not self.blocks.can_allocate(need + reclaimed):
            return 0
        if self.lora is not None and not self.lora.acquire(seq):
            return 0  # every adapter slot is busy with other adapters: it waits (in order)
        self.blocks.acquire(hits)
        seq.block_table = hits + self.blocks.allocate(need)
        if lower:
            loaded, loaded_hashes = seq.block_table[len(hits) : len(hits) + lower], hashes[len(hits) : len(hits) + lower]
            self.tiers.load(loaded, loaded_hashes)
            self.blocks.register(loaded, loaded_hashes, hashes[len(hits) - 1] if hits else 0)
        seq.num_computed = num_cached
        seq.num_registered = len(hits) + lower
        self.prefix_queries += len(seq)
        self.prefix_hits += num_cached
        if seq.num_cached_tokens < 0:
            seq.num_cached_tokens = num_cached
        return n

    def _release(self, seq: Sequence) -> None:
        if self.lora is not None:
            self.lora.release(seq)
        if seq.block_table:
            self.blocks.free(seq.block_table, seq.priority)
            seq.block_table = []
