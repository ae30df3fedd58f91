"""The hidden-state data plane: rows written once by the target are read whole by the draft, a ring
row is never overwritten before the draft read it, streamed blocks arrive in bounded chunks, and no
shared-memory name outlives the handshake."""

from __future__ import annotations

import os

import pytest
import torch

from proto import spec_pb2
from workers.engine.hidden import HiddenStore
from workers.speculation import hidden_plane
from workers.speculation.hidden_plane import (HEADER, PlaneReader, PlaneWriter, Ring, RowLayout, ShmSegment, make_ring,
                                              open_reader)
from workers.speculation.payloads import HiddenRef

pytestmark = pytest.mark.unit

H = 16


def shm_names() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("tdm-h-")}


def pair(rows: int, wanted=(1, 3, 3), dtype=torch.float32, mode="shm"):
    """A writer and a reader over one ring of ``rows`` rows (or streamed), as a handshake makes them."""
    layout = RowLayout(hidden_plane.distinct(wanted), H, dtype)
    name = hidden_plane.dtype_name(dtype)
    if mode == "stream":
        return PlaneWriter(layout), open_reader(["stream"], "", list(wanted), H, name)[1]
    segment = ShmSegment(hidden_plane.ring_name(), HEADER + rows * layout.row_bytes, create=True)  # exactly ``rows``
    kind, reader = open_reader(["shm", "stream"], segment.name, list(wanted), H, name)
    assert kind == "shm"
    segment.unlink()
    return PlaneWriter(layout, Ring(segment, layout)), reader


def store_with_rows(dtype=torch.float32) -> HiddenStore:
    store = HiddenStore((1, 3), 64, H, dtype, "cpu")
    for layer in (1, 3):  # row s of layer l holds l * 1000 + s
        store.rows[layer].copy_((layer * 1000 + torch.arange(64)).to(dtype)[:, None].expand(64, H))
    return store


def write(writer: PlaneWriter, store: HiddenStore, slots: list[int], split: list[int]) -> list[HiddenRef]:
    """What the engine does for one batch: one block, a descriptor per sequence (``split``: row counts)."""
    offset, streamed = writer.write(len(slots), lambda rows: store.gather(torch.tensor(slots), writer.layers, rows))
    refs, at = [], offset
    for n in split:
        refs.append(HiddenRef(at, n, streamed))
        at += n
    return refs


def feed(writer: PlaneWriter, reader: PlaneReader) -> None:
    for chunk in writer.take_chunks():
        reader.chunk(spec_pb2.HiddenRows.FromString(chunk.SerializeToString()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["shm", "stream"])
def test_rows_arrive_per_sequence_in_the_drafts_layer_order(dtype, mode):
    store = store_with_rows(dtype)
    writer, reader = pair(32, dtype=dtype, mode=mode)
    refs = write(writer, store, [5, 6, 7, 20, 21], [3, 0, 2])
    feed(writer, reader)
    got = reader.resolve(refs + [None])
    assert got[3] == []  # no descriptor: nothing (inline rows, if any, stay as they came)
    assert [len(g) for g in got[:3]] == [3, 3, 3]  # wanted layers 1, 3, 3
    assert got[1][0].shape == (0, H)
    for seq, slots in ((0, [5, 6, 7]), (2, [20, 21])):
        for layer, rows in zip((1, 3, 3), got[seq]):
            assert rows.dtype == dtype
            assert rows[:, 0].float().tolist() == [float(torch.tensor(layer * 1000 + s, dtype=dtype)) for s in slots]
    assert writer.bytes == 5 * 2 * H * dtype.itemsize
    writer.close()
    reader.close()


def test_a_ring_row_is_never_overwritten_before_the_draft_read_it():
    store = store_with_rows()
    writer, reader = pair(8)
    first = write(writer, store, list(range(6)), [6])  # rows 0..5 of the ring
    assert not first[0].streamed
    # the draft has not read them: 4 more rows find no room (a block never wraps) and are streamed
    second = write(writer, store, list(range(10, 14)), [4])
    assert second[0].streamed and writer.streamed_rows == 4
    assert reader.resolve(first)[0][0][:, 0].tolist() == [1000.0 + s for s in range(6)]
    assert reader.ring.read == 6  # the draft moved its cursor past what it copied
    feed(writer, reader)
    assert reader.resolve(second)[0][0][:, 0].tolist() == [1010.0, 1011.0, 1012.0, 1013.0]
    # now there is room again: the block skips the ring's tail (rows 6, 7) and starts at its head
    third = write(writer, store, list(range(30, 35)), [5])
    assert not third[0].streamed and third[0].offset == 8
    # a descriptor of rows the draft already read (which the target may have reused) is refused
    with pytest.raises(ValueError, match="not readable"):
        reader.resolve(first)
    assert reader.resolve(third)[0][1][:, 0].tolist() == [3030.0 + i for i in range(5)]
    writer.close()
    reader.close()


def test_a_block_larger_than_the_ring_is_streamed_in_bounded_chunks(monkeypatch):
    monkeypatch.setattr(hidden_plane, "CHUNK_BYTES", 300)
    store = store_with_rows()
    writer, reader = pair(4)
    refs = write(writer, store, list(range(40)), [25, 15])
    assert all(r.streamed for r in refs)
    chunks = writer.take_chunks()
    assert len(chunks) == -(-40 * 2 * H * 4 // 300) and max(len(c.data) for c in chunks) <= 300
    for c in chunks:
        reader.chunk(c)
    got = reader.resolve(refs)
    assert got[1][2][:, 0].tolist() == [3025.0 + i for i in range(15)]
    writer.close()
    reader.close()


def test_no_segment_name_outlives_the_pair():
    before = shm_names()
    segment = make_ring(1 << 16)
    assert segment.name.lstrip("/") in shm_names() and segment.size % 4096 == 0  # whole pages (a device pins them)
    kind, reader = open_reader(["shm"], segment.name, [2], H, "float32")
    segment.unlink()  # the target unlinks once the draft answered: both still map it
    assert kind == "shm" and shm_names() == before
    layout = RowLayout((2,), H, torch.float32)
    writer = PlaneWriter(layout, Ring(segment, layout))
    offset, _ = writer.write(1, lambda rows: rows.fill_(7.0))
    assert reader.resolve([HiddenRef(offset, 1)])[0][0].tolist() == [[7.0] * H]
    writer.close()
    reader.close()
    assert writer.write(1, lambda rows: rows.fill_(1.0))[1]  # a closed ring: a late batch is streamed, not lost
    # a draft on another host (or with another /dev/shm) cannot map the name: it takes the stream
    kind, reader = open_reader(["shm", "stream"], "/tdm-h-nowhere", [2], H, "float32")
    assert kind == "stream" and reader.ring is None
    assert open_reader([], "", [2], H, "float32") == ("", None)  # a target that offers no plane: inline


def test_a_segment_that_cannot_be_reserved_leaves_no_name(monkeypatch):
    before = shm_names()

    def full(fd, offset, size):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    assert make_ring(1 << 20) is None
    assert shm_names() == before
    with pytest.raises(OSError):
        ShmSegment("/tdm-h-missing")
    assert HEADER % 8 == 0
