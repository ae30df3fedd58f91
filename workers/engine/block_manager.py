"""Paged KV cache bookkeeping: fixed-size blocks, reference counts, prefix caching, KV events.

A block holding a full, computed block of some sequence is *registered* under its chained hash
(:func:`runtime.kv_hash.block_hash`, the same hash the router computes), so a later sequence with
the same prefix reuses it. A block whose reference count drops to zero goes to the back of the
free queue but keeps its hash: it is still a cache hit until it is handed out again (LRU: the
front of the queue is reused first). Blocks of a sequence are freed leaf first, so a chain's tail
is evicted before its head.

Priority (an engine started with ``--scheduling-policy priority``): a block is freed with its
sequence's priority (vLLM's polarity: lower is more important) and waits in that priority's free
queue; fresh blocks come from the least important queue first, LRU within it, so a prefix that
important requests use stays cached longest. With every priority 0 (the default) there is one queue:
plain LRU.

Every change of the cached set appends a :class:`KvEvent` to ``events`` (drained by the worker):
``stored`` with consecutive hashes and the hash before them, ``removed`` when a cached block is
evicted or invalidated, ``cleared`` on :meth:`clear`. The format matches ``workers/mock.py``.
"""

from __future__ import annotations

from collections import OrderedDict

from runtime.kv_hash import ROOT_HASH, stored_events
from runtime.messages import KvEvent, KvEventKind


class NoFreeBlocks(RuntimeError):
    """More blocks were asked for than are free; callers check :meth:`BlockManager.can_allocate`."""


class BlockManager:
    """Block ids 0..num_blocks-1 with ref counts and a hash → block map; plain values in."""

    def __init__(self, num_blocks: int, block_size: int, worker_id: str = "", enable_prefix_caching: bool = True):
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"num_blocks and block_size must be positive, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.worker_id = worker_id
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.block_parent: list[int] = [ROOT_HASH] * num_blocks
        self.hash_to_block: dict[int, int] = {}
        # priority -> blocks no sequence holds, least recently freed first (see the module docstring)
        self._free: dict[int, OrderedDict[int, None]] = {0: OrderedDict((b, None) for b in range(num_blocks))}
        self._free_priority = [0] * num_blocks  # the queue a free block waits in
        self._num_free = num_blocks
        self.events: list[KvEvent] = []
        self._event_id = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (some may still be cache hits)."""
        return self._num_free

    @property
    def num_cached_blocks(self) -> int:
        return len(self.hash_to_block)

    def can_allocate(self, n: int) -> bool:
        return n <= self._num_free

    def match_prefix(self, hashes: list[int]) -> list[int]:
        """Block ids of the leading blocks of ``hashes`` that are cached."""
        out = []
        if not self.enable_prefix_caching:
            return out
        for h in hashes:
            block = self.hash_to_block.get(h)
            if block is None:
                break
            out.append(block)
        return out

    # ------------------------------------------------------------------ changes

    def acquire(self, blocks: list[int]) -> None:
        """Take a reference on cached blocks (from :meth:`match_prefix`)."""
        for b in blocks:
            if self.ref_count[b] == 0:
                self._take_free(b)
            self.ref_count[b] += 1

    def allocate(self, n: int) -> list[int]:
        """``n`` fresh blocks, evicting the least recently freed cached ones first."""
        if n > self._num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self._num_free} free")
        out, evicted = [], []
        for _ in range(n):
            b = self._next_free()
            h = self.block_hash[b]
            if h is not None:
                self._forget(b)
                evicted.append(h)
            self.ref_count[b] = 1
            out.append(b)
        if evicted:
            self._event(KvEventKind.REMOVED, evicted)
        return out

    def free(self, blocks: list[int], priority: int = 0) -> None:
        """Drop one reference on each block; freed leaf first (pass blocks in sequence order). A block
        no one holds any more waits for reuse in ``priority``'s free queue (lower is kept longer)."""
        for b in reversed(blocks):
            if self.ref_count[b] <= 0:
                raise RuntimeError(f"block {b} freed more often than taken")
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                queue = self._free.get(priority)
                if queue is None:
                    queue = self._free[priority] = OrderedDict()
                queue[b] = None
                self._free_priority[b] = priority
                self._num_free += 1

    def register(self, blocks: list[int], hashes: list[int], parent: int) -> None:
        """Mark full, computed blocks as cached under ``hashes`` (a chain following ``parent``).

        A hash that another block already holds is skipped (that block stays the cached copy).
        One ``stored`` event is published per run of newly cached consecutive blocks.
        """
        if not self.enable_prefix_caching:
            return
        run: list[int] = []
        run_parent = prev = parent
        for b, h in zip(blocks, hashes):
            if self.block_hash[b] is None and h not in self.hash_to_block:
                self.block_hash[b] = h
                self.block_parent[b] = prev
                self.hash_to_block[h] = b
                if not run:
                    run_parent = prev
                run.append(h)
            elif run:  # a prefix hit or a duplicate ends the run
                self._event(KvEventKind.STORED, run, run_parent)
                run = []
            prev = h
        if run:
            self._event(KvEventKind.STORED, run, run_parent)

    def truncate(self, blocks: list[int], num_tokens: int) -> list[tuple[int, int]]:
        """Shrink a block table (in place) to hold ``num_tokens`` tokens: rollback.

        Blocks past the end are freed. If the new last block is only partly kept and is cached,
        its tail will be overwritten, so it stops being a cache entry: when only this sequence
        holds it, it is unregistered (``removed``); when shared, it is copied to a fresh block
        (copy-on-write). Returns the (src, dst) block copies the caller must apply to the KV cache.
        """
        keep = -(-num_tokens // self.block_size)
        if keep < len(blocks):
            self.free(blocks[keep:])
            del blocks[keep:]
        copies: list[tuple[int, int]] = []
        if num_tokens % self.block_size and blocks:
            last = blocks[-1]
            if self.block_hash[last] is not None:
                if self.ref_count[last] == 1:
                    h = self.block_hash[last]
                    self._forget(last)
                    self._event(KvEventKind.REMOVED, [h])
                else:
                    (fresh,) = self.allocate(1)
                    self.free([last])
                    blocks[-1] = fresh
                    copies.append((last, fresh))
        return copies

    def clear(self) -> None:
        """Forget every cached hash (blocks in use stay allocated); publishes ``cleared``."""
        for b in list(self.hash_to_block.values()):
            self._forget(b)
        self._event(KvEventKind.CLEARED, [])

    def dump(self) -> list[KvEvent]:
        """The cached set as ``stored`` events, one block each, parents before children."""
        parents = {h: self.block_parent[b] for h, b in self.hash_to_block.items()}
        out = stored_events(self.worker_id, self.block_size, parents, self._event_id + 1)
        self._event_id += len(out)
        return out

    def drain_events(self) -> list[KvEvent]:
        events, self.events = self.events, []
        return events

    # ------------------------------------------------------------------ internals

    def _take_free(self, b: int) -> None:
        queue = self._free[self._free_priority[b]]
        del queue[b]
        self._num_free -= 1

    def _next_free(self) -> int:
        """The block to reuse: the least recently freed of the least important priority."""
        if len(self._free) == 1:
            queue = next(iter(self._free.values()))
        else:
            queue = self._free[max(p for p, q in self._free.items() if q)]
        b, _ = queue.popitem(last=False)
        self._num_free -= 1
        return b

    def _forget(self, b: int) -> None:
        h = self.block_hash[b]
        if h is not None and self.hash_to_block.get(h) == b:
            del self.hash_to_block[h]
        self.block_hash[b] = None
        self.block_parent[b] = ROOT_HASH

    def _event(self, kind: str, hashes: list[int], parent: int | None = None) -> None:
        self._event_id += 1
        parent_hash = None if parent in (None, ROOT_HASH) else parent
        self.events.append(KvEvent(self.worker_id, self._event_id, kind, list(hashes), parent_hash, self.block_size))
