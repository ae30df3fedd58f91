"""Real etcd and nats-server processes on free loopback ports, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

# One lookup for binaries and ports, shared with the launcher (tests may import deploy/).
from deploy.binaries import find_binary, free_port, wait_port
from runtime.config import child_env

__all__ = ["EtcdServer", "NatsServer", "env_for", "find_binary", "free_port", "running_servers", "start_servers",
           "wait_port"]


class _Server:
    name = ""

    def __init__(self):
        self.proc: subprocess.Popen | None = None
        self.port = free_port()
        self.workdir = Path(tempfile.mkdtemp(prefix=f"tandem-{self.name}-"))
        self.log_path = self.workdir / f"{self.name}.log"

    def _argv(self) -> list[str]:
        raise NotImplementedError

    def start(self) -> None:
        log = open(self.log_path, "ab")
        self.proc = subprocess.Popen(self._argv(), stdout=log, stderr=subprocess.STDOUT, cwd=self.workdir)
        try:
            wait_port(self.port)
        except TimeoutError:
            self.stop()
            raise RuntimeError(f"{self.name} did not start; log:\n{self.log_path.read_text()[-3000:]}")

    def stop(self, kill: bool = False) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.stop()
        self.start()

    def cleanup(self) -> None:
        self.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)


class EtcdServer(_Server):
    name = "etcd"

    def __init__(self, *extra: str, scheme: str = "http"):
        super().__init__()
        self.peer_port = free_port()
        self.extra = list(extra)  # e.g. ("--cert-file", ..., "--key-file", ...) with scheme="https"
        self.scheme = scheme

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    def wipe(self) -> None:
        """Delete etcd's data (stopped server only): a restart then comes back empty."""
        shutil.rmtree(self.workdir / "data", ignore_errors=True)

    def _argv(self) -> list[str]:
        client = self.url
        peer = f"http://127.0.0.1:{self.peer_port}"
        return [
            find_binary("etcd"),
            "--name", "tandem-test",
            "--data-dir", str(self.workdir / "data"),
            "--listen-client-urls", client,
            "--advertise-client-urls", client,
            "--listen-peer-urls", peer,
            "--initial-advertise-peer-urls", peer,
            "--initial-cluster", f"tandem-test={peer}",
            "--log-level", "warn",
            *self.extra,
        ]


class NatsServer(_Server):
    name = "nats"

    def __init__(self, *extra: str):
        super().__init__()
        self.extra = list(extra)  # e.g. ("--auth", TOKEN) or TLS flags

    @property
    def url(self) -> str:
        return f"nats://127.0.0.1:{self.port}"

    def _argv(self) -> list[str]:
        return [
            find_binary("nats-server"),
            "-a", "127.0.0.1",
            "-p", str(self.port),
            "-js",
            "-sd", str(self.workdir / "js"),
            *self.extra,
        ]


def start_servers() -> tuple[EtcdServer, NatsServer]:
    etcd, nats_ = EtcdServer(), NatsServer()
    etcd.start()
    nats_.start()
    return etcd, nats_


@contextlib.contextmanager
def running_servers() -> Iterator[tuple[EtcdServer, NatsServer]]:
    """:func:`start_servers`, both cleaned up when the block ends."""
    etcd, nats_ = start_servers()
    try:
        yield etcd, nats_
    finally:
        etcd.cleanup()
        nats_.cleanup()


def env_for(etcd: EtcdServer, nats_: NatsServer, namespace: str) -> dict[str, str]:
    """Environment for a child process that should join this etcd / NATS / namespace (and import this
    checkout, installed or not)."""
    return child_env(TANDEM_ETCD=etcd.url, TANDEM_NATS=nats_.url, TANDEM_NAMESPACE=namespace, PYTHONUNBUFFERED="1")
