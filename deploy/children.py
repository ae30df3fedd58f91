"""Child processes of a launcher: own process group, prefixed log lines, orderly stop.

Every child runs in its own session (so a terminal's Ctrl-C reaches only the launcher, which then
stops the children in order) and gets ``PR_SET_PDEATHSIG`` = SIGTERM on Linux (so even a launcher
killed with SIGKILL leaves no orphans behind), set by :mod:`deploy.pdeathsig` before it execs the
child's command (no ``preexec_fn``: see there why the launcher must not fork). Its stdout and stderr are forwarded line by line as
``[name] line``; the last lines are kept for error messages.
"""

from __future__ import annotations

import collections
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import TextIO

from runtime.config import importable_env

log = logging.getLogger(__name__)

_write_lock = threading.Lock()


def die_with_parent(argv: Sequence[str]) -> list[str]:
    """``argv`` run through :mod:`deploy.pdeathsig`: SIGTERMed when this process dies (Linux)."""
    if sys.platform != "linux":
        return list(argv)
    return [sys.executable, "-m", "deploy.pdeathsig", str(os.getpid()), *argv]


class Child:
    """One child process (``argv``) named ``name``, e.g. ``target-0``."""

    def __init__(self, name: str, argv: Sequence[str], env: dict[str, str] | None = None,
                 cwd: str | None = None, out: TextIO | None = None, keep_lines: int = 200,
                 pass_fds: Sequence[int] = (), spare_flag: str | None = None):
        """``pass_fds``: descriptors of this process the child inherits under the same numbers (the
        frontend's listening socket). ``spare_flag``: the command takes this flag to load its code and
        then wait for a line on stdin before it starts; :meth:`prepare_spare` starts such a spare
        ahead of need, and :meth:`restart` starts the spare, which spares a replacement the seconds
        of imports that a new interpreter costs (gunicorn's preloaded workers, the same idea)."""
        self.name = name
        self.argv = list(argv)
        self.pass_fds = tuple(pass_fds)
        self.spare_flag = spare_flag
        self._spare: subprocess.Popen | None = None
        self._spare_reader: threading.Thread | None = None
        self._spare_failed = False  # the last spare exited on its own
        self.env = env
        self.cwd = cwd
        self._out = out
        self.tail: collections.deque[str] = collections.deque(maxlen=keep_lines)
        self.proc: subprocess.Popen | None = None
        self._reader: threading.Thread | None = None
        self.expected_exit = False  # set when the launcher itself stops it

    def _popen(self, argv: list[str], stdin: int) -> subprocess.Popen:
        # deploy.pdeathsig (and any python -m child) must import from wherever this process did
        env = importable_env(os.environ if self.env is None else self.env)
        return subprocess.Popen(die_with_parent(argv), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=stdin,
                                env=env, cwd=self.cwd, start_new_session=True, pass_fds=self.pass_fds)

    def start(self) -> Child:
        self.proc = self._popen(self.argv, subprocess.DEVNULL)
        self._reader = self._follow(self.proc)
        log.info("started %s (pid %d): %s", self.name, self.proc.pid, " ".join(self.argv))
        return self

    def _follow(self, proc: subprocess.Popen) -> threading.Thread:
        reader = threading.Thread(target=self._forward, args=(proc,), name=f"log-{self.name}", daemon=True)
        reader.start()
        return reader

    def restart(self) -> Child:
        """Start the same command again (same ports, same name) after the process exited, from its
        spare when one is waiting; what its process group left behind (a TP worker's other ranks) is
        killed first."""
        self.signal_group(signal.SIGKILL)
        if self._reader is not None:
            self._reader.join(1.0)
        spare, self._spare, self._spare_failed = self._spare, None, False
        if spare is not None and spare.poll() is None:
            try:
                assert spare.stdin is not None
                spare.stdin.write(b"start\n")
                spare.stdin.close()
            except OSError:  # it died just now: start afresh
                _kill_group(spare)
            else:
                self.proc, self._reader = spare, self._spare_reader
                log.info("started %s (pid %d) from its spare: %s", self.name, spare.pid, " ".join(self.argv))
                return self
        return self.start()

    def prepare_spare(self) -> None:
        """Start the spare (:attr:`spare_flag`) unless one is waiting or the child has none. A spare
        that exited on its own is not replaced before the child's next restart (no spawn loop)."""
        if self.spare_flag is None or self._spare_failed:
            return
        if self._spare is not None:
            code = self._spare.poll()
            if code is None:
                return
            log.warning("the spare %s (pid %d) exited with %s; none until %s restarts:\n%s", self.name,
                        self._spare.pid, code, self.name, self.recent_output(5))
            self._spare, self._spare_failed = None, True
            return
        self._spare = self._popen([*self.argv, self.spare_flag], subprocess.PIPE)
        self._spare_reader = self._follow(self._spare)
        log.info("prepared a spare %s (pid %d)", self.name, self._spare.pid)

    def discard_spare(self) -> None:
        spare, self._spare = self._spare, None
        if spare is not None:
            _kill_group(spare)

    def _forward(self, proc: subprocess.Popen) -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:  # this process's pipe, even once a restart replaced self.proc
            line = raw.decode("utf-8", errors="replace").rstrip("\n")
            self.tail.append(line)
            out = self._out or sys.stdout
            with _write_lock:
                try:
                    out.write(f"[{self.name}] {line}\n")
                    out.flush()
                except (ValueError, OSError):
                    pass  # our stdout closed; keep draining the pipe so the child never blocks

    @property
    def pid(self) -> int:
        return self.proc.pid if self.proc else -1

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def recent_output(self, lines: int = 30) -> str:
        return "\n".join(list(self.tail)[-lines:])

    def signal_group(self, sig: int) -> None:
        """Send ``sig`` to the child's whole process group (no error if it is gone)."""
        if self.proc is None:
            return
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def wait(self, timeout: float | None = None) -> int | None:
        if self.proc is None:
            return None
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return None

    def join_output(self, timeout: float = 2.0) -> None:
        if self._reader is not None:
            self._reader.join(timeout)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(5)
    except subprocess.TimeoutExpired:
        pass
    if proc.stdin is not None:
        proc.stdin.close()


def stop_tiers(tiers: Sequence[Sequence[Child]], timeout: float) -> None:
    """Stop tiers of children in the given order: SIGTERM a whole tier at once, wait up to
    ``timeout`` for it, SIGKILL what is left (the whole process group, so nothing is orphaned)."""
    for tier in tiers:
        for child in tier:
            child.discard_spare()
        running = [c for c in tier if c.proc is not None]
        for child in running:
            child.expected_exit = True
            if child.alive():
                log.info("stopping %s (pid %d)", child.name, child.pid)
                child.signal_group(signal.SIGTERM)
        deadline = time.monotonic() + timeout
        for child in running:
            if child.wait(max(0.0, deadline - time.monotonic())) is None:
                log.warning("%s did not exit within %.0fs of SIGTERM: SIGKILL", child.name, timeout)
                child.signal_group(signal.SIGKILL)
                child.wait(5)
            # A leader that exited may leave members of its group behind: clear them too.
            child.signal_group(signal.SIGKILL)
            child.join_output()
            log.info("%s exited with %s", child.name, child.returncode)
