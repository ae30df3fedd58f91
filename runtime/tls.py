"""TLS for the target ↔ draft gRPC stream: server TLS, and mutual TLS when the draft asks for
client certificates. Files are PEM; paths come from the workers' flags."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import grpc


def _read(path: str | None, what: str) -> bytes | None:
    if not path:
        return None
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} {path} does not exist")
    return p.read_bytes()


@dataclass(frozen=True)
class ServerTls:
    """The draft worker's side: its certificate and key; ``client_ca`` set = clients must present a
    certificate signed by it (mutual TLS)."""

    cert: str
    key: str
    client_ca: str | None = None

    def credentials(self) -> grpc.ServerCredentials:
        pair = (_read(self.key, "TLS key"), _read(self.cert, "TLS certificate"))
        ca = _read(self.client_ca, "client CA")
        return grpc.ssl_server_credentials([pair], root_certificates=ca, require_client_auth=ca is not None)


@dataclass(frozen=True)
class ClientTls:
    """The target's side: the CA that signed draft workers' certificates (None: the system roots),
    and its own certificate and key for mutual TLS."""

    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def __post_init__(self):
        if bool(self.cert) != bool(self.key):
            raise ValueError("a client TLS certificate needs its key and the other way round")

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=_read(self.ca, "TLS CA"),
                                            private_key=_read(self.key, "TLS key"),
                                            certificate_chain=_read(self.cert, "TLS certificate"))
