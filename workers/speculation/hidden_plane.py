"""The hidden-state data plane between a target and a draft worker: rows written once, ids on gRPC.

A draft method that reads target hidden states (EAGLE, EAGLE-3, Medusa, MLP) needs, per committed
token, the target's hidden state of a few layers at the position before it. Inline (the plane
``""``), every proposal request and verdict carries them as protobuf ``Tensor`` bytes, per sequence
and layer, in the draft's dtype. On a plane the target writes each batch's rows once, in its own
dtype, as one block ``[rows, layers, hidden]`` (the draft's layers, distinct and ascending), and the
gRPC messages carry only :class:`~workers.speculation.payloads.HiddenRef` descriptors
``(offset, count, streamed)`` into it:

- ``shm`` (target and draft on one host): a POSIX shared-memory ring the target creates per stream
  (a unique name per target/draft pair) and offers in ``Hello``; the draft maps it, answers ``shm``
  in ``HelloAck``, and the target unlinks the name at once, so no segment outlives the pair (a
  crash of either side frees it with its mapping). The memory is reserved with ``posix_fallocate``
  when the ring is made (a full ``/dev/shm`` fails then, and the pair falls back to ``stream``,
  instead of a SIGBUS at the first write). Layout: a 64-byte header (the draft's read cursor, u64)
  then ``capacity`` rows. Row ``offset`` lies at ``offset % capacity`` and a block never wraps (the
  target skips to the start instead). **Fencing**: the target writes a block at ``[o, o + n)``
  only when ``o + n <= read + capacity``, where ``read`` is the draft's cursor: every row of the
  ring the block overwrites was read before. The draft copies a message's rows out, then moves its
  cursor past them; a descriptor below its cursor is refused. A block that finds no room (a draft
  that lags, or a prompt larger than the ring) goes on the streamed plane instead: never a wait.
  On a CUDA target the ring is pinned in place (``cudaHostRegister``), so the rows come off the
  device in one DMA per batch; a draft on a GPU copies them on in one more.
- ``stream`` (other hosts, or no shared memory): the block's bytes travel in ``HiddenRows``
  messages of at most :data:`CHUNK_BYTES` each on the same gRPC stream, before the batch that
  refers to them; no payload size breaks the stream.

Why pinned shared host memory rather than CUDA IPC of a device buffer: it serves drafts on a CPU
(tests, the demo) and on a GPU alike, its lifetime is the kernel's (an unlinked segment dies with
its last mapping; an IPC handle pins the exporter's allocation until every importer lets go), and
the rows are small (kilobytes per token), so one DMA per batch is not the cost.
"""

from __future__ import annotations

import logging
import mmap
import os
import secrets
import threading
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from .convert import DTYPES, dtype_name
from .payloads import HiddenRef

try:
    import _posixshmem  # CPython's POSIX shm_open / shm_unlink (what multiprocessing.shared_memory uses)
except ImportError:  # not a POSIX platform: only the streamed plane
    _posixshmem = None

log = logging.getLogger(__name__)

HEADER = 64  # bytes before the first row: u64 read cursor (written by the draft), the rest reserved
CHUNK_BYTES = 4 << 20  # the largest HiddenRows payload: far below gRPC's message limit
PLANES = ("shm", "stream")  # what a target offers, best first ("" is inline)
RING_BYTES = 64 << 20  # default ring size


def ring_name() -> str:
    """A fresh segment name, unique per target/draft stream (short: some systems allow 31 bytes)."""
    return f"/tdm-h-{os.getpid():x}-{secrets.token_hex(6)}"


def distinct(layers) -> tuple[int, ...]:
    """A plane's row layout: the layers a draft asked for, distinct and ascending."""
    return tuple(sorted(set(layers)))


class ShmSegment:
    """A mapped POSIX shared-memory segment: ``create`` (the target) or open an existing one."""

    def __init__(self, name: str, size: int = 0, create: bool = False):
        if _posixshmem is None:
            raise OSError("POSIX shared memory is not available here")
        self.name = name
        self.linked = create
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = _posixshmem.shm_open(name, flags, mode=0o600)
        try:
            if create:
                try:
                    os.ftruncate(fd, size)
                    os.posix_fallocate(fd, 0, size)  # reserve now: a full /dev/shm fails here, not with SIGBUS
                except BaseException:
                    _posixshmem.shm_unlink(name)
                    raise
            else:
                size = os.fstat(fd).st_size
            self.mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.size = size
        self.buf = torch.frombuffer(self.mmap, dtype=torch.uint8)  # the whole segment, shared

    def unlink(self) -> None:
        """Remove the name (the memory lives on while mapped); idempotent."""
        if self.linked:
            self.linked = False
            try:
                _posixshmem.shm_unlink(self.name)
            except FileNotFoundError:
                pass

    def close(self) -> None:
        self.buf = None
        try:
            self.mmap.close()
        except BufferError:  # a view is still referenced somewhere: the mapping goes with it
            pass


@dataclass(frozen=True)
class RowLayout:
    """What a row is: ``layers`` (distinct, ascending) × ``hidden`` values of ``dtype``."""

    layers: tuple[int, ...]
    hidden: int
    dtype: torch.dtype

    @property
    def row_bytes(self) -> int:
        return len(self.layers) * self.hidden * self.dtype.itemsize


class Ring:
    """The ring's rows ``[capacity, layers, hidden]`` and its read cursor, over a mapped segment."""

    def __init__(self, segment: ShmSegment, layout: RowLayout):
        self.segment, self.layout = segment, layout
        self.capacity = (segment.size - HEADER) // layout.row_bytes
        if self.capacity < 1:
            raise ValueError(f"a ring of {segment.size} bytes holds no row of {layout.row_bytes} bytes")
        body = segment.buf[HEADER : HEADER + self.capacity * layout.row_bytes]
        self.rows = body.view(layout.dtype).view(self.capacity, len(layout.layers), layout.hidden)
        self._cursor = np.frombuffer(segment.mmap, dtype=np.uint64, count=1)  # aligned 8-byte word

    @property
    def read(self) -> int:
        return int(self._cursor[0])

    @read.setter
    def read(self, value: int) -> None:
        self._cursor[0] = value

    def close(self) -> None:
        self.rows = self._cursor = None
        self.segment.close()


# ---------------------------------------------------------------------------- the target's side


@dataclass(frozen=True)
class PlaneOffer:
    """What a target offers its drafts: rows of ``hidden`` values in ``dtype`` (its own; a wire
    name), on ``mode``: "auto" (the ring when the draft shares this host, else streamed), "shm",
    "stream", or "inline" (no plane: Tensors in the messages); a ring of ``ring_bytes``."""

    hidden: int
    dtype: str
    mode: str = "auto"
    ring_bytes: int = RING_BYTES

    def __post_init__(self):
        if self.mode not in ("auto", "shm", "stream", "inline"):
            raise ValueError(f"hidden plane must be auto, shm, stream or inline, got {self.mode!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"unsupported hidden-state dtype {self.dtype!r}")
        if self.ring_bytes < 1 << 20:
            raise ValueError(f"the hidden-state ring needs at least 1 MiB, got {self.ring_bytes} bytes")

    @property
    def planes(self) -> tuple[str, ...]:
        return {"auto": PLANES, "shm": ("shm",), "stream": ("stream",), "inline": ()}[self.mode]


class PlaneWriter:
    """The target's end of a plane: a block of rows per batch, written once (on the engine's thread).

    :meth:`write` finds where ``n`` rows go (a ring slice, or a fresh host tensor for the streamed
    plane) and has the engine fill it in one gather (:meth:`workers.engine.hidden.HiddenStore.gather`).
    Streamed blocks become ``HiddenRows`` chunks the draft client sends before its next batch
    (:meth:`take_chunks`). :meth:`close` (the event loop, when the stream goes) waits for a write in
    progress, so the ring is never unmapped under the engine's copy. Counters: ``bytes`` and ``rows``
    written, ``streamed_rows``."""

    def __init__(self, layout: RowLayout, ring: Ring | None = None, pin: bool = False):
        self.layout = layout
        self.ring = ring
        self.kind = "shm" if ring is not None else "stream"
        self._next = 0  # ring: the next free offset (every earlier one handed out)
        self._streamed = 0  # streamed plane: the next offset
        self._chunks: list = []  # spec_pb2.HiddenRows waiting to be sent
        self.bytes = self.rows = self.streamed_rows = 0
        self._lock = threading.Lock()
        self.pinned = False  # the ring is page-locked for the device's DMA (a CUDA target)
        if ring is not None and pin and torch.cuda.is_available():
            try:
                err = torch.cuda.cudart().cudaHostRegister(ring.segment.buf.data_ptr(), ring.segment.size, 0)
                self.pinned = getattr(err, "value", err) == 0
            except Exception:  # unpinned, the copies are slower, not wrong
                log.warning("the hidden-state ring could not be pinned for the device", exc_info=True)
            if not self.pinned:
                log.warning("the hidden-state ring is not pinned: rows come off the device in pageable copies")

    @property
    def layers(self) -> tuple[int, ...]:
        return self.layout.layers

    def write(self, n: int, fill: Callable[[torch.Tensor], None]) -> tuple[int, bool]:
        """Write a block of ``n`` rows: ``fill(rows)`` writes them into rows [n, layers, hidden] on the
        host; returns (offset, streamed), what the block's descriptors say."""
        with self._lock:
            rows, offset, streamed = self._block(n)
            if n:
                fill(rows)
            self._written(rows, offset, streamed)
        return offset, streamed

    def _block(self, n: int) -> tuple[torch.Tensor, int, bool]:
        """Where ``n`` rows go: (rows [n, layers, hidden] on the host, offset, streamed)."""
        ring = self.ring
        if ring is not None and n > 0:
            o = self._next
            pos = o % ring.capacity
            if pos + n > ring.capacity:  # a block never wraps: skip the ring's tail
                o += ring.capacity - pos
                pos = 0
            if o + n <= ring.read + ring.capacity:
                self._next = o + n
                return ring.rows[pos : pos + n], o, False
        if ring is not None and n > 0:
            if not self.streamed_rows:
                log.info("hidden rows: a block of %d rows found no room in the ring of %d; streaming it (and any "
                         "such block) instead", n, ring.capacity)
        o = self._streamed
        self._streamed += n
        layout = self.layout
        return torch.empty(n, len(layout.layers), layout.hidden, dtype=layout.dtype), o, True

    def _written(self, rows: torch.Tensor, offset: int, streamed: bool) -> None:
        """``rows`` of :meth:`_block` are filled: a streamed block becomes chunks."""
        n = rows.shape[0]
        self.rows += n
        self.bytes += n * self.layout.row_bytes
        if not streamed or n == 0:
            return
        from proto import spec_pb2

        self.streamed_rows += n
        raw = rows.reshape(-1).view(torch.uint8).numpy()  # one view of the whole block, no per-row work
        for at in range(0, raw.nbytes, CHUNK_BYTES):
            self._chunks.append(spec_pb2.HiddenRows(offset=offset, rows=n, at=at,
                                                    data=raw[at : at + CHUNK_BYTES].tobytes()))

    def take_chunks(self) -> list:
        out, self._chunks = self._chunks, []
        return out

    def close(self) -> None:
        """Unlink and unmap the ring (once no write is in progress); later writes are streamed."""
        with self._lock:
            ring, self.ring = self.ring, None
            if ring is None:
                return
            if self.pinned:
                torch.cuda.cudart().cudaHostUnregister(ring.segment.buf.data_ptr())
                self.pinned = False
            ring.segment.unlink()
            ring.close()


def make_ring(layout_bytes: int) -> ShmSegment | None:
    """A fresh segment for one stream's ring, or None when shared memory cannot be had here."""
    page = mmap.PAGESIZE  # whole pages: what the device pins
    try:
        return ShmSegment(ring_name(), -(-(HEADER + layout_bytes) // page) * page, create=True)
    except OSError:
        return None


# ---------------------------------------------------------------------------- the draft's side


class PlaneReader:
    """The draft's end: turns a message's descriptors into per-layer rows in the order it asked for.

    ``wanted``: the draft's layers, repeats included (EAGLE-3 on a 4-layer target reads [2, 2, 1]);
    rows come in the plane's layout (:func:`distinct`). Each message's rows are copied out of the
    ring at once (one copy per block) and only then is the read cursor moved past them."""

    def __init__(self, wanted, hidden: int, dtype: str, segment: ShmSegment | None = None):
        if dtype not in DTYPES:
            raise ValueError(f"unsupported hidden-state dtype {dtype!r}")
        self.layout = RowLayout(distinct(wanted), hidden, DTYPES[dtype])
        self.index = [self.layout.layers.index(layer) for layer in wanted]
        self.ring = Ring(segment, self.layout) if segment is not None else None
        self._blocks: dict[int, tuple[int, bytearray, int]] = {}  # streamed offset -> (rows, data, bytes received)
        self._streamed_done: dict[int, torch.Tensor] = {}
        self.bytes = 0  # hidden-state bytes read
        self._lock = threading.Lock()  # resolve (maybe in a thread) against close (the event loop)

    @property
    def kind(self) -> str:
        return "shm" if self.ring is not None else "stream"

    def chunk(self, msg) -> None:
        """One ``HiddenRows`` message: part of a streamed block."""
        size = msg.rows * self.layout.row_bytes
        rows, data, got = self._blocks.get(msg.offset) or (msg.rows, bytearray(size), 0)
        if rows != msg.rows or msg.at + len(msg.data) > size:
            raise ValueError(f"hidden rows chunk out of its block (offset {msg.offset}, at {msg.at})")
        data[msg.at : msg.at + len(msg.data)] = msg.data
        got += len(msg.data)
        self.bytes += len(msg.data)
        if got < size:
            self._blocks[msg.offset] = (rows, data, got)
            return
        self._blocks.pop(msg.offset, None)
        layout = self.layout
        self._streamed_done[msg.offset] = torch.frombuffer(data, dtype=layout.dtype).view(
            rows, len(layout.layers), layout.hidden) if rows else torch.empty(0, len(layout.layers), layout.hidden)

    def resolve(self, refs: list[HiddenRef | None]) -> list[list[torch.Tensor]]:
        """Per descriptor of one message, the rows of each wanted layer ([count, hidden] each; [] for None)."""
        with self._lock:
            return self._resolve(refs)

    def _resolve(self, refs: list[HiddenRef | None]) -> list[list[torch.Tensor]]:
        live = [r for r in refs if r is not None and r.count > 0]
        out_blocks: dict[bool, tuple[int, torch.Tensor]] = {}
        for streamed in (False, True):
            mine = [r for r in live if r.streamed == streamed]
            if not mine:
                continue
            lo, hi = min(r.offset for r in mine), max(r.offset + r.count for r in mine)
            out_blocks[streamed] = (lo, self._streamed_rows(lo, hi) if streamed else self._ring_rows(lo, hi))
        out = []
        for r in refs:
            if r is None:
                out.append([])
                continue
            if r.count == 0:
                out.append([torch.empty(0, self.layout.hidden, dtype=self.layout.dtype) for _ in self.index])
                continue
            lo, block = out_blocks[r.streamed]
            rows = block[r.offset - lo : r.offset - lo + r.count]
            out.append([rows[:, i] for i in self.index])
        return out

    def _ring_rows(self, lo: int, hi: int) -> torch.Tensor:
        ring = self.ring
        if ring is None:
            raise ValueError("a descriptor into a ring this stream has not mapped")
        pos = lo % ring.capacity
        if lo < ring.read or hi - lo > ring.capacity or pos + (hi - lo) > ring.capacity:
            raise ValueError(f"hidden rows [{lo}, {hi}) are not readable (read cursor {ring.read}, "
                             f"capacity {ring.capacity})")
        rows = ring.rows[pos : pos + hi - lo].clone()  # copied out before the cursor frees them
        ring.read = hi
        self.bytes += rows.numel() * rows.element_size()
        return rows

    def _streamed_rows(self, lo: int, hi: int) -> torch.Tensor:
        for offset in sorted(self._streamed_done):
            block = self._streamed_done[offset]
            if offset <= lo and hi <= offset + block.shape[0]:
                for done in [o for o in self._streamed_done if o <= offset]:  # blocks come in order
                    del self._streamed_done[done]
                return block[lo - offset :]
        raise ValueError(f"streamed hidden rows [{lo}, {hi}) never arrived")

    def close(self) -> None:
        with self._lock:
            ring, self.ring = self.ring, None
            if ring is not None:
                ring.close()
            self._blocks.clear()
            self._streamed_done.clear()


def open_reader(planes, shm_name: str, wanted, hidden: int, dtype: str) -> tuple[str, PlaneReader | None]:
    """The draft's choice from a target's offer (``Hello.hidden_planes``): ("shm", reader) when it
    could map the ring, else ("stream", reader) when offered, else ("", None): inline Tensors."""
    if not wanted or not planes or dtype not in DTYPES or hidden <= 0:
        return "", None
    if "shm" in planes and shm_name:
        try:
            segment = ShmSegment(shm_name)
        except OSError:
            segment = None  # another host (or another /dev/shm): the name is not here
        if segment is not None:
            try:
                return "shm", PlaneReader(wanted, hidden, dtype, segment)
            except ValueError:
                segment.close()
    if "stream" in planes:
        return "stream", PlaneReader(wanted, hidden, dtype)
    return "", None


__all__ = ["CHUNK_BYTES", "PLANES", "RING_BYTES", "PlaneOffer", "PlaneReader", "PlaneWriter", "Ring", "RowLayout", "ShmSegment",
           "distinct", "dtype_name", "make_ring", "open_reader"]
