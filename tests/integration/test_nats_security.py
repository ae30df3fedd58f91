"""NATS with a token, over TLS and with mutual TLS: the runtime connects with the right settings and
fails fast, in one line, without them (real nats-server, certificates made here by openssl)."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
import shutil

import pytest

from runtime import Runtime, RuntimeConfig
from runtime.errors import StartupError
from tests.support.servers import NatsServer
from tests.support.pki import make_pki

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI missing")]


async def roundtrip(config: RuntimeConfig) -> bytes:
    async with Runtime.connect(config) as rt:
        got = asyncio.get_running_loop().create_future()

        async def on_msg(msg) -> None:
            got.set_result(msg.data)

        sub = await rt.nc.subscribe("tandem.test.security", cb=on_msg)
        await rt.nc.publish("tandem.test.security", b"ok")
        try:
            return await asyncio.wait_for(got, 5)
        finally:
            await sub.unsubscribe()


def config_for(etcd_server, url: str, **kw) -> RuntimeConfig:
    return RuntimeConfig(etcd_url=etcd_server.url, nats_url=url, namespace="sec", handle_signals=False,
                         connect_timeout=3, **kw)


async def test_nats_token(etcd_server):
    token = secrets.token_hex(8)
    server = NatsServer("--auth", token)
    server.start()
    try:
        assert await roundtrip(config_for(etcd_server, f"nats://{token}@127.0.0.1:{server.port}")) == b"ok"
        with pytest.raises(StartupError, match="cannot reach NATS") as err:
            await roundtrip(config_for(etcd_server, f"nats://wrong@127.0.0.1:{server.port}"))
        assert "wrong" not in str(err.value)  # the token is not logged
    finally:
        server.cleanup()


async def test_nats_tls_and_mutual_tls(etcd_server, tmp_path):
    pki = make_pki(tmp_path)
    tls = NatsServer("--tls", "--tlscert", pki["server_cert"], "--tlskey", pki["server_key"])
    tls.start()
    try:
        url = f"nats://127.0.0.1:{tls.port}"
        assert await roundtrip(config_for(etcd_server, url, nats_tls_ca=pki["ca"])) == b"ok"
        with pytest.raises(StartupError):
            await roundtrip(config_for(etcd_server, url))  # plaintext against a TLS server
    finally:
        tls.cleanup()
    mtls = NatsServer("--tlsverify", "--tlscert", pki["server_cert"], "--tlskey", pki["server_key"],
                      "--tlscacert", pki["ca"])
    mtls.start()
    try:
        url = f"nats://127.0.0.1:{mtls.port}"
        good = config_for(etcd_server, url, nats_tls_ca=pki["ca"], nats_tls_cert=pki["client_cert"],
                          nats_tls_key=pki["client_key"])
        assert await roundtrip(good) == b"ok"
        with pytest.raises(StartupError):
            await roundtrip(dataclasses.replace(good, nats_tls_cert=None, nats_tls_key=None))  # no client certificate
    finally:
        mtls.cleanup()


def test_half_given_nats_tls_settings_are_errors(tmp_path):
    with pytest.raises(ValueError, match="go together"):
        RuntimeConfig(nats_tls_cert="c.pem")
    with pytest.raises(ValueError, match="does not exist"):
        RuntimeConfig(nats_tls_ca=str(tmp_path / "missing.pem"))
