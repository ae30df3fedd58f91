"""``tandem ray up --mock`` on a local Ray cluster, inside a network namespace (Ray will not run on
loopback only otherwise): the components come up as Ray actors and serve one OpenAI request."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest

from deploy.infra import etcd_argv, nats_argv

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
RAY_PORT, ETCD_PORT, NATS_PORT, HTTP_PORT = 6379, 2379, 4222, 8000  # a fresh namespace has them all free


def _netns_unavailable() -> str | None:
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    if os.geteuid() != 0:
        return "creating a network namespace needs root"
    probe = f"tdprobe{uuid.uuid4().hex[:6]}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"network namespaces are unavailable here: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


class NetNs:
    """A network namespace with loopback up; processes started in it are killed at cleanup."""

    def __init__(self):
        self.name = f"td{uuid.uuid4().hex[:8]}"
        subprocess.run(["ip", "netns", "add", self.name], check=True)
        self.run("ip", "link", "set", "lo", "up", check=True)
        self.procs: list[subprocess.Popen] = []
        self.workdir = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))  # short: Ray's socket paths

    def argv(self, *cmd: str) -> list[str]:
        return ["ip", "netns", "exec", self.name, *cmd]

    def run(self, *cmd: str, **kw) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv(*cmd), capture_output=True, text=True, timeout=kw.pop("timeout", 60), **kw)

    def start(self, name: str, *cmd: str) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")
        proc = subprocess.Popen(self.argv(*cmd), stdout=log, stderr=subprocess.STDOUT, cwd=ROOT,
                                start_new_session=True, env=dict(os.environ, PYTHONUNBUFFERED="1"))
        self.procs.append(proc)
        return proc

    def log(self, name: str) -> str:
        path = self.workdir / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_port(self, port: int, timeout: float = 60) -> None:
        code = f"import socket; socket.create_connection(('127.0.0.1', {port}), 1)"
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.run(sys.executable, "-c", code).returncode == 0:
                return
            time.sleep(0.5)
        raise TimeoutError(f"nothing listens on {port} in {self.name}")

    def start_cluster(self) -> None:
        """etcd, NATS and a Ray head on their usual ports, listening before this returns."""
        self.start("etcd", *etcd_argv(ETCD_PORT, ETCD_PORT + 1, self.workdir))
        self.start("nats", *nats_argv(NATS_PORT))
        self.start("ray", str(BIN / "ray"), "start", "--head", "--block", f"--port={RAY_PORT}", "--num-cpus=8",
                   "--num-gpus=0", f"--temp-dir={self.workdir / 'ray'}", "--disable-usage-stats",
                   "--include-dashboard=false")
        for port in (ETCD_PORT, NATS_PORT, RAY_PORT):
            self.wait_port(port)

    def pids(self) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def cleanup(self) -> None:
        for proc in reversed(self.procs):
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 5
        for proc in reversed(self.procs):
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        # Whatever Ray daemonized inside the namespace (and only there).
        for _ in range(3):
            for pid in self.pids():
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.5)
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)
        shutil.rmtree(self.workdir, ignore_errors=True)


@pytest.fixture
def netns():
    reason = _netns_unavailable()
    if reason:
        pytest.skip(f"Ray needs a network namespace for a loopback-only cluster, and {reason}")
    ns = NetNs()
    yield ns
    ns.cleanup()


def cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            pass
    return out


def test_tandem_ray_up_mock_serves_a_request(netns):
    netns.start_cluster()

    up = netns.start("tandem", sys.executable, "-m", "deploy.cli", "ray", "up", "--mock",
                     f"--address=127.0.0.1:{RAY_PORT}", f"--etcd=http://127.0.0.1:{ETCD_PORT}",
                     f"--nats=nats://127.0.0.1:{NATS_PORT}", f"--http-port={HTTP_PORT}", "--targets=2",
                     "--mock-token-latency-ms=1")
    deadline = time.monotonic() + 180
    while "Tandem is ready on Ray" not in netns.log("tandem"):
        assert up.poll() is None, f"tandem ray up exited with {up.returncode}:\n{netns.log('tandem')[-4000:]}"
        assert time.monotonic() < deadline, f"not ready:\n{netns.log('tandem')[-4000:]}"
        time.sleep(0.5)

    # The workers and the frontend are children of Ray worker processes, not of the launcher.
    running = cmdlines(netns.pids())
    assert sum("-m workers.mock" in c for c in running) == 2
    assert sum("-m frontend" in c for c in running) == 1

    request = (
        "import json, urllib.request\n"
        "body = json.dumps({'model': 'mock', 'max_tokens': 9, 'messages': [{'role': 'user', 'content': 'hi Ray'}]})\n"
        f"req = urllib.request.Request('http://127.0.0.1:{HTTP_PORT}/v1/chat/completions', body.encode(),\n"
        "                             {'Content-Type': 'application/json'})\n"
        "print(urllib.request.urlopen(req, timeout=30).read().decode())\n"
    )
    import json

    out = netns.run(sys.executable, "-c", request)
    assert out.returncode == 0, out.stderr
    answer = json.loads(out.stdout)
    assert answer["choices"][0]["finish_reason"] == "length" and answer["usage"]["completion_tokens"] == 9

    os.killpg(up.pid, signal.SIGINT)
    assert up.wait(60) == 0, netns.log("tandem")[-4000:]
    assert "all stopped" in netns.log("tandem")
    left = [c for c in cmdlines(netns.pids()) if "-m workers.mock" in c or "-m frontend" in c]
    assert not left, left

    # Real workers want a GPU each; this cluster has none: a clear error, not a hang.
    gpu = netns.start("tandem-gpu", sys.executable, "-m", "deploy.cli", "ray", "up",
                      f"--address=127.0.0.1:{RAY_PORT}", f"--etcd=http://127.0.0.1:{ETCD_PORT}",
                      f"--nats=nats://127.0.0.1:{NATS_PORT}", "--startup-timeout=5")
    assert gpu.wait(90) == 1, netns.log("tandem-gpu")[-4000:]
    assert "not enough free CPUs/GPUs" in netns.log("tandem-gpu")
