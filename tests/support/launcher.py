"""``tandem up`` from a test: the launcher on free ports with its output in a log file, a fixture
that cleans every one up (and the processes below it), and the small requests tests send it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import httpx
import pytest

from tests.support import procs
from tests.support.procs import pid_alive
from tests.support.servers import free_port
from tests.support.wait import NotReached, eventually_sync

ROOT = Path(__file__).resolve().parents[2]


def descendants(pid: int) -> set[int]:
    """Every live process below ``pid`` (read from /proc)."""
    return set(procs.descendants(pid))


def wait_gone(pids: set[int], timeout: float) -> set[int]:
    """Wait up to ``timeout`` seconds for ``pids`` to exit; returns those still alive."""
    try:
        eventually_sync(lambda: not any(pid_alive(p) for p in pids), timeout=timeout, interval=0.1,
                        what="processes gone")
    except NotReached:
        pass
    return {p for p in pids if pid_alive(p)}


class Launcher:
    """``tandem up --mock`` on free ports, output in a log file."""

    def __init__(self, *extra: str, python: str = sys.executable, cwd: Path = ROOT, env: dict | None = None):
        self.http_port, self.etcd_port, self.nats_port = free_port(), free_port(), free_port()
        fd, path = tempfile.mkstemp(prefix="tandem-up-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        argv = [python, "-m", "deploy.cli", "up", "--http-port", str(self.http_port), "--etcd-port", str(self.etcd_port),
                "--nats-port", str(self.nats_port), "--namespace", f"up{os.getpid()}", *extra]
        self.proc = subprocess.Popen(argv, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT, cwd=cwd,
                                     env={**(os.environ if env is None else env), "PYTHONUNBUFFERED": "1"})

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, timeout: float = 90.0) -> None:
        def ready() -> bool:
            assert self.proc.poll() is None, f"tandem up exited with {self.proc.returncode}:\n{self.logs()[-4000:]}"
            return "Tandem is ready" in self.logs()

        eventually_sync(ready, timeout=timeout, interval=0.2,
                        what=lambda: f"tandem up ready; its log ends:\n{self.logs()[-4000:]}")

    def cleanup(self) -> None:
        if self.proc.poll() is None:
            for pid in descendants(self.proc.pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def launcher():
    made: list[Launcher] = []

    def make(*extra: str, **where) -> Launcher:
        made.append(Launcher(*extra, **where))
        return made[-1]

    yield make
    for item in made:
        item.cleanup()


def ask(url: str, model: str = "mock", max_tokens: int = 12, **extra) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "Say something nice about tandem bicycles."}],
            "max_tokens": max_tokens, **extra}
    resp = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


MOCK = ("--mock", "--mock-token-latency-ms", "2")
