"""etcd and nats-server (with JetStream) as launcher children on 127.0.0.1, data in a temp dir."""

from __future__ import annotations

from pathlib import Path

from deploy.binaries import find_binary
from deploy.children import Child


def etcd_argv(client_port: int, peer_port: int, data_dir: Path, host: str = "127.0.0.1") -> list[str]:
    client = f"http://{host}:{client_port}"
    peer = f"http://{host}:{peer_port}"
    return [
        find_binary("etcd"),
        "--name", "tandem",
        "--data-dir", str(data_dir / "etcd"),
        "--listen-client-urls", client,
        "--advertise-client-urls", client,
        "--listen-peer-urls", peer,
        "--initial-advertise-peer-urls", peer,
        "--initial-cluster", f"tandem={peer}",
        "--log-level", "warn",
    ]


def nats_argv(port: int, host: str = "127.0.0.1") -> list[str]:
    """Core NATS, no JetStream: no Tandem code uses it (subjects and inboxes only)."""
    return [find_binary("nats-server"), "-a", host, "-p", str(port)]


def etcd_child(client_port: int, peer_port: int, data_dir: Path, env: dict[str, str] | None = None) -> Child:
    return Child("etcd", etcd_argv(client_port, peer_port, data_dir), env=env, cwd=str(data_dir))


def nats_child(port: int, data_dir: Path, env: dict[str, str] | None = None) -> Child:
    return Child("nats", nats_argv(port), env=env, cwd=str(data_dir))
