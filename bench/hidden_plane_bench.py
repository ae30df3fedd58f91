"""What hidden states cost on the seam, per token: inline protobuf tensors against the data planes.

Usage: .venv/bin/python bench/hidden_plane_bench.py [--target-dtype float32|bfloat16] [--rounds 300]

The demo target (SmolLM2-135M, hidden 576) with the layers its bundled EAGLE-3 head reads (2, 15, 27,
in the draft's float32): the target's engine holds their rows (:class:`workers.engine.hidden.HiddenStore`,
filled with random rows: the values do not matter to the seam), and a draft service in a child
process (real gRPC on loopback) serves a proposer that touches every row it is given and answers
one token, so what is timed is the seam alone, not the head. For each plane (``inline``: Tensors in
every message, in the draft's dtype, as before; ``shm``: the shared-memory ring; ``stream``: chunked
rows on the stream) and two shapes, it runs rounds one after another and reports, per token (one
row of every layer):

- ``bytes/tok``: hidden-state bytes the target sent (inline) or wrote to the plane;
- ``target µs/tok``: the engine thread's part (gather the rows, convert the messages);
- ``round µs/tok``: from gathering the rows to the draft's answer being back (a whole round trip
  with the draft's decoding of the rows; the fixed cost of a gRPC round trip is in it, so compare
  the planes side by side).

Times are the median round's, divided by its tokens.

The planes take turns round by round, so each sees the same noise. Shapes: ``decode``, 8 sequences × 2 rows per round (a verdict's accepted tokens and bonus); ``prompt``,
one sequence of 1,024 rows per round (a prompt's rows on round 0).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS = [3, 16, 28]
PLANES = ("inline", "shm", "stream")  # the demo head's eagle_aux_hidden_state_layer_ids (2, 15, 27) in the target's numbering


async def serve_draft() -> None:
    """Child mode: a DraftService whose proposer touches the rows it gets; prints its port."""
    import grpc
    import torch

    from proto import spec_pb2_grpc
    from workers.draft.drafter import Capabilities, Draft, Drafter
    from workers.draft.service import DraftService

    class Touching(Drafter):
        caps = Capabilities("touching", tuple(LAYERS), "float32")  # the demo head's dtype on a CPU

        def commit(self, seq_id, tokens, hidden_states=(), sampling=None):
            for h in hidden_states:
                h.float().sum()  # the rows are read, as a head's projection would

        def draft(self, branches, ready=None):
            return [Draft([1]) for _ in branches]

        def verified(self, results):
            pass

        def release(self, seq_ids):
            pass

    torch.set_num_threads(1)
    service = DraftService(Touching(), "bench-draft")
    await service.start()
    server = grpc.aio.server(options=[("grpc.so_reuseport", 0), ("grpc.max_receive_message_length", 64 << 20)])
    spec_pb2_grpc.add_DraftServiceServicer_to_server(service, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def build_engine(dtype: str):
    import torch

    torch.set_num_threads(1)  # as the draft child: two busy cores, no spinning threads
    from workers.demo_model import demo_model_dir
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model

    model = load_model(demo_model_dir(), dtype=getattr(torch, dtype))
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=256, max_model_len=4096),
                    hidden_layers=tuple(LAYERS))
    for rows in engine.hidden.rows.values():
        rows.normal_()
    return engine


async def open_client(engine, port: int, plane: str):
    from runtime.messages import InstanceRecord
    from workers.speculation.convert import dtype_name
    from workers.speculation.hidden_plane import PlaneOffer
    from workers.target.draft_client import DraftClient

    store_dtype = dtype_name(next(iter(engine.hidden.rows.values())).dtype)
    offer = None if plane == "inline" else PlaneOffer(engine.hidden.hidden_size, store_dtype, plane)
    record = InstanceRecord("bench-draft", "ns", "draft", "speculate", "", grpc_address=f"127.0.0.1:{port}")
    client = DraftClient("bench-target", "", engine.vocab_size, record, hidden_layers=LAYERS, plane=offer)
    await client.connect()
    assert (client.plane.kind if client.plane else "inline") == plane, "the handshake chose another plane"
    return client


async def one_round(engine, client, fake, spans, r: int) -> tuple[float, float]:
    """(engine-thread seconds, whole-round seconds) of one round of proposal requests."""
    from workers.speculation.convert import DTYPES, draft_input_to_pb
    from workers.speculation.payloads import DraftInput

    started = time.perf_counter()
    if client.plane is None:
        hidden = engine.news.rows(fake, spans, tuple(LAYERS), DTYPES[client.hidden_dtype])
        refs = [None] * len(fake)
    else:
        refs = engine.news.block(fake, spans, client.plane)
        hidden = [[] for _ in fake]
    requests = [draft_input_to_pb(DraftInput(f"s{i}", r, [1], 1, hidden_states=h, hidden_ref=ref), client.hidden_dtype)
                for i, (h, ref) in enumerate(zip(hidden, refs))]
    converted = time.perf_counter()
    got = await client.collect(client.send(requests), 30.0)
    assert len(got) == len(fake), "a proposal did not come back"
    return converted - started, time.perf_counter() - started


async def run_shape(engine, port: int, shape: tuple[int, int], rounds: int) -> list[dict]:
    """Every plane, round after round in turn (each sees the same noise), medians per plane."""
    seqs, rows = shape
    per_seq = -(-rows // engine.config.block_size)
    fake = [SimpleNamespace(block_table=list(range(i * per_seq, (i + 1) * per_seq))) for i in range(seqs)]
    spans = [(0, rows)] * seqs
    clients = {plane: await open_client(engine, port, plane) for plane in PLANES}
    times: dict[str, list[tuple[float, float]]] = {plane: [] for plane in PLANES}
    try:
        for r in range(rounds + 3):  # three rounds to warm up
            for plane, client in clients.items():
                t = await one_round(engine, client, fake, spans, r)
                if r >= 3:
                    times[plane].append(t)
    finally:
        for client in clients.values():
            await client.close()
    tokens = seqs * rows  # per round
    return [{"plane": plane, "shape": f"{seqs}x{rows}",
             "bytes_per_token": (c.hidden_bytes + c.plane_bytes) / ((rounds + 3) * tokens),
             "target_us_per_token": 1e6 * statistics.median(t for t, _ in times[plane]) / tokens,
             "round_us_per_token": 1e6 * statistics.median(w for _, w in times[plane]) / tokens}
            for plane, c in clients.items()]


async def main(args) -> None:
    child = subprocess.Popen([sys.executable, __file__, "--serve"], stdout=subprocess.PIPE, cwd=ROOT)
    try:
        port = int(child.stdout.readline())
        engine = build_engine(args.target_dtype)
        results = []
        for shape, rounds in (((8, 2), args.rounds), ((1, 1024), max(args.rounds // 5, 5))):
            results += await run_shape(engine, port, shape, rounds)
        print(f"target dtype {args.target_dtype}, draft dtype float32, layers {LAYERS}, hidden 576")
        print(f"{'shape':>8} {'plane':>7} {'bytes/tok':>10} {'target µs/tok':>14} {'round µs/tok':>13}")
        for r in results:
            print(f"{r['shape']:>8} {r['plane']:>7} {r['bytes_per_token']:>10.0f} {r['target_us_per_token']:>14.1f} "
                  f"{r['round_us_per_token']:>13.1f}")
        if args.json:
            print(json.dumps(results))
    finally:
        child.kill()
        child.wait()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--target-dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--json", action="store_true", help="also print the results as JSON")
    args = parser.parse_args()
    asyncio.run(serve_draft() if args.serve else main(args))
