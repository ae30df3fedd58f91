"""The disk tier of the KV cache: one checksummed file per block, content-addressed, safe to share.

A block lives in ``<dir>/<layout>/<hash>.kvb``: ``<layout>`` names what a block holds (model,
block size, dtype, KV shape, hidden layers: :func:`layout_key`), so only targets whose blocks are
interchangeable share files; ``<hash>`` is the block's chained hash (:func:`runtime.kv_hash.block_hash`,
the one the router uses), so a file is the KV of one exact prefix and every writer of it writes the
same bytes. Several targets may point at one directory.

File format (little-endian)::

    magic "TKVB" | version u16 | block_size u16 | hash u64 | parent u64 | payload bytes u64 | crc32 u32
    | block tokens u32 x block_size | payload (KV of every layer, then hidden rows, as the host tier holds them)

``crc32`` covers the block's key (version, block size, hash, parent, payload bytes), the tokens and
the payload, so a file renamed or copied under another block's name, or a header edited to name
another block, fails the check like a torn or flipped payload does. A read checks everything it can (size, magic, hash,
parent, tokens, checksum); a file that fails any check is a miss (the caller recomputes) and is
removed. Writes never leave a torn block under a block's name: bytes go to a temporary file in the
same directory, are fsynced, and the file is renamed into place (atomic on POSIX); a writer killed
midway leaves only a ``.tmp-*`` file, which no reader opens and a later start removes. A full disk
(ENOSPC, EDQUOT, EFBIG) turns the tier off for this process: one error line, and
:attr:`DiskTier.disabled` for the metrics.

Writes run on one writer thread behind a bounded queue (a full queue drops the write: the block is
still in the host tier); reads run where the caller puts them (:class:`.kv_tiers.KvTiers` uses a
reader thread). The tier keeps its files within ``capacity_bytes``, oldest first by the order this
process wrote or read them (files of other writers are counted from a directory scan). Under the
priority scheduling policy a file carries the most important priority a request of this process
stored it with, and the least important priority's files go first (LRU within one priority).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import queue
import struct
import threading
import time
import zlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger(__name__)

MAGIC = b"TKVB"
VERSION = 2  # 2: the checksum covers the block's key too (1: tokens and payload only)
HEADER = struct.Struct("<4sHHQQQI")
KEY = struct.Struct("<HHQQQ")  # what the checksum covers before the body: version, block size, hash, parent, payload size
SUFFIX = ".kvb"
TEMP_PREFIX = ".tmp-"
STALE_TEMP_SECONDS = 60.0  # temporary files older than this belong to a writer that died
FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


def layout_key(*parts) -> str:
    """A short, stable directory name for a block layout (what a block's bytes mean) and this file
    format's version: targets of an older format keep their own directory, never reading these files."""
    return hashlib.blake2b(repr((VERSION, *parts)).encode(), digest_size=8).hexdigest()


def _checksum(version: int, block_size: int, block_hash: int, parent: int, payload_bytes: int,
              body: bytes | memoryview) -> int:
    """crc32 of a block's key (version, block size, hash, parent, payload size) and its body (tokens,
    then payload): a file holds the block its header names, or it fails the check."""
    key = KEY.pack(version, block_size, block_hash, parent, payload_bytes)
    return zlib.crc32(body, zlib.crc32(key))


def encode_block(block_hash: int, parent: int, tokens: list[int], payload: bytes | memoryview) -> list[bytes]:
    """A block file's bytes, as pieces to write in order."""
    toks = array("I", tokens).tobytes()
    key = KEY.pack(VERSION, len(tokens), block_hash, parent, len(payload))
    crc = zlib.crc32(payload, zlib.crc32(toks, zlib.crc32(key)))
    head = HEADER.pack(MAGIC, VERSION, len(tokens), block_hash, parent, len(payload), crc)
    return [head, toks, payload]


def decode_block(data: bytes | memoryview, block_hash: int, parent: int, tokens: list[int], payload_bytes: int) -> memoryview | None:
    """The payload of a block file's bytes ``data`` if it is the block asked for and intact; else None."""
    toks_len = 4 * len(tokens)
    if len(data) != HEADER.size + toks_len + payload_bytes:
        return None
    magic, version, bs, h, p, n, crc = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or bs != len(tokens) or h != block_hash or p != parent or n != payload_bytes:
        return None
    view = memoryview(data)
    toks = view[HEADER.size : HEADER.size + toks_len]
    payload = view[HEADER.size + toks_len :]
    if bytes(toks) != array("I", tokens).tobytes():
        return None
    if _checksum(version, bs, h, p, n, view[HEADER.size :]) != crc:
        return None
    return payload


def check_file(path: str | Path, payload_bytes: int | None = None) -> bool:
    """Whether a block file is whole and intact (its header, size and checksum) and named after the
    block its header holds, whatever block that is; ``payload_bytes`` None: of the size its header says."""
    path = Path(path)
    data = path.read_bytes()
    if len(data) < HEADER.size:
        return False
    magic, version, bs, h, p, n, crc = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION or n != (payload_bytes or n) or len(data) != HEADER.size + 4 * bs + n:
        return False
    if path.name.endswith(SUFFIX) and path.name != f"{h:016x}{SUFFIX}":
        return False
    return _checksum(version, bs, h, p, n, memoryview(data)[HEADER.size :]) == crc


@dataclass
class DiskCounters:
    """What the disk tier did (read by the metrics)."""

    written: int = 0  # blocks written by this process
    written_bytes: int = 0
    skipped: int = 0  # writes not needed: the block's file was already there
    dropped: int = 0  # writes dropped: the queue was full or the tier is off
    evicted: int = 0  # files removed to stay within capacity
    bad: dict = field(default_factory=dict)  # reads that failed a check, by reason (missing, truncated, corrupt)


class DiskTier:
    """Block files under ``root``/``layout``; plain values in."""

    def __init__(self, root: str | Path, layout: str, capacity_bytes: int, payload_bytes: int, block_size: int,
                 max_queue: int = 64):
        if capacity_bytes <= 0 or payload_bytes <= 0 or block_size <= 0:
            raise ValueError("capacity_bytes, payload_bytes and block_size must be positive")
        self.dir = Path(root) / layout
        self.dir.mkdir(parents=True, exist_ok=True)
        self.capacity_bytes = capacity_bytes
        self.payload_bytes = payload_bytes
        self.block_size = block_size
        self.file_bytes = HEADER.size + 4 * block_size + payload_bytes
        self.disabled = False
        self.counters = DiskCounters()
        self.on_stored = None  # callback(hash, parent) after a block's file is in place (writer thread)
        self.on_removed = None  # callback(hashes) after files were removed
        self._lock = threading.Lock()
        # priority -> the hashes of its files, least recently used first (vLLM's polarity: the largest
        # priority's files go first; files found at start, and every file of an engine that does not
        # schedule by priority, are 0: plain LRU)
        self._files: dict[int, OrderedDict[int, None]] = {0: OrderedDict()}
        self._file_priority: dict[int, int] = {}  # hash -> its priority
        self._queue: queue.Queue = queue.Queue(max_queue)
        # blocks queued but not written yet: reads find them here (a read racing its own process's write
        # is a hit, not a miss); hash -> (parent, tokens, payload)
        self._unwritten: dict[int, tuple[int, list[int], bytes]] = {}
        self._scan()
        self._writer = threading.Thread(target=self._write_loop, name="kv-disk-writer", daemon=True)
        self._writer.start()

    def path(self, block_hash: int) -> Path:
        return self.dir / f"{block_hash:016x}{SUFFIX}"

    @property
    def used_bytes(self) -> int:
        return len(self._file_priority) * self.file_bytes

    def exists(self, block_hash: int) -> bool:
        """Whether a file for the block is there (one stat; another target may have written it), or
        this process has it queued for writing."""
        return not self.disabled and (block_hash in self._unwritten or self.path(block_hash).exists())

    # ------------------------------------------------------------------ writes

    def put(self, block_hash: int, parent: int, tokens: list[int], payload: bytes, priority: int = 0) -> bool:
        """Queue a block for writing (``priority``: its request's, for eviction); False when dropped
        (tier off, or the queue is full)."""
        if self.disabled:
            return False
        tokens = list(tokens)
        try:
            with self._lock:
                self._unwritten[block_hash] = (parent, tokens, payload)
            self._queue.put_nowait((block_hash, parent, tokens, payload, priority))
            return True
        except queue.Full:
            with self._lock:
                self._unwritten.pop(block_hash, None)
            self.counters.dropped += 1
            return False

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until every queued write is done (tests, benchmarks, shutdown)."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)

    def close(self) -> None:
        self.flush()
        self._queue.put(None)
        self._writer.join(timeout=5)

    def _write_loop(self) -> None:
        while True:
            item = self._queue.get()
            try:
                if item is None:
                    return
                if not self.disabled:
                    self._write(*item)
            except Exception:
                log.exception("KV disk tier: writing a block failed")
            finally:
                if item is not None:
                    with self._lock:
                        self._unwritten.pop(item[0], None)
                self._queue.task_done()

    def _write(self, block_hash: int, parent: int, tokens: list[int], payload: bytes, priority: int = 0) -> None:
        final = self.path(block_hash)
        if final.exists():  # content-addressed: whoever wrote it wrote these bytes
            self.counters.skipped += 1
            self._remember(block_hash, priority)
            return
        tmp = self.dir / f"{TEMP_PREFIX}{block_hash:016x}-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                for piece in encode_block(block_hash, parent, tokens, payload):
                    view = memoryview(piece)
                    while view:
                        view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, final)  # atomic: readers see the whole block or none
        except OSError as exc:
            try:
                tmp.unlink()
            except OSError:
                pass
            if exc.errno in FULL_ERRNOS:
                self.disabled = True
                log.error("KV disk tier %s is full (%s): turning the disk tier off", self.dir, exc.strerror)
                return
            raise
        self.counters.written += 1
        self.counters.written_bytes += self.file_bytes
        self._remember(block_hash, priority)
        if self.on_stored is not None:
            self.on_stored(block_hash, parent)
        self._evict()

    def _remember(self, block_hash: int, priority: int | None = None) -> None:
        """Mark a file most recently used; ``priority``: a request of it stored it (a file keeps the most
        important priority any request stored it with; None: a read, which keeps its priority)."""
        with self._lock:
            old = self._file_priority.get(block_hash)
            new = (0 if priority is None else priority) if old is None else \
                old if priority is None else min(old, priority)
            if old is not None and old != new:
                del self._files[old][block_hash]
            self._file_priority[block_hash] = new
            files = self._files.setdefault(new, OrderedDict())
            files[block_hash] = None
            files.move_to_end(block_hash)

    def _forget(self, block_hash: int) -> bool:
        """Drop a file from the index (the lock held); False if it was not there."""
        priority = self._file_priority.pop(block_hash, None)
        if priority is None:
            return False
        del self._files[priority][block_hash]
        return True

    def _evict(self) -> None:
        removed = []
        with self._lock:
            while self.used_bytes > self.capacity_bytes and self._file_priority:
                files = self._files[max(p for p, f in self._files.items() if f)]
                h, _ = files.popitem(last=False)
                del self._file_priority[h]
                removed.append(h)
        for h in removed:
            try:
                self.path(h).unlink()
            except FileNotFoundError:
                pass
            self.counters.evicted += 1
        if removed and self.on_removed is not None:
            self.on_removed(removed)

    def _scan(self) -> None:
        """Count the files already there (oldest first) and remove dead writers' temporary files."""
        now = time.time()
        found = []
        for entry in os.scandir(self.dir):
            try:
                st = entry.stat()
            except FileNotFoundError:
                continue
            if entry.name.startswith(TEMP_PREFIX):
                if now - st.st_mtime > STALE_TEMP_SECONDS:
                    try:
                        os.unlink(entry.path)
                    except OSError:
                        pass
            elif entry.name.endswith(SUFFIX):
                try:
                    found.append((st.st_mtime, int(entry.name[: -len(SUFFIX)], 16)))
                except ValueError:
                    continue
        for _, h in sorted(found):
            self._files[0][h] = None
            self._file_priority[h] = 0
        self._evict()

    # ------------------------------------------------------------------ reads

    def get(self, block_hash: int, parent: int, tokens: list[int]) -> memoryview | None:
        """The payload of the block, checked; None for a missing or bad file (a bad one is removed).
        A block this process has queued for writing is read from the queue's copy."""
        with self._lock:
            unwritten = self._unwritten.get(block_hash)
        if unwritten is not None and unwritten[0] == parent and unwritten[1] == list(tokens):
            return memoryview(bytearray(unwritten[2]))
        path = self.path(block_hash)
        try:
            buf = bytearray(self.file_bytes + 1)  # writable: the payload becomes a tensor without a copy
            with open(path, "rb") as f:
                n = f.readinto(buf)
            data = memoryview(buf)[:n]
        except FileNotFoundError:
            self._bad("missing", block_hash, path, remove=False)
            return None
        except OSError as exc:
            log.warning("KV disk tier: reading %s failed: %r", path, exc)
            self._bad("unreadable", block_hash, path, remove=False)
            return None
        payload = decode_block(data, block_hash, parent, tokens, self.payload_bytes)
        if payload is None:
            self._bad("truncated" if len(data) < self.file_bytes else "corrupt", block_hash, path, remove=True)
            return None
        self._remember(block_hash)
        return payload

    def _bad(self, reason: str, block_hash: int, path: Path, remove: bool) -> None:
        self.counters.bad[reason] = self.counters.bad.get(reason, 0) + 1
        with self._lock:
            self._forget(block_hash)
        if remove:
            log.warning("KV disk tier: %s block file %s removed (recomputing it)", reason, path.name)
            try:
                path.unlink()
            except OSError:
                pass
