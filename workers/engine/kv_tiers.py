"""KV cache tiers below the device pool: a host tier and, below it, an optional (shared) disk tier.

What moves is a *block*: the keys and values of every layer for ``block_size`` positions, and the
hidden-state rows of the offered layers at the same slots (the rows EAGLE-style drafts read, see
:mod:`.hidden`), so a block loaded back brings everything a block computed here would hold.

- **Store on compute (write-through).** When the engine registers a freshly computed full block in
  the prefix cache (:meth:`KvTiers.computed`), it is copied to the host tier at the end of the step
  (after the step's own moves), and queued for the disk tier. The device pool then evicts as before,
  and an evicted block costs nothing more: its copy is already below. (vLLM's CPU offloading
  connector and LMCache store on compute too.)
- **Host tier.** One preallocated slab ``[capacity, block_bytes]`` (pinned on CUDA), LRU by hash;
  its memory is fixed when the engine starts, so the tier never grows past its size. Under the
  priority scheduling policy a block keeps the priority of the request that stored it, and the
  least important priority's blocks go first (LRU within one priority; all 0: plain LRU).
- **Load on admission.** When the scheduler admits a sequence, the leading blocks missing from the
  device pool but present in the host tier are copied into fresh device blocks before its prefill
  (:meth:`KvTiers.take_prefix`): host→device copies are memory copies, done in the step.
- **Disk tier** (:mod:`.kv_disk`): blocks beyond the host tier's prefix that exist on disk are read
  by a reader thread *before* the sequence is queued (:meth:`KvTiers.hold`): the sequence waits out
  of the scheduler, the step loop goes on with the rest of the batch, and once the reads are done
  the blocks are in the host tier and the sequence is queued (:meth:`KvTiers.after_step`). Only one
  stat per request runs on the step thread. A missing, truncated or corrupted file ends the chain
  there: the rest is recomputed.

Every change of a tier's contents is a :class:`runtime.messages.KvEvent` with ``tier`` set (``host``
or ``disk``) and the tier's own event sequence, drained with the device pool's events.
"""

from __future__ import annotations

import hashlib
import logging
import os
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
from prometheus_client import Histogram

from runtime.histogram import histogram
from runtime.kv_hash import ROOT_HASH, stored_events
from runtime.messages import KvEvent, KvEventKind

from .block_manager import BlockManager
from .kv_disk import DiskTier, layout_key

log = logging.getLogger(__name__)

LOAD_BUCKETS = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)
TIERS = ("host", "disk")


@dataclass
class TierStats:
    """One tier's counters (exported as ``tandem_target_kv_tier_*{tier=...}``)."""

    hits: int = 0  # blocks loaded from this tier
    loaded_bytes: int = 0
    stored: int = 0  # blocks stored into this tier
    stored_bytes: int = 0
    evicted: int = 0
    load_seconds: Histogram = field(default_factory=lambda: histogram(LOAD_BUCKETS))


class BlockCopier:
    """Copies whole blocks between the engine's KV cache (and hidden rows) and host byte rows.

    ``regions``: the KV tensors ([num_blocks, block_size, heads, head_dim] each, keys and values of
    every layer) then the hidden rows ([num_blocks * block_size, hidden] per offered layer). A host
    row is the concatenation of one block's bytes in every region, in that order.
    """

    def __init__(self, kv: list[torch.Tensor], hidden: list[torch.Tensor], block_size: int):
        self.views = []  # [num_blocks, bytes of one block] uint8 views of each region
        for t in kv:
            self.views.append(t.view(t.shape[0], -1).view(torch.uint8))
        for rows in hidden:
            self.views.append(rows.view(rows.shape[0] // block_size, -1).view(torch.uint8))
        self.offsets, at = [], 0
        for v in self.views:
            self.offsets.append((at, at + v.shape[1]))
            at += v.shape[1]
        self.block_bytes = at
        self.device = kv[0].device

    @torch.inference_mode()
    def to_host(self, blocks: list[int], slab: torch.Tensor, rows: list[int]) -> None:
        """Device blocks → host ``slab`` rows (same order); the rows must be distinct."""
        if len(set(rows)) != len(rows):
            raise ValueError(f"host rows reserved twice in one copy: {rows}")
        src = torch.tensor(blocks, dtype=torch.long, device=self.device)
        dst = torch.tensor(rows, dtype=torch.long)
        for view, (a, b) in zip(self.views, self.offsets):
            slab[dst, a:b] = view.index_select(0, src).to("cpu")

    @torch.inference_mode()
    def to_device(self, slab: torch.Tensor, rows: list[int], blocks: list[int]) -> None:
        """Host ``slab`` rows → device blocks (same order)."""
        src = torch.tensor(rows, dtype=torch.long)
        dst = torch.tensor(blocks, dtype=torch.long, device=self.device)
        picked = slab.index_select(0, src)
        for view, (a, b) in zip(self.views, self.offsets):
            view.index_copy_(0, dst, picked[:, a:b].to(self.device, non_blocking=True))


class HostTier:
    """A fixed slab of ``capacity`` block rows with a map hash → (row, parent), evicted least important
    priority first (vLLM's polarity: the largest value), least recently used within it; plain values in."""

    def __init__(self, capacity: int, block_bytes: int, pin: bool = False):
        if capacity <= 0:
            raise ValueError(f"the host tier must hold at least one block, got {capacity}")
        self.capacity = capacity
        self.slab = torch.empty(capacity, block_bytes, dtype=torch.uint8, pin_memory=pin)
        self.entries: OrderedDict[int, tuple[int, int]] = OrderedDict()
        self._lru: dict[int, OrderedDict[int, None]] = {0: OrderedDict()}  # priority -> hashes, oldest first
        self._priority: dict[int, int] = {}  # hash -> the priority it was stored with
        self._free = list(range(capacity - 1, -1, -1))

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.entries

    def __len__(self) -> int:
        return len(self.entries)

    def row(self, block_hash: int) -> int:
        return self.entries[block_hash][0]

    def touch(self, block_hash: int) -> None:
        self.entries.move_to_end(block_hash)
        self._lru[self._priority[block_hash]].move_to_end(block_hash)

    def next_victim(self) -> int | None:
        """The hash the next :meth:`reserve` evicts (None: a row is free)."""
        if self._free:
            return None
        queue = self._lru[max(p for p, q in self._lru.items() if q)] if len(self._lru) > 1 else self._lru[0]
        return next(iter(queue))

    def reserve(self, block_hash: int, parent: int, priority: int = 0) -> tuple[int, list[int]]:
        """A row for a new block (evicting the least important, least recently used one); returns
        (row, evicted hashes)."""
        evicted = []
        if not self._free:
            h = self.next_victim()
            row, _ = self.entries.pop(h)
            del self._lru[self._priority.pop(h)][h]
            self._free.append(row)
            evicted.append(h)
        row = self._free.pop()
        self.entries[block_hash] = (row, parent)
        self._lru.setdefault(priority, OrderedDict())[block_hash] = None
        self._priority[block_hash] = priority
        return row, evicted


@dataclass
class _Held:
    """A sequence waiting for its disk blocks to be read before it is queued."""

    seq: object
    future: Future
    started: float


class KvTiers:
    """The tiers of one engine; plain values in (the copier, sizes, an optional disk tier)."""

    def __init__(self, blocks: BlockManager, copier: BlockCopier, host_blocks: int, disk: DiskTier | None = None,
                 worker_id: str = "", pin: bool = False):
        self.blocks = blocks
        self.block_size = blocks.block_size
        self.copier = copier
        self.host = HostTier(host_blocks, copier.block_bytes, pin)
        self.disk = disk
        self.worker_id = worker_id
        self.stats = {tier: TierStats() for tier in TIERS}
        self.held: list[_Held] = []
        self._computed: list[tuple[int, int, int, list[int], int]] = []  # (block, hash, parent, tokens, priority)
        self._events: list[KvEvent] = []
        self._event_ids = dict.fromkeys(TIERS, 0)
        self._lock = threading.Lock()  # events and disk stats come from the disk writer thread too
        self._loaded = threading.Event()
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="kv-disk-reader") if disk is not None else None
        if disk is not None:
            disk.on_stored = lambda h, parent: self._stored_on_disk(h, parent)
            disk.on_removed = lambda hashes: self._event("disk", KvEventKind.REMOVED, hashes)

    # ------------------------------------------------------------------ the engine's hooks

    def computed(self, blocks: list[int], hashes: list[int], parent: int, tokens: list[int], priority: int = 0) -> None:
        """Full blocks just registered in the prefix cache (``tokens``: theirs, concatenated; ``priority``:
        their request's, for the host tier's eviction); they are copied down at the end of the step
        (:meth:`after_step`), once the step's moves are done."""
        bs = self.block_size
        for i, (b, h) in enumerate(zip(blocks, hashes)):
            self._computed.append((b, h, parent, tokens[i * bs : (i + 1) * bs], priority))
            parent = h

    def take_prefix(self, hashes: list[int], start: int) -> int:
        """How many of ``hashes[start:]`` (the blocks after a device prefix hit) the host tier holds, in a row."""
        n = start
        while n < len(hashes) and hashes[n] in self.host:
            n += 1
        return n - start

    def load(self, blocks: list[int], hashes: list[int]) -> None:
        """Copy host-tier blocks ``hashes`` into the device ``blocks`` (fresh ones of an admitted sequence)."""
        started = time.perf_counter()
        rows = []
        for h in hashes:
            self.host.touch(h)
            rows.append(self.host.row(h))
        self.copier.to_device(self.host.slab, rows, blocks)
        st = self.stats["host"]
        st.hits += len(blocks)
        st.loaded_bytes += len(blocks) * self.copier.block_bytes
        st.load_seconds.observe(time.perf_counter() - started)

    def hold(self, seq) -> bool:
        """Whether ``seq`` waits for disk blocks before it is queued: its leading blocks past the
        device and host tiers' prefix whose files exist are read by the reader thread meanwhile."""
        if self.disk is None or self.disk.disabled:
            return False
        bs = self.block_size
        hashes = seq.full_block_hashes(bs, len(seq))[: (len(seq) - 1) // bs]
        device_hits = len(self.blocks.match_prefix(hashes))
        start = device_hits + self.take_prefix(hashes, device_hits)
        # the host tier must hold its part of the prefix and the blocks read, together, at admission
        end = min(len(hashes), device_hits + self.host.capacity)
        if start >= end or not self.disk.exists(hashes[start]):
            return False
        for h in hashes[device_hits:start]:  # most recently used: the blocks read do not evict them
            self.host.touch(h)
        parent = hashes[start - 1] if start else ROOT_HASH
        tokens = list(seq.token_ids[start * bs : end * bs])
        future = self._reader.submit(self._read_chain, hashes[start:end], parent, tokens)
        future.add_done_callback(lambda _: self._loaded.set())
        self.held.append(_Held(seq, future, time.perf_counter()))
        return True

    def after_step(self, idle: bool) -> list:
        """End of a step: store the blocks computed in it, and take in finished disk reads; returns
        the held sequences now ready to queue. ``idle``: the step ran nothing, so wait briefly for a
        read rather than spin."""
        if self._computed:
            self._store_computed()
        if not self.held:
            return []
        if idle and not any(h.future.done() for h in self.held):
            self._loaded.wait(0.005)
        self._loaded.clear()
        ready, waiting = [], []
        for h in self.held:
            (ready if h.future.done() else waiting).append(h)
        self.held = waiting
        out = []
        for h in ready:
            try:
                chain = h.future.result()
            except Exception as exc:  # a bug in the read path: the sequence recomputes
                log.exception("KV disk tier: reading a chain failed: %r", exc)
                chain = []
            self._take_from_disk(chain, time.perf_counter() - h.started, h.seq.priority)
            out.append(h.seq)
        return out

    def dump(self) -> list[KvEvent]:
        """The host tier's contents as ``stored`` events, one block each, parents before children (what
        a late router is sent with the device pool's dump). The disk tier is not dumped: it may hold
        far more blocks than a dump should carry, and other targets share it."""
        parents = {h: parent for h, (_, parent) in self.host.entries.items()}
        out = []
        for event in stored_events(self.worker_id, self.block_size, parents, 0):
            with self._lock:
                self._event_ids["host"] += 1
                out.append(KvEvent(self.worker_id, self._event_ids["host"], KvEventKind.STORED, event.block_hashes,
                                   event.parent_hash, self.block_size, "host"))
        return out

    def drain_events(self) -> list[KvEvent]:
        with self._lock:
            events, self._events = self._events, []
        return events

    def close(self) -> None:
        if self._reader is not None:
            self._reader.shutdown(wait=True)
        if self.disk is not None:
            self.disk.close()

    @property
    def host_bytes(self) -> int:
        return self.host.capacity * self.copier.block_bytes

    # ------------------------------------------------------------------ internals

    def _store_computed(self) -> None:
        """Copy the step's computed blocks to the host tier and queue them for the disk tier.

        Rows are reserved, then filled in one batched copy. No reservation may evict a row reserved
        earlier in the same batch: that row would be filled with (and written to disk as) a later
        block's bytes under the earlier block's hash. A step storing more blocks than the tier holds
        (or touching enough cached ones to make its own rows the least recently used) reaches that
        point; the batch is then copied and written out first, and the next one starts."""
        todo, self._computed = self._computed, []
        batch: list[tuple[int, int, int, list[int], int, int]] = []  # (block, hash, parent, tokens, priority, row)
        pending: set[int] = set()  # hashes of the batch's rows, not filled yet
        removed: list[int] = []
        to_disk = self.disk is not None and not self.disk.disabled
        for b, h, parent, tokens, priority in todo:
            if self.blocks.block_hash[b] != h:  # evicted (and maybe overwritten) within the step
                continue
            if h in self.host:
                self.host.touch(h)
                continue
            if self.host.next_victim() in pending:
                to_disk = self._store_batch(batch, removed, to_disk)
                batch, pending, removed = [], set(), []
            row, evicted = self.host.reserve(h, parent, priority)
            pending.add(h)
            removed.extend(evicted)
            batch.append((b, h, parent, tokens, priority, row))
        if batch:
            self._store_batch(batch, removed, to_disk)

    def _store_batch(self, batch: list[tuple[int, int, int, list[int], int, int]], removed: list[int],
                     to_disk: bool) -> bool:
        """Fill the rows reserved for ``batch`` (distinct, none evicted since) from the device, publish,
        and queue the blocks for the disk tier; returns whether the disk still takes writes this step."""
        self.copier.to_host([b for b, *_ in batch], self.host.slab, [row for *_, row in batch])
        st = self.stats["host"]
        st.stored += len(batch)
        st.stored_bytes += len(batch) * self.copier.block_bytes
        st.evicted += len(removed)
        if removed:
            self._event("host", KvEventKind.REMOVED, removed)
        self._stored_runs("host", [(h, parent) for _, h, parent, *_ in batch])
        if not to_disk:
            return False
        for _, h, parent, tokens, priority, row in batch:
            if not self.disk.put(h, parent, tokens, self.host.slab[row].numpy().tobytes(), priority):
                return False  # the writer's queue is full (or the tier turned off): the rest stay above
        return True

    def _read_chain(self, hashes: list[int], parent: int, tokens: list[int]) -> list[tuple[int, int, memoryview]]:
        """Reader thread: the leading blocks of ``hashes`` readable from disk, checked."""
        bs = self.block_size
        out = []
        for i, h in enumerate(hashes):
            payload = self.disk.get(h, parent, tokens[i * bs : (i + 1) * bs])
            if payload is None:
                break
            out.append((h, parent, payload))
            parent = h
        return out

    def _take_from_disk(self, chain: list[tuple[int, int, memoryview]], seconds: float, priority: int = 0) -> None:
        """Step thread: put blocks read from disk into the host tier. Only the leading ``capacity``
        blocks of a chain are kept: a longer chain would evict its own head, and a prefix is only
        loaded from its first block on."""
        chain = chain[: self.host.capacity]
        removed, stored = [], []
        for h, parent, payload in chain:
            if h in self.host:
                self.host.touch(h)
                continue
            row, evicted = self.host.reserve(h, parent, priority)
            removed.extend(evicted)
            self.host.slab[row].copy_(torch.frombuffer(payload, dtype=torch.uint8))
            stored.append((h, parent))
        if not chain:
            return
        st = self.stats["disk"]
        with self._lock:
            st.hits += len(chain)
            st.loaded_bytes += len(chain) * self.copier.block_bytes
        st.load_seconds.observe(seconds)
        self.stats["host"].evicted += len(removed)
        if removed:
            self._event("host", KvEventKind.REMOVED, removed)
        self._stored_runs("host", stored)

    def _stored_on_disk(self, block_hash: int, parent: int) -> None:
        st = self.stats["disk"]
        with self._lock:
            st.stored += 1
            st.stored_bytes += self.disk.file_bytes
        self._event("disk", KvEventKind.STORED, [block_hash], parent)

    def _stored_runs(self, tier: str, stored: list[tuple[int, int]]) -> None:
        """One ``stored`` event per run of consecutive blocks (each block's parent the one before)."""
        run, run_parent = [], ROOT_HASH
        for h, parent in stored:
            if run and parent != run[-1]:
                self._event(tier, KvEventKind.STORED, run, run_parent)
                run = []
            if not run:
                run_parent = parent
            run.append(h)
        if run:
            self._event(tier, KvEventKind.STORED, run, run_parent)

    def _event(self, tier: str, kind: str, hashes: list[int], parent: int | None = None) -> None:
        with self._lock:
            self._event_ids[tier] += 1
            parent_hash = None if parent in (None, ROOT_HASH) else parent
            self._events.append(KvEvent(self.worker_id, self._event_ids[tier], kind, list(hashes), parent_hash,
                                        self.block_size, tier))


def _copier(engine) -> BlockCopier:
    kv = [t for pair in engine.runner.kv_caches for t in pair]
    hidden = [engine.hidden.rows[layer] for layer in engine.hidden.layers] if engine.hidden is not None else []
    return BlockCopier(kv, hidden, engine.config.block_size)


def block_bytes(engine) -> int:
    """Bytes one block of ``engine`` takes in a lower tier (KV of every layer and its hidden rows)."""
    return _copier(engine).block_bytes


WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".json")
FINGERPRINT_BYTES = 64 << 10


def weights_fingerprint(model: str | Path) -> str:
    """A cheap identity of a model's files (a directory or one file): each weight and config file's
    name, size, and its first and last 64 KiB. Two targets share disk-tier files only when this is
    equal, so a checkpoint replaced under the same served name (another fine-tune, another
    quantization) never reads the old one's KV."""
    path = Path(model)
    files = sorted(p for p in path.iterdir() if p.suffix in WEIGHT_SUFFIXES) if path.is_dir() else [path]
    digest = hashlib.blake2b(digest_size=8)
    for f in files:
        size = f.stat().st_size
        digest.update(f"{f.name}\0{size}\0".encode())
        with open(f, "rb") as fh:
            digest.update(fh.read(FINGERPRINT_BYTES))
            if size > 2 * FINGERPRINT_BYTES:
                fh.seek(-FINGERPRINT_BYTES, os.SEEK_END)
                digest.update(fh.read(FINGERPRINT_BYTES))
    return digest.hexdigest()


def build_tiers(engine, host_bytes: int, disk_dir: str | None = None, disk_bytes: int = 0, model_id: str = "") -> KvTiers:
    """Tiers over ``engine``'s KV cache and hidden rows: a host tier of ``host_bytes`` and, when
    ``disk_dir`` is given, a disk tier of ``disk_bytes`` there (shared by every engine whose blocks
    have the same layout: ``model_id``, block size, dtype, KV shape, hidden layers)."""
    if engine.runner.followers is not None:
        raise ValueError("KV offloading does not combine with tensor parallelism yet")
    if not engine.config.enable_prefix_caching:
        raise ValueError("KV offloading needs prefix caching")
    copier = _copier(engine)
    kv, bs = copier.views[: 2 * len(engine.runner.kv_caches)], engine.config.block_size
    host_blocks = host_bytes // copier.block_bytes
    if host_blocks < 1:
        raise ValueError(f"the host tier ({host_bytes} bytes) must hold at least one block of {copier.block_bytes} bytes")
    disk = None
    if disk_dir:
        k = engine.runner.kv_caches[0][0]
        layout = layout_key(model_id, bs, str(k.dtype), len(kv) // 2, tuple(k.shape[2:]),
                            tuple(engine.hidden.layers) if engine.hidden is not None else (),
                            engine.hidden.hidden_size if engine.hidden is not None else 0)
        disk = DiskTier(disk_dir, layout, disk_bytes, copier.block_bytes, bs)
    tiers = KvTiers(engine.blocks, copier, host_blocks, disk, engine.blocks.worker_id, pin=copier.device.type == "cuda")
    log.info("KV tiers: host %d blocks (%.2f GiB)%s", host_blocks, host_blocks * copier.block_bytes / (1 << 30),
             f", disk {disk_bytes / (1 << 30):.2f} GiB at {disk.dir}" if disk is not None else "")
    return tiers
