"""A managed child process for e2e tests: start, wait until registered, signal, stop, logs."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from runtime.config import importable_env
from tests.support.wait import eventually_sync


class ManagedProcess:
    """``python -m module args...`` with its output captured to a log file."""

    def __init__(self, module: str, args: list[str], env: dict[str, str], name: str | None = None):
        self.module = module
        self.args = args
        self.env = env
        self.name = name or module
        fd, path = tempfile.mkstemp(prefix=f"tandem-{self.name.replace('/', '_')}-", suffix=".log")
        os.close(fd)
        self.log_path = Path(path)
        self.proc: subprocess.Popen | None = None

    def start(self) -> ManagedProcess:
        log = open(self.log_path, "ab")
        root = Path(__file__).resolve().parents[2]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", self.module, *self.args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=importable_env(self.env),  # the project need not be installed
            cwd=root,
            start_new_session=True,
        )
        return self

    @property
    def pid(self) -> int:
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def logs(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_log(self, text: str, timeout: float = 60.0) -> None:
        """Block until ``text`` is in the log; RuntimeError if the process exits first."""
        def logged() -> bool:
            if text in self.logs():
                return True
            if not self.alive():
                raise RuntimeError(f"{self.name} exited with {self.proc.returncode}; log:\n{self.logs()[-4000:]}")
            return False

        eventually_sync(logged, timeout=timeout, interval=0.1,
                        what=lambda: f"{self.name}: {text!r} logged; log:\n{self.logs()[-4000:]}")

    def signal(self, sig: int) -> None:
        if self.alive():
            os.kill(self.proc.pid, sig)

    def wait(self, timeout: float = 30.0) -> int:
        return self.proc.wait(timeout)

    def stop(self, timeout: float = 20.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout``; returns the exit code."""
        if self.proc is None:
            return None
        if self.alive():
            self.signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def kill(self) -> None:
        if self.alive():
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


def proc_table() -> dict[int, tuple[int, str]]:
    """pid -> (parent pid, start time) of every process /proc shows."""
    out = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rindex(")") + 2:].split()  # after "pid (comm) "
        out[int(entry)] = (int(fields[1]), fields[19])
    return out


def pid_alive(pid: int) -> bool:
    """``pid`` is a process that runs (a zombie, exited but not yet reaped, does not count)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def descendants(pid: int) -> dict[int, str]:
    """pid -> start time of every live process below ``pid`` (the start time recognises a process
    after it is re-parented, and tells it from a later one that reuses its pid)."""
    table = proc_table()
    children: dict[int, list[int]] = {}
    for p, (ppid, _) in table.items():
        children.setdefault(ppid, []).append(p)
    found, todo = {}, [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found[child] = table[child][1]
            todo.append(child)
    return found
