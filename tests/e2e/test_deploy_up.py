"""``tandem up --mock``: the whole stack from one command, one OpenAI request, and no process left
behind after Ctrl-C (SIGINT) — or even after the launcher itself is killed with SIGKILL."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from runtime.request_plane import BLIP_GRACE_S
from tests.support.launcher import MOCK, ROOT, ask, descendants, launcher, wait_gone  # noqa: F401  (launcher: a fixture)

pytestmark = pytest.mark.e2e


def metric_names(url: str) -> set[str]:
    text = httpx.get(url, timeout=5).text
    return {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}


def test_tandem_up_mock_serves_and_ctrl_c_leaves_no_process(launcher):
    up = launcher(*MOCK, "--targets", "2", "--standalone-router")
    up.wait_ready()
    assert httpx.get(f"{up.url}/health", timeout=5).status_code == 200
    answer = ask(up.url)
    assert answer["choices"][0]["finish_reason"] == "length"
    assert answer["usage"]["completion_tokens"] == 12 and answer["choices"][0]["message"]["content"]
    models = httpx.get(f"{up.url}/v1/models", timeout=5).json()
    assert [m["id"] for m in models["data"]] == ["mock"]

    # Every metric the Grafana dashboard plots, and every frontend metric the k8s HPAs scale on, is
    # served by the frontend or the router (the targets' and drafts' HPA metrics come from those
    # workers: tests/unit/deploy/test_k8s.py ties each to the component that exports it).
    [router_port] = re.findall(r"router +pid \d+ +health http://127.0.0.1:(\d+)/health", up.logs())
    wanted = set(re.findall(r"tandem_[a-z_]+", (ROOT / "deploy/grafana/dashboards/tandem.json").read_text()))
    hpa_metrics = set(re.findall(r"name: (tandem_frontend_[a-z_]+)",
                                 (ROOT / "k8s/components/autoscaling/hpa.yaml").read_text()))
    assert hpa_metrics
    wanted |= hpa_metrics
    deadline = time.monotonic() + 10
    while True:  # the router's spec-decode counters appear once a worker's stats event arrives
        served = metric_names(f"{up.url}/metrics") | metric_names(f"http://127.0.0.1:{router_port}/metrics")
        if wanted <= served or time.monotonic() > deadline:
            break
        time.sleep(0.3)
    assert wanted - served == set()

    # The frontend routes through the standalone router: every request is one of its decisions.
    def decisions() -> float:
        text = httpx.get(f"http://127.0.0.1:{router_port}/metrics", timeout=5).text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("tandem_router_decisions_total"))

    before = decisions()
    for _ in range(10):
        ask(up.url, max_tokens=2)
    assert decisions() - before == 10

    logs = up.logs()
    for prefix in ("[etcd] ", "[nats] ", "[router] ", "[target-0] ", "[target-1] ", "[frontend] "):
        assert prefix in logs, prefix
    assert f"curl {up.url}/v1/chat/completions" in logs
    children = descendants(up.proc.pid)
    assert len(children) >= 6  # etcd, nats, router, two targets, frontend

    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(60) == 0, up.logs()[-4000:]
    assert wait_gone(children, 5) == set()
    for port in (up.http_port, up.etcd_port, up.nats_port):
        with pytest.raises(httpx.TransportError):
            httpx.get(f"http://127.0.0.1:{port}/", timeout=1)
    logs = up.logs()
    # Reverse start order: the frontend stops before the workers, the workers before NATS and etcd.
    order = [logs.index(f"stopping {name} ") for name in ("frontend", "target-0", "router", "nats", "etcd")]
    assert order == sorted(order)
    assert "all stopped" in logs


def test_children_die_with_a_killed_launcher(launcher):
    up = launcher(*MOCK)
    up.wait_ready()
    children = descendants(up.proc.pid)
    assert len(children) >= 4
    up.proc.kill()
    up.proc.wait()
    # PR_SET_PDEATHSIG sends each child SIGTERM when the launcher dies: nothing is orphaned.
    assert wait_gone(children, 40) == set()


def serving_again_after(url: str, timeout: float, refused: list[str] | None = None) -> float:
    """Seconds until a chat completion succeeds again (short requests, back to back); connections
    refused on the way are added to ``refused``."""
    started = time.monotonic()
    last = ""
    while time.monotonic() - started < timeout:
        try:
            resp = httpx.post(f"{url}/v1/chat/completions", timeout=max(0.2, timeout - (time.monotonic() - started)),
                              json={"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4})
            if resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4:
                return time.monotonic() - started
            last = f"{resp.status_code} {resp.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
            if refused is not None and isinstance(exc, httpx.ConnectError):
                refused.append(last)
        time.sleep(0.02)
    raise AssertionError(f"not serving {timeout}s after the kill; last answer: {last}")


def test_children_that_die_are_restarted_on_their_ports_and_serving_resumes_within_3s(launcher):
    up = launcher(*MOCK)
    up.wait_ready()
    ask(up.url)
    # Each is serving again within 3 s (the children reconnect every 0.25 s; the frontend is replaced by
    # the spare the launcher started once the stack served, which has loaded its code: waited for here,
    # so that its imports do not share the two cores with the restarts). The launcher holds the
    # frontend's listening socket: a client that connects while the frontend restarts waits for the
    # new one, no connection is refused.
    deadline = time.monotonic() + 60
    while not re.search(r"\[frontend\] spare frontend \(pid \d+\) loaded", up.logs()):
        assert time.monotonic() < deadline, up.logs()[-3000:]
        time.sleep(0.1)
    for name in ("etcd", "nats", "target-0", "frontend"):
        pid = int(re.findall(rf"started {name} \(pid (\d+)\)", up.logs())[-1])
        os.kill(pid, signal.SIGKILL)
        refused: list[str] = []
        try:
            took = serving_again_after(up.url, 3.0, refused)
        except AssertionError as exc:
            raise AssertionError(f"after killing {name}: {exc}\n{up.logs()[-5000:]}") from None
        print(f"{name}: serving again {took:.2f}s after SIGKILL")
        assert refused == [], refused
        # the stack may serve on before the launcher has even reaped the child (etcd: from the snapshot)
        deadline = time.monotonic() + 10
        while len(re.findall(rf"started {name} \(pid \d+\)", up.logs())) < 2:
            assert time.monotonic() < deadline, f"{name} was not restarted:\n{up.logs()[-3000:]}"
            time.sleep(0.05)
        assert re.search(rf"{name} exited with -9; restarting it in 0.0s \(restart 1\); the rest of the stack "
                         "keeps serving", up.logs())
        assert len(re.findall(rf"started {name} \(pid \d+\)", up.logs())) == 2
        assert up.proc.poll() is None
        if name == "nats":  # each kill on its own: for BLIP_GRACE_S after NATS is back, "no responders"
            time.sleep(BLIP_GRACE_S)  # from a dead target means "not resubscribed yet" (by design)
    assert re.search(r"started frontend \(pid \d+\) from its spare", up.logs())
    # NATS came back on its port: the launcher's own command line names it, and the children found it there.
    assert len(set(re.findall(r"started nats \(pid \d+\): (.*)", up.logs()))) == 1

    # A worker stopped by someone else than the launcher (exit code 0) is restarted too.
    pid = int(re.findall(r"started target-0 \(pid (\d+)\)", up.logs())[-1])
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 30
    while len(re.findall(r"started target-0 \(pid \d+\)", up.logs())) < 3:
        assert time.monotonic() < deadline, up.logs()[-3000:]
        time.sleep(0.1)
    assert "target-0 exited with 0; restarting it" in up.logs()
    serving_again_after(up.url, 10.0)

    # Only the launcher's own stop ends the stack, and it leaves nothing behind.
    children = descendants(up.proc.pid)
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(60) == 0
    assert wait_gone(children, 5) == set()
    assert "restarting" not in up.logs().split("stopping frontend")[-1]


def test_tandem_up_serves_the_bundled_demo_model_with_its_eagle3_draft(launcher):
    # What `make run` runs: the real target worker on SmolLM2-135M and one draft worker speculating
    # with the bundled EAGLE-3 head; the response's usage shows the speculation.
    up = launcher()
    up.wait_ready(timeout=240)
    deadline = time.monotonic() + 90  # the target serves at once; its draft stream opens in the background
    while True:
        answer = ask(up.url, model="SmolLM2-135M-Instruct", max_tokens=24, temperature=0, ignore_eos=True)
        assert answer["usage"]["completion_tokens"] == 24 and answer["choices"][0]["finish_reason"] == "length"
        if "spec_decode" in answer["usage"] or time.monotonic() > deadline:
            break
        time.sleep(1)
    spec = answer["usage"]["spec_decode"]
    assert spec["num_drafts"] > 0 and spec["draft_tokens"] > 0 and spec["accepted_tokens"] > 0, spec
    logs = up.logs()
    assert "[target-0] " in logs and "[draft-0] " in logs and "method eagle3" in logs
    children = descendants(up.proc.pid)
    stopping = time.monotonic()
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(60) == 0, up.logs()[-4000:]
    # Targets stop before the drafts they stream to, so nobody waits out a drain timeout.
    assert time.monotonic() - stopping < 15, up.logs()[-4000:]
    logs = up.logs()
    assert logs.index("stopping target-0 ") < logs.index("stopping draft-0 ")
    assert wait_gone(children, 5) == set()


def test_a_busy_http_port_is_reported_before_anything_starts():
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        out = subprocess.run([sys.executable, "-m", "deploy.cli", "up", "--mock", "--http-port", str(port)],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 1 and f"port {port} is already in use" in out.stderr
    assert "started etcd" not in out.stderr


def test_bad_flags_are_rejected_before_anything_starts():
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "up", "--mock", "--drafts", "2"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode != 0 and "no draft workers" in out.stderr
    out = subprocess.run([sys.executable, "-m", "deploy.cli", "up", "--draft-method", "eagle"],
                         capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode != 0 and "--draft-model" in out.stderr
    for flags, message in ((["--model", "/nonexistent"], "--model /nonexistent does not exist"),
                           (["--draft-method", "eagle3", "--draft-model", "/nonexistent"],
                            "--draft-model /nonexistent does not exist")):
        out = subprocess.run([sys.executable, "-m", "deploy.cli", "up", "--http-port", "0", *flags],
                             capture_output=True, text=True, cwd=ROOT, timeout=60)
        assert out.returncode != 0 and message in out.stderr
        assert "Traceback" not in out.stderr and "started etcd" not in out.stderr


def python_without_the_project(venv: Path) -> str:
    """A Python that has this one's dependencies but not the project: a venv whose one ``.pth`` names
    their site-packages folders (the ``.pth`` files inside those, such as an editable install's
    import hook, run only from a site folder, so the project is importable only from a checkout)."""
    import site

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    [own_site] = (venv / "lib").glob("python*/site-packages")
    (own_site / "dependencies.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    return str(venv / "bin" / "python")


def test_tandem_up_serves_from_a_plain_checkout(launcher, tmp_path):
    """The repository copied elsewhere, not installed, no PYTHONPATH: ``python -m deploy.cli up`` run
    from its root starts every child (through ``python -m deploy.pdeathsig``, whatever the child's
    working directory) and serves."""
    checkout = tmp_path / "checkout"
    for package in ("deploy", "frontend", "planner", "proto", "router", "runtime", "workers"):
        shutil.copytree(ROOT / package, checkout / package, ignore=shutil.ignore_patterns("__pycache__"))
    python = python_without_the_project(tmp_path / "venv")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"  # etcd, nats-server
    outside = subprocess.run([python, "-c", "import deploy"], cwd=tmp_path, env=env, capture_output=True, timeout=60)
    if outside.returncode == 0:
        pytest.skip("the project is installed into site-packages here: a plain checkout cannot be tried")
    up = launcher(*MOCK, python=python, cwd=checkout, env=env)
    up.wait_ready()
    assert ask(up.url)["choices"][0]["message"]["content"]
