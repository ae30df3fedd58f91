"""Shared fixtures: one real etcd and one real nats-server per test session, a namespace per test."""

from __future__ import annotations

import logging
import os
import uuid

import torch

# Without CUDA a Triton kernel runs only under Triton's interpreter, and Triton decides once, when it
# is first imported, whether its own library (tl.sum, …) is interpreted or compiled: a test module
# that switches the interpreter on for itself fails (16 times, "Cannot call @triton.jit'd outside of
# the scope of a kernel") whenever an earlier one imported Triton first. So for the whole session,
# before anything imports it (on a CUDA machine nothing changes).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from runtime import Runtime, RuntimeConfig
from tests.support.procs import ManagedProcess
from tests.support.servers import EtcdServer, NatsServer, env_for, start_servers


@pytest.fixture(scope="session")
def servers():
    etcd, nats_ = start_servers()
    yield etcd, nats_
    etcd.cleanup()
    nats_.cleanup()


@pytest.fixture
def etcd_server(servers) -> EtcdServer:
    return servers[0]


@pytest.fixture
def nats_server(servers) -> NatsServer:
    return servers[1]


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:10]


@pytest.fixture
def runtime_config(etcd_server, nats_server, namespace) -> RuntimeConfig:
    return RuntimeConfig(
        etcd_url=etcd_server.url,
        nats_url=nats_server.url,
        namespace=namespace,
        lease_ttl=3,
        drain_timeout=10,
        ack_timeout=5,
        heartbeat_interval=0.5,
        handle_signals=False,
    )


@pytest.fixture
async def rt(runtime_config):
    async with Runtime.connect(runtime_config) as runtime:
        yield runtime


@pytest.fixture
def child_env(etcd_server, nats_server, namespace):
    return env_for(etcd_server, nats_server, namespace)


@pytest.fixture
def spawn(child_env):
    """Start ``python -m module`` children that are stopped (and their logs shown) at teardown."""
    procs: list[ManagedProcess] = []

    def _spawn(module: str, *args: str, env: dict | None = None, name: str | None = None) -> ManagedProcess:
        proc = ManagedProcess(module, list(args), env or child_env, name).start()
        procs.append(proc)
        return proc

    yield _spawn
    for proc in procs:
        proc.stop(timeout=10)
        logging.getLogger("tests").info("--- %s log ---\n%s", proc.name, proc.logs()[-3000:])
