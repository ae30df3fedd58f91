"""The follower ranks of a tensor-parallel model: how rank 0 starts them and drives every step.

Usage: started by rank 0 (:meth:`Followers.start`), never by hand:
       python -m workers.engine.followers --rank R --size N --port P --backend gloo --timeout S

Rank 0 runs the whole engine (scheduler, block manager, sampling, speculation) and alone talks to
etcd, NATS and draft workers. Followers hold their shard of the model and of the KV cache and do
what rank 0's :class:`~workers.engine.model_runner.ModelRunner` does, call for call:

    rank 0                                       rank r > 0 (one process each)
    ModelRunner.forward(chunks, ...)  ──frame──▶  ModelRunner.forward(chunks, ...)
       └ model forward ◀── all-reduce / all-gather ──▶ └ model forward (logits dropped)

**How step inputs reach followers.** Each call's inputs (the scheduled chunks: token ids, first
position, block table; logits rows; hidden layers; tree parents; or the slots/blocks to copy) are
one msgspec frame (4-byte big-endian length + msgpack, never pickle) written to every follower's
stdin, a pipe, before rank 0 runs the call itself. A follower builds the same attention metadata
from them; the collectives inside the forward keep the ranks in step, so nothing is acknowledged.
The inputs are a few integers per token, so the frame costs microseconds next to the forward.

**Start-up.** Rank 0 serves a ``TCPStore`` on a free 127.0.0.1 port, spawns N-1 followers, sends
each the model to load (:class:`LoadModel`), waits (watching the children) until each is up, joins
the process group with them, loads its own shard and waits until every follower has loaded its;
the runner then sends :class:`Setup` (cache blocks, CUDA graphs) so every rank allocates the same
cache and captures graphs together.

**Faults.** Nothing can hang: a follower that exits is seen by rank 0's watchdog thread (which
fails the group and calls the ``on_failure`` hooks: the worker deregisters and exits) and by rank
0's next collective (gloo reports the closed connection at once); a rank that hangs fails the
others' collectives after ``timeout``. A follower exits when rank 0 closes its stdin (rank 0 gone or
done), when a call fails on it, and, on Linux, when its parent dies (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import BinaryIO, Union

import msgspec

from runtime.config import child_env, default_log_level
from runtime.lifetime import die_with_parent

from .parallel import TensorParallel, TensorParallelFailed

log = logging.getLogger(__name__)

JOINED_KEY = "tandem/tp/joined/{rank}"  # a follower is up and about to join the group
READY_KEY = "tandem/tp/ready/{rank}"  # a follower has loaded its shard


class LoadModel(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """What a follower loads: the same model as rank 0, its own shard, on its own device."""

    model: str
    dtype: str  # torch dtype name: float32, bfloat16, float16
    device: str  # rank 0's device; rank r uses cuda:(index + r) on CUDA
    threads: int
    attention: str = "torch"  # torch or triton
    fused: bool = False
    max_positions: int | None = None
    expert_parallel: bool = False  # a mixture of experts' experts sharded over the ranks (workers.engine.moe)


class Setup(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    """The cache and CUDA graphs of rank 0's runner (``graph_*``: its GraphConfig, None: no graphs)."""

    num_blocks: int
    block_size: int
    max_model_len: int | None = None
    graph_max_batch: int | None = None
    graph_query_lens: list[int] = []
    graph_hidden_layers: list[int] = []
    graph_trees: bool = False
    graph_capture: bool = True  # False: the static, padded forward run eagerly (CPU tests)


class Forward(msgspec.Struct, tag=True, array_like=True, omit_defaults=True):
    chunks: list[tuple[list[int], int, list[int]]]
    logits_last: list[int]
    hidden_layers: list[int] = []
    trees: list[list[int] | None] | None = None


class CopySlots(msgspec.Struct, tag=True, array_like=True):
    src: list[int]
    dst: list[int]


class CopyBlocks(msgspec.Struct, tag=True, array_like=True):
    pairs: list[tuple[int, int]]


class Stop(msgspec.Struct, tag=True, array_like=True):
    pass


Message = Union[LoadModel, Setup, Forward, CopySlots, CopyBlocks, Stop]
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)
_LEN = struct.Struct(">I")


def write_frame(stream: BinaryIO, message: Message) -> None:
    payload = _encoder.encode(message)
    stream.write(_LEN.pack(len(payload)) + payload)
    stream.flush()


def read_frame(stream: BinaryIO) -> Message | None:
    """The next message, or None at end of stream."""
    head = stream.read(_LEN.size)
    if len(head) < _LEN.size:
        return None
    size = _LEN.unpack(head)[0]
    payload = stream.read(size)
    if len(payload) < size:
        return None
    return _decoder.decode(payload)


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device given rank 0's: cuda:(k + rank) for cuda[:k], cpu for cpu."""
    if device.startswith("cuda"):
        base = int(device.split(":", 1)[1]) if ":" in device else 0
        return f"cuda:{base + rank}"
    return device


class Followers:
    """Rank 0's handle on the follower processes: sends them each call, watches them live."""

    def __init__(self, tp: TensorParallel, procs: list[subprocess.Popen], store):
        self.tp = tp
        self.procs = procs
        self._store = store  # rank 0 serves it: kept alive as long as the group
        self._lock = threading.Lock()
        self._hooks: list[Callable[[str], None]] = []
        self._closing = False
        self._watchdog = threading.Thread(target=self._watch, name="tp-watchdog", daemon=True)
        self._watchdog.start()

    @classmethod
    def start(cls, size: int, load: LoadModel, *, backend: str = "gloo", timeout: float = 60.0,
              join_timeout: float = 300.0) -> Followers:
        """Spawn ranks 1..size-1 and join the group as rank 0 (:attr:`tp`); they load their shards
        meanwhile (rank 0 loads its own, then calls :meth:`wait_loaded`). ``timeout`` bounds each
        collective, ``join_timeout`` the followers' start. Raises RuntimeError if one exits first."""
        import datetime

        import torch.distributed as dist

        store = dist.TCPStore("127.0.0.1", 0, size, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=timeout))
        procs = []
        env = child_env()  # the followers import this package from where rank 0 did, whatever their cwd
        for rank in range(1, size):
            cmd = [sys.executable, "-m", "workers.engine.followers", "--rank", str(rank), "--size", str(size),
                   "--port", str(store.port), "--backend", backend, "--timeout", str(timeout),
                   "--parent-pid", str(os.getpid())]
            proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, env=env)
            write_frame(proc.stdin, load)
            procs.append(proc)
        try:
            # a process start (importing torch) may take longer than a collective may: the group is
            # formed once every follower is up, so that its timeout bounds collectives only
            _wait_for(store, JOINED_KEY, procs, "start", join_timeout)
            tp = TensorParallel.connect(0, size, "127.0.0.1", store.port, backend, timeout, store=store)
        except Exception:
            _kill(procs)
            raise
        return cls(tp, procs, store)

    def wait_loaded(self, timeout: float = 600.0) -> None:
        """Wait until every follower has loaded its shard; raises RuntimeError (and stops them) if
        one exits first or ``timeout`` seconds pass."""
        try:
            _wait_for(self._store, READY_KEY, self.procs, "load the model", timeout)
        except RuntimeError:
            self.close()
            raise
        log.info("tensor parallelism: %d follower rank(s) loaded", len(self.procs))

    def on_failure(self, hook: Callable[[str], None]) -> None:
        """Call ``hook(reason)`` (from any thread) once the group fails (at once if it has)."""
        self._hooks.append(hook)
        self.tp.on_fail = self._failed
        if self.tp.failed is not None:
            hook(self.tp.failed)

    def _failed(self, reason: str) -> None:
        for hook in self._hooks:
            try:
                hook(reason)
            except Exception:
                log.exception("tensor-parallel failure hook failed")

    # ------------------------------------------------------------------ calls

    def setup(self, num_blocks: int, block_size: int, max_model_len: int | None, graphs) -> None:
        self._send(Setup(num_blocks, block_size, max_model_len,
                         graphs.max_batch if graphs is not None else None,
                         list(graphs.query_lens) if graphs is not None else [],
                         list(graphs.hidden_layers) if graphs is not None else [],
                         bool(graphs.trees) if graphs is not None else False,
                         bool(graphs.capture) if graphs is not None else True))

    def forward(self, chunks, logits_last, hidden_layers, trees) -> None:
        self._send(Forward([(list(c), s, list(t)) for c, s, t in chunks], list(logits_last), list(hidden_layers),
                           [list(t) if t is not None else None for t in trees] if trees else None))

    def copy_slots(self, src: list[int], dst: list[int]) -> None:
        self._send(CopySlots(src, dst))

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        self._send(CopyBlocks(list(pairs)))

    def _send(self, message: Message) -> None:
        payload = _encoder.encode(message)
        frame = _LEN.pack(len(payload)) + payload
        with self._lock:
            for rank, proc in enumerate(self.procs, start=1):
                try:
                    proc.stdin.write(frame)
                    proc.stdin.flush()
                except (BrokenPipeError, OSError, ValueError) as exc:
                    self.tp.fail(f"rank {rank} unreachable: {exc!r}")
                    raise TensorParallelFailed(self.tp.failed) from exc

    # ------------------------------------------------------------------ lifetime

    def _watch(self) -> None:
        while not self._closing:
            for rank, proc in enumerate(self.procs, start=1):
                code = proc.poll()
                if code is not None and not self._closing:
                    self.tp.fail(f"tensor-parallel rank {rank} exited with code {code}")
                    return
            time.sleep(0.2)

    def close(self, timeout: float = 10.0) -> None:
        """Stop the followers (a Stop frame, then closed pipes; killed after ``timeout``)."""
        self._closing = True
        with self._lock:
            for proc in self.procs:
                try:
                    write_frame(proc.stdin, Stop())
                    proc.stdin.close()
                except (BrokenPipeError, OSError, ValueError):
                    pass
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel follower pid %d did not stop: killing it", proc.pid)
                proc.kill()
                proc.wait()


def load_sharded(path: str, size: int, *, dtype: str = "float32", device: str = "cpu", threads: int = 1,
                 attention: str = "torch", fused: bool = False, max_positions: int | None = None,
                 timeout: float = 60.0, expert_parallel: bool = False):
    """Rank 0's shard of the model at ``path`` over ``size`` ranks, and its :class:`Followers` (ranks
    1..size-1, started and loaded): give both to the :class:`~workers.engine.engine.Engine`. NCCL on
    CUDA, gloo on CPU; ``threads`` torch threads per rank. The caller closes the followers."""
    import torch

    from .weights import load_model

    backend = "nccl" if device.startswith("cuda") else "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(rank_device(device, 0))
    load = LoadModel(str(path), dtype, device, threads, attention, fused, max_positions, expert_parallel)
    followers = Followers.start(size, load, backend=backend, timeout=timeout)
    try:
        attention_fn = None
        if attention == "triton":
            from .triton_attention import paged_attention_triton as attention_fn
        model = load_model(path, dtype=getattr(torch, dtype), device=rank_device(device, 0),
                           max_positions=max_positions, attention_fn=attention_fn, fused=fused, tp=followers.tp,
                           expert_parallel=expert_parallel)
        followers.wait_loaded()
    except BaseException:
        followers.close()
        raise
    return model, followers


def _wait_for(store, key: str, procs: list[subprocess.Popen], what: str, timeout: float) -> None:
    """Wait until every follower has set ``key`` in the store; RuntimeError if one exits or time runs out."""
    deadline = time.monotonic() + timeout
    for rank, proc in enumerate(procs, start=1):
        while not store.check([key.format(rank=rank)]):
            if proc.poll() is not None:
                raise RuntimeError(f"tensor-parallel rank {rank} exited (code {proc.returncode}) "
                                   f"before it could {what}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"tensor-parallel rank {rank} did not {what} in {timeout:.0f}s")
            time.sleep(0.05)


def _kill(procs: list[subprocess.Popen]) -> None:
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------- the follower process


def follow(rank: int, size: int, port: int, backend: str, timeout: float, stream: BinaryIO) -> int:
    """A follower's life: load, set up, then repeat rank 0's calls until Stop or end of stream."""
    import torch

    from .cuda_graphs import GraphConfig
    from .model_runner import ModelRunner
    from .weights import load_model

    load = read_frame(stream)
    if not isinstance(load, LoadModel):
        log.error("rank %d: expected the model to load first, got %r", rank, load)
        return 1
    torch.set_num_threads(load.threads)
    device = rank_device(load.device, rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
    import datetime

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", port, size, is_master=False, timeout=datetime.timedelta(seconds=timeout))
    store.set(JOINED_KEY.format(rank=rank), "1")
    tp = TensorParallel.connect(rank, size, "127.0.0.1", port, backend, timeout, store=store)
    attention_fn = None
    if load.attention == "triton":
        from .triton_attention import paged_attention_triton as attention_fn
    model = load_model(load.model, dtype=getattr(torch, load.dtype), device=device, max_positions=load.max_positions,
                       attention_fn=attention_fn, fused=load.fused, tp=tp, expert_parallel=load.expert_parallel)
    store.set(READY_KEY.format(rank=rank), "1")
    runner = None
    while True:
        msg = read_frame(stream)
        if msg is None:
            log.info("rank %d: rank 0 closed the step stream; exiting", rank)
            return 0
        if isinstance(msg, Stop):
            return 0
        if isinstance(msg, Setup):
            graphs = None
            if msg.graph_max_batch is not None:
                graphs = GraphConfig(msg.graph_max_batch, tuple(msg.graph_query_lens), tuple(msg.graph_hidden_layers),
                                     capture=msg.graph_capture, trees=msg.graph_trees)
            runner = ModelRunner(model, msg.num_blocks, msg.block_size, graphs, msg.max_model_len)
        elif runner is None:
            log.error("rank %d: a step before the cache was set up", rank)
            return 1
        elif isinstance(msg, Forward):
            runner.forward(msg.chunks, msg.logits_last, tuple(msg.hidden_layers), msg.trees)
        elif isinstance(msg, CopySlots):
            runner.copy_slots(torch.tensor(msg.src, dtype=torch.long, device=runner.device),
                              torch.tensor(msg.dst, dtype=torch.long, device=runner.device))
        elif isinstance(msg, CopyBlocks):
            runner.copy_blocks([tuple(p) for p in msg.pairs])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m workers.engine.followers",
                                     description="a tensor-parallel follower rank (started by rank 0)")
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--size", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--backend", default="gloo")
    parser.add_argument("--timeout", type=float, default=60.0)
    parser.add_argument("--parent-pid", type=int, default=None, help="rank 0's pid (default: this process's parent)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=default_log_level(),
                        format=f"%(asctime)s %(levelname)s [tp rank {args.rank}] %(name)s: %(message)s")
    die_with_parent(args.parent_pid or os.getppid())  # SIGKILL when rank 0 dies, even mid-collective
    # a Ctrl-C or a stop of the whole process group reaches rank 0 too, which drains and then stops us
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, signal.SIG_IGN)
    try:
        code = follow(args.rank, args.size, args.port, args.backend, args.timeout, sys.stdin.buffer)
    except Exception:
        log.exception("tensor-parallel rank %d failed; exiting", args.rank)
        code = 1
    sys.exit(code)


if __name__ == "__main__":
    main()
