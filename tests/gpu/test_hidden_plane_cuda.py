"""The hidden-state ring on a CUDA target: the shared-memory ring is page-locked for the device, a
bfloat16 store on the GPU gathers a batch's rows into it in one copy, and the draft's end reads
them back exact. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from workers.engine.hidden import HiddenStore
from workers.speculation.hidden_plane import PlaneWriter, Ring, RowLayout, make_ring, open_reader
from workers.speculation.payloads import HiddenRef

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]


def test_a_cuda_store_writes_its_rows_into_the_pinned_ring():
    store = HiddenStore((3, 16, 28), 4096, 576, torch.bfloat16, "cuda")
    for rows in store.rows.values():
        rows.normal_()
    layout = RowLayout((3, 16, 28), 576, torch.bfloat16)
    segment = make_ring(8 << 20)
    kind, reader = open_reader(["shm"], segment.name, [28, 3, 16], 576, "bfloat16")
    segment.unlink()
    writer = PlaneWriter(layout, Ring(segment, layout), pin=True)
    try:
        assert kind == "shm" and writer.pinned
        slots = torch.randperm(4096, device="cuda")[:300]
        offset, streamed = writer.write(300, lambda rows: store.gather(slots, layout.layers, rows))
        assert not streamed
        [got] = reader.resolve([HiddenRef(offset, 300)])
        for layer, t in zip((28, 3, 16), got):
            assert torch.equal(t, store.rows[layer][slots].cpu())
    finally:
        writer.close()
        reader.close()
