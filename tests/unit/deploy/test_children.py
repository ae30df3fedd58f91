"""Launcher children: prefixed output, and a stop that leaves nothing of the process group behind."""

from __future__ import annotations

import io
import os
import signal
import sys
import time

import pytest

from deploy.children import Child, stop_tiers
from tests.support.procs import pid_alive

pytestmark = pytest.mark.unit


def test_output_is_forwarded_with_a_prefix():
    out = io.StringIO()
    child = Child("target-0", [sys.executable, "-c", "print('hello'); import sys; print('oops', file=sys.stderr)"],
                  out=out).start()
    assert child.wait(20) == 0
    child.join_output()
    assert out.getvalue().splitlines() == ["[target-0] hello", "[target-0] oops"]
    assert child.recent_output() == "hello\noops"


def test_stop_kills_stragglers_and_their_whole_process_group(tmp_path):
    pidfile = tmp_path / "grandchild.pid"
    # The child ignores SIGTERM and leaves a grandchild that ignores it too.
    script = (
        "import os, signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "g = subprocess.Popen([sys.executable, '-c', 'import signal, time; "
        "signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({str(pidfile)!r}, 'w').write(str(g.pid))\n"
        "print('ready', flush=True)\n"
        "time.sleep(60)\n"
    )
    out = io.StringIO()
    child = Child("stubborn", [sys.executable, "-c", script], out=out).start()
    deadline = time.monotonic() + 20
    while "ready" not in out.getvalue():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    grandchild = int(pidfile.read_text())
    assert os.getpgid(grandchild) == child.pid  # its own group, led by the child
    started = time.monotonic()
    stop_tiers([[child]], timeout=0.5)
    assert time.monotonic() - started < 10
    assert child.returncode == -9
    deadline = time.monotonic() + 5
    while pid_alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(grandchild)


def test_tiers_stop_in_order(caplog):
    out = io.StringIO()
    a = Child("a", [sys.executable, "-c", "import time; time.sleep(60)"], out=out).start()
    b = Child("b", [sys.executable, "-c", "import time; time.sleep(60)"], out=out).start()
    with caplog.at_level("INFO", logger="deploy.children"):
        stop_tiers([[b], [a]], timeout=5)
    assert not a.alive() and not b.alive()
    events = [r.getMessage().split(" (")[0] for r in caplog.records]
    assert [e for e in events if e.startswith(("stopping", "a exited", "b exited"))] == \
        ["stopping b", "b exited with -15", "stopping a", "a exited with -15"]


SPARE_SCRIPT = """
import os, sys, time
if "--spare" in sys.argv and not sys.stdin.readline():
    sys.exit(0)
print("serving", os.getpid(), flush=True)
time.sleep(60)
"""


def test_a_restart_starts_the_waiting_spare_and_stop_discards_the_next_one():
    out = io.StringIO()
    child = Child("web", [sys.executable, "-c", SPARE_SCRIPT], out=out, spare_flag="--spare").start()
    try:
        child.prepare_spare()
        spare = child._spare.pid
        time.sleep(0.5)
        assert pid_alive(spare) and f"serving {spare}" not in out.getvalue()  # loaded, waiting for its word
        first = child.pid
        child.signal_group(signal.SIGKILL)
        child.wait(5)
        child.restart()
        assert child.pid == spare and child._spare is None  # the spare took over, under the same name
        deadline = time.monotonic() + 10
        while f"[web] serving {spare}" not in out.getvalue():
            assert time.monotonic() < deadline, out.getvalue()
            time.sleep(0.05)
        assert first != spare
        child.prepare_spare()
        waiting = child._spare.pid
    finally:
        stop_tiers([[child]], timeout=5)
    assert not pid_alive(spare) and not pid_alive(waiting)


def test_a_spare_that_dies_is_not_started_again_before_the_next_restart(caplog):
    script = "import sys, time\nif '--spare' in sys.argv: sys.exit(3)\ntime.sleep(60)"
    child = Child("web", [sys.executable, "-c", script], out=io.StringIO(), spare_flag="--spare").start()
    try:
        child.prepare_spare()  # a spare that exits 3 at once
        first = child._spare
        first.wait(20)
        child.prepare_spare()
        child.prepare_spare()
        assert child._spare is None and "exited with 3" in caplog.text  # no spawn loop
        child.signal_group(signal.SIGKILL)
        child.wait(5)
        child.restart()
        child.prepare_spare()
        assert child._spare is not None and child._spare is not first  # tried again after the restart
    finally:
        stop_tiers([[child]], timeout=5)


def test_the_ports_of_one_stack_are_distinct_and_free():
    # picked one by one, a released port could come back from the next bind: two components of one
    # `tandem up` were once given the same health port
    from deploy.binaries import free_ports, port_open

    ports = free_ports(64)
    assert len(set(ports)) == 64 and not any(port_open(p) for p in ports[:8])
