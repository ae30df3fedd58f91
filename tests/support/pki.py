"""A throwaway certificate authority for TLS tests, made by the openssl CLI (tests that use it skip
without one)."""

from __future__ import annotations

import subprocess
from pathlib import Path


def make_pki(d: Path) -> dict[str, str]:
    """A CA, a server certificate for 127.0.0.1 and a client certificate, signed by the CA."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=tandem-test-ca")
    (d / "san.ext").write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for name, cn in (("server", "127.0.0.1"), ("client", "tandem-target")):
        run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
            "-out", f"{name}.pem", "-days", "1", "-extfile", "san.ext")
    return {k: str(d / v) for k, v in {"ca": "ca.pem", "server_cert": "server.pem", "server_key": "server.key",
                                       "client_cert": "client.pem", "client_key": "client.key"}.items()}
