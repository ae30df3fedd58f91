"""A draft service served over real gRPC on loopback, in this process, with a target's client on it."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

import grpc

from proto import spec_pb2_grpc
from runtime.messages import InstanceRecord
from workers.draft.service import DraftService
from workers.target.draft_client import DraftClient


@contextlib.asynccontextmanager
async def draft_on_loopback(service: DraftService, hidden_layers: list[int] = (),
                            pipelined: bool = False, vocab_size: int = 100, plane=None,
                            lanes: bool = True) -> AsyncIterator[DraftClient]:
    """Start ``service`` on a free loopback port and yield a connected target-side client (``pipelined``:
    asking for the pipelined seam; ``plane``: the hidden-state planes it offers, a PlaneOffer;
    ``lanes``: it offers a fast lane, which a service that listens on one takes)."""
    await service.start()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    spec_pb2_grpc.add_DraftServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    record = InstanceRecord(service.draft_id, "ns", "draft", "speculate", "", grpc_address=f"127.0.0.1:{port}")
    client = DraftClient("t1", "m", vocab_size, record, hidden_layers=list(hidden_layers), pipelined=pipelined, plane=plane,
                         lanes=lanes)
    try:
        await client.connect()
        yield client
    finally:
        await client.close()
        await server.stop(None)
        await service.stop()
