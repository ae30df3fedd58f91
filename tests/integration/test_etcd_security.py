"""etcd over TLS, with mutual TLS, and with auth enabled: the runtime registers and watches with the right
settings, fails in one line without them (never showing the password), and re-authenticates after an
etcd restart forgets its token (real etcd; certificates made here by openssl; auth set up by etcdctl)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import shutil
import subprocess

import pytest

from runtime import Runtime, RuntimeConfig
from runtime.errors import StartupError
from tests.support.servers import EtcdServer, find_binary
from tests.support.pki import make_pki

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI missing")]


def config_for(server: EtcdServer, nats_server, **kw) -> RuntimeConfig:
    kw.setdefault("connect_timeout", 2)
    return RuntimeConfig(etcd_url=server.url, nats_url=nats_server.url, namespace="etcdsec",
                         handle_signals=False, lease_ttl=3, **kw)


async def registers_and_watches(config: RuntimeConfig) -> None:
    """One runtime registers an instance; its own prefix watch sees it (a put, a read and a watch)."""
    async with Runtime.connect(config) as rt:
        client = await rt.client("probe", "generate")
        record = await rt.register("probe", "generate", subject="x")
        found = await client.wait_for_instances(1, timeout=5)
        assert [r.instance_id for r in found] == [record.instance_id]


def start(server: EtcdServer) -> EtcdServer:
    server.start()
    return server


async def test_etcd_tls_and_mutual_tls(nats_server, tmp_path):
    pki = make_pki(tmp_path)
    tls = start(EtcdServer("--cert-file", pki["server_cert"], "--key-file", pki["server_key"], scheme="https"))
    try:
        await registers_and_watches(config_for(tls, nats_server, etcd_tls_ca=pki["ca"]))
        with pytest.raises(StartupError, match="cannot reach etcd"):  # the system's CAs do not trust ours
            await registers_and_watches(config_for(tls, nats_server, connect_timeout=1))
    finally:
        tls.cleanup()
    mtls = start(EtcdServer("--cert-file", pki["server_cert"], "--key-file", pki["server_key"],
                            "--trusted-ca-file", pki["ca"], "--client-cert-auth", scheme="https"))
    try:
        good = config_for(mtls, nats_server, etcd_tls_ca=pki["ca"], etcd_tls_cert=pki["client_cert"],
                          etcd_tls_key=pki["client_key"])
        await registers_and_watches(good)
        with pytest.raises(StartupError, match="cannot reach etcd"):  # no client certificate
            await registers_and_watches(dataclasses.replace(good, etcd_tls_cert=None, etcd_tls_key=None,
                                                            connect_timeout=1))
    finally:
        mtls.cleanup()


def enable_auth(server: EtcdServer, password: str) -> None:
    def etcdctl(*args: str) -> None:
        subprocess.run([find_binary("etcdctl"), "--endpoints", server.url, *args], check=True, capture_output=True)

    etcdctl("user", "add", f"root:{password}")
    etcdctl("auth", "enable")


async def test_etcd_auth_and_a_restart_that_forgets_the_token(nats_server, caplog):
    password = "pw-" + secrets.token_hex(8)
    server = start(EtcdServer())
    try:
        enable_auth(server, password)
        good = config_for(server, nats_server, etcd_user="root", etcd_password=password)
        await registers_and_watches(good)
        # the same credentials in the URL
        await registers_and_watches(dataclasses.replace(good, etcd_user=None, etcd_password=None,
                                                        etcd_url=f"http://root:{password}@127.0.0.1:{server.port}"))
        caplog.set_level(logging.DEBUG)
        for bad in (dataclasses.replace(good, etcd_user=None, etcd_password=None),  # auth on, no credentials
                    dataclasses.replace(good, etcd_password=password + "x"),
                    dataclasses.replace(good, etcd_user=None, etcd_password=None,
                                        etcd_url=f"http://root:{password}x@127.0.0.1:{server.port}")):
            loop = asyncio.get_running_loop()
            began = loop.time()
            with pytest.raises(StartupError, match="refused us") as err:
                await registers_and_watches(bad)
            assert loop.time() - began < 1.5  # not retried until the connect timeout: it will not get better
            assert password not in str(err.value)
        assert password not in caplog.text and password not in repr(good)

        # etcd's simple tokens live in memory: after a restart every call with the old token fails
        async with Runtime.connect(good) as rt:
            client = await rt.client("probe", "generate")
            await rt.register("probe", "generate", subject="a")
            await client.wait_for_instances(1, timeout=5)
            server.restart()
            await rt.register("probe2", "generate", subject="b")  # a put with the old token: authenticates again
            async with Runtime.connect(good) as second:
                await second.register("probe", "generate", subject="c")
                await client.wait_for_instances(2, timeout=10)  # the first one's watch, opened again
            await asyncio.sleep(1.5)  # lease refreshes (every ttl/3 = 1 s) go on with the new token
            assert rt.lease_changes == 0  # the lease outlived the restart (etcd kept its data)
        assert "authenticated again" in caplog.text
    finally:
        server.cleanup()
