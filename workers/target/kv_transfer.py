"""Moving a prompt's KV cache (and hidden-state rows) from a prefill worker to a decode worker with NIXL.

Each worker of a disaggregated deployment registers its whole KV cache with one NIXL agent at start
(every layer's key and value tensor, and the hidden-state rows the drafts read, which live in the
same slots) and publishes the agent's metadata and memory layout in etcd on its lease
(:class:`runtime.messages.KvAgentRecord`). Requests then carry only block ids
(:class:`runtime.messages.KvHandoff`). The decode worker loads a prefill worker's agent the first time
it pulls from it, checks that the two layouts hold the same thing (:func:`incompatibility`), and
reads the blocks it lacks with one-sided READs: one descriptor per region per run of blocks that are
consecutive on both sides (:func:`block_runs`), all in one transfer request.

Memory is NIXL's ``DRAM`` (the CPU cache, over UCX's shared-memory or TCP transports here) or
``VRAM`` (a GPU cache, over NVLink/RDMA where UCX has them). NIXL calls go through one lock: the
agent is created without thread synchronisation, and the pull runs its blocking parts in a thread.
"""

from __future__ import annotations

import asyncio
import logging
import sys
import threading
import time
from dataclasses import dataclass

import torch

from runtime.messages import KvAgentRecord, KvLayout

log = logging.getLogger(__name__)


class TransferFailed(RuntimeError):
    """A pull did not complete. ``cancelled`` False: it may still write into the local blocks later
    (the request could not be released), so they must never be reused."""

    def __init__(self, message: str, cancelled: bool = True):
        super().__init__(message)
        self.cancelled = cancelled


def nixl_module():
    """The NIXL Python API (the ``nixl-cu12`` or ``nixl`` wheel), or None when neither is installed."""
    for name in ("nixl_cu12", "nixl"):
        try:
            module = __import__(name, fromlist=["nixl_agent"])
        except ImportError:
            continue
        if hasattr(module, "nixl_agent"):
            return module
        try:  # the meta-package keeps the API in nixl._api
            return __import__(f"{name}._api", fromlist=["nixl_agent"])
        except ImportError:
            continue
    return None


PROGRESS_DELAY_US = 1000  # the agent's progress thread sleeps this long between rounds
_construct = threading.Lock()


def make_agent(nixl, name: str):
    """A NIXL agent with UCX whose progress thread sleeps between rounds. (The Python API starts it
    with no delay, and it then spins a whole core even when idle; without the thread a one-sided
    READ from this agent's memory over TCP never progresses. The delay is set on the bindings'
    config on its way to the agent, which the Python API offers no other way to do.)"""
    api = sys.modules[nixl.nixl_agent.__module__]
    real = api.nixlBind.nixlAgent

    def with_delay(agent_name, config):
        config.pthrDelay = PROGRESS_DELAY_US
        return real(agent_name, config)

    with _construct:
        api.nixlBind.nixlAgent = with_delay
        try:
            return nixl.nixl_agent(name, nixl.nixl_agent_config(backends=["UCX"]))
        finally:
            api.nixlBind.nixlAgent = real


def kv_regions(engine) -> list[torch.Tensor]:
    """The tensors to register: keys and values of every layer, then the hidden rows per offered layer."""
    regions = [t for pair in engine.runner.kv_caches for t in pair]
    if engine.hidden is not None:
        regions.extend(engine.hidden.rows[layer] for layer in engine.hidden.layers)
    return regions


def layout_of(engine, model: str) -> KvLayout:
    """What ``engine``'s registered KV memory holds, and where block b of each region starts."""
    regions = kv_regions(engine)
    bs = engine.config.block_size
    k = engine.runner.kv_caches[0][0]
    block_bytes = [t[0].numel() * t.element_size() if i < 2 * len(engine.runner.kv_caches)
                   else bs * t.shape[1] * t.element_size() for i, t in enumerate(regions)]
    device = k.device
    return KvLayout(model, bs, str(k.dtype).removeprefix("torch."), len(engine.runner.kv_caches), k.shape[2],
                    k.shape[3], list(engine.hidden.layers) if engine.hidden is not None else [],
                    engine.hidden.hidden_size if engine.hidden is not None else 0, engine.blocks.num_blocks,
                    "VRAM" if device.type == "cuda" else "DRAM", device.index or 0,
                    [t.data_ptr() for t in regions], block_bytes)


def incompatibility(local: KvLayout, remote: KvLayout) -> str | None:
    """Why blocks of ``remote`` cannot be read into ``local`` (None: they can)."""
    for name in ("model", "block_size", "dtype", "num_layers", "kv_heads", "head_dim", "hidden_size"):
        a, b = getattr(local, name), getattr(remote, name)
        if a != b:
            return f"{name} differs ({b} there, {a} here)"
    if local.hidden_layers and local.hidden_layers != remote.hidden_layers:
        return f"hidden layers differ ({remote.hidden_layers} there, {local.hidden_layers} here)"
    if len(remote.block_bytes) < len(local.block_bytes) or any(
            a != b for a, b in zip(local.block_bytes, remote.block_bytes)):
        return "region sizes differ"
    return None


def block_runs(local: list[int], remote: list[int]) -> list[tuple[int, int, int]]:
    """(local start, remote start, count) runs of block pairs consecutive on both sides."""
    runs: list[tuple[int, int, int]] = []
    for a, b in zip(local, remote):
        if runs:
            la, rb, n = runs[-1]
            if a == la + n and b == rb + n:
                runs[-1] = (la, rb, n + 1)
                continue
        runs.append((a, b, 1))
    return runs


@dataclass
class PullStats:
    """What one pull moved: bytes, descriptors, seconds."""

    bytes: int
    descriptors: int
    seconds: float


class KvAgent:
    """This worker's NIXL agent over its engine's KV cache; plain values in."""

    def __init__(self, name: str, regions: list[torch.Tensor], layout: KvLayout, poll_interval: float = 0.0005):
        nixl = nixl_module()
        if nixl is None:
            raise RuntimeError("prefill/decode disaggregation needs NIXL: pip install nixl-cu12 (or nixl)")
        self.name = name
        self.layout = layout
        self.poll_interval = poll_interval
        self._lock = threading.RLock()
        self._agent = make_agent(nixl, name)
        if "UCX" not in self._agent.backends:
            raise RuntimeError("NIXL has no UCX backend here (check UCX_TLS; unset it or try UCX_TLS=tcp)")
        self._registered = self._agent.register_memory(regions)
        self._remotes: dict[str, tuple[bytes, str, KvLayout]] = {}  # instance id -> (metadata, agent name, layout)

    def record(self, instance_id: str) -> KvAgentRecord:
        with self._lock:
            metadata = self._agent.get_agent_metadata()
        return KvAgentRecord(instance_id, self.name, metadata, self.layout)

    def incompatibility(self, record: KvAgentRecord) -> str | None:
        return incompatibility(self.layout, record.layout)

    def _remote_name(self, record: KvAgentRecord) -> str:
        known = self._remotes.get(record.instance_id)
        if known is not None and known[0] == record.metadata:
            return known[1]
        if known is not None:  # the worker registered a new agent (restarted): forget the old one
            self.forget(record.instance_id)
        name = self._agent.add_remote_agent(record.metadata)
        name = name.decode() if isinstance(name, bytes) else name
        self._remotes[record.instance_id] = (record.metadata, name, record.layout)
        log.info("loaded the NIXL agent of worker %s", record.instance_id)
        return name

    def forget(self, instance_id: str) -> None:
        """Drop a remote agent (its worker left)."""
        known = self._remotes.pop(instance_id, None)
        if known is not None:
            with self._lock:
                try:
                    self._agent.remove_remote_agent(known[1])
                except Exception as exc:
                    log.debug("removing NIXL agent %s: %r", known[1], exc)

    def _descriptors(self, record: KvAgentRecord, local: list[int], remote: list[int]):
        mine, theirs = self.layout, record.layout
        runs = block_runs(local, remote)
        local_descs, remote_descs = [], []
        total = 0
        for r, size in enumerate(mine.block_bytes):
            for la, rb, n in runs:
                local_descs.append((mine.addresses[r] + la * size, n * size, mine.device_id))
                remote_descs.append((theirs.addresses[r] + rb * size, n * size, theirs.device_id))
                total += n * size
        return local_descs, remote_descs, total

    async def pull(self, record: KvAgentRecord, local: list[int], remote: list[int], timeout: float) -> PullStats:
        """READ ``remote`` blocks of ``record``'s worker into ``local`` blocks here, every region;
        raises :class:`TransferFailed` on an error or after ``timeout`` seconds."""
        started = time.perf_counter()
        if any(not 0 <= b < record.layout.num_blocks for b in remote):
            raise TransferFailed(f"block ids outside the {record.layout.num_blocks} blocks of worker "
                                 f"{record.instance_id}")
        handle, total, count = await asyncio.to_thread(self._post, record, local, remote)
        deadline = started + timeout
        state = "PROC" if handle is not None else "DONE"
        while state == "PROC":
            if time.perf_counter() >= deadline:
                cancelled = self._release(handle)
                raise TransferFailed(f"KV pull from {record.instance_id} timed out after {timeout:g}s", cancelled)
            await asyncio.sleep(self.poll_interval)
            with self._lock:
                state = self._agent.check_xfer_state(handle)
        if handle is not None:
            self._release(handle)
        if state != "DONE":
            raise TransferFailed(f"KV pull from {record.instance_id} failed ({state})")
        return PullStats(total, count, time.perf_counter() - started)

    def _post(self, record: KvAgentRecord, local: list[int], remote: list[int]):
        local_descs, remote_descs, total = self._descriptors(record, local, remote)
        if not local_descs:
            return None, 0, 0
        mem = self.layout.mem_type
        with self._lock:
            try:
                name = self._remote_name(record)
                agent = self._agent
                handle = agent.initialize_xfer("READ", agent.get_xfer_descs(local_descs, mem),
                                               agent.get_xfer_descs(remote_descs, record.layout.mem_type), name)
                state = agent.transfer(handle)
            except Exception as exc:
                raise TransferFailed(f"KV pull from {record.instance_id} could not start: {exc!r}") from exc
        if state == "ERR":
            self._release(handle)
            raise TransferFailed(f"KV pull from {record.instance_id} failed to post")
        if state == "DONE":  # small transfers complete as they are posted
            self._release(handle)
            return None, total, len(local_descs)
        return handle, total, len(local_descs)

    def _release(self, handle) -> bool:
        """Release a transfer request (cancelling it if still running); False if NIXL refused."""
        with self._lock:
            try:
                self._agent.release_xfer_handle(handle)
                return True
            except Exception as exc:
                log.error("NIXL refused to release a transfer: %r", exc)
                return False

    def close(self) -> None:
        with self._lock:
            for instance_id in list(self._remotes):
                try:
                    self._agent.remove_remote_agent(self._remotes.pop(instance_id)[1])
                except Exception:
                    pass
            try:
                self._agent.deregister_memory(self._registered)
            except Exception as exc:
                log.debug("NIXL deregister: %r", exc)
