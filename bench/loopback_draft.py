"""A draft worker's gRPC service on a free loopback port, for benches that run the draft in a child
process: the child serves until killed and prints its port first (the parent reads that line)."""

from __future__ import annotations


async def serve_on_loopback(proposer, draft_id: str, max_num_speculative_tokens: int = 16) -> None:
    """Serve a :class:`workers.draft.service.DraftService` around ``proposer``; print the port."""
    import grpc

    from proto import spec_pb2_grpc
    from workers.draft.service import DraftService

    service = DraftService(proposer, draft_id, max_num_speculative_tokens)
    await service.start()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
    spec_pb2_grpc.add_DraftServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()
