"""k8s/components/infra-tls on real servers: etcd and nats-server started with the TLS flags the
rendered manifests give them, and a Tandem runtime configured from the environment a rendered
Tandem pod gets (the Secret's files as openssl made them here, the Service names as loopback ports),
registers, watches and connects; without its client certificate NATS and etcd refuse it."""

from __future__ import annotations

import dataclasses
import importlib
import os
import shutil
from pathlib import Path

import pytest

from runtime import Runtime
from runtime.config import config_from_args
from runtime.errors import StartupError
from tests.integration.test_etcd_security import registers_and_watches
from tests.support.servers import EtcdServer, NatsServer
from tests.support.kustomize import MODULES, build_with, by_kind
from tests.support.pki import make_pki

pytestmark = [pytest.mark.integration,
              pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl CLI missing")]


def _with_files(args: list[str], secret: dict[str, str], flags: tuple[str, ...]) -> list[str]:
    """The rendered ``--flag=/mounted/path`` arguments among ``flags``, pointing at the Secret's files."""
    out = []
    for arg in args:
        name, _, value = arg.partition("=")
        if name in flags:
            out.append(f"{name}={secret[Path(value).name]}" if value else name)
    return out


async def test_rendered_tls_settings_connect_to_real_etcd_and_nats(tmp_path, monkeypatch):
    objs = build_with("overlays/cpu-demo", ["infra-tls"], tmp_path)
    pki = make_pki(tmp_path)
    secret = {"ca.crt": pki["ca"], "tls.crt": pki["server_cert"], "tls.key": pki["server_key"]}

    [etcd_c] = by_kind(objs, "StatefulSet")["tandem-etcd"]["spec"]["template"]["spec"]["containers"]
    etcd = EtcdServer(*_with_files(etcd_c["command"], secret, ("--cert-file", "--key-file", "--trusted-ca-file",
                                                                "--client-cert-auth")), scheme="https")
    [nats_c] = by_kind(objs, "Deployment")["tandem-nats"]["spec"]["template"]["spec"]["containers"]
    nats_ = NatsServer(*_with_files(nats_c["args"], secret, ("--tls", "--tlscert", "--tlskey", "--tlscacert",
                                                              "--tlsverify")))
    etcd.start()
    nats_.start()
    try:
        [router] = by_kind(objs, "Deployment")["tandem-router"]["spec"]["template"]["spec"]["containers"]
        env = dict(by_kind(objs, "ConfigMap")["tandem-config"]["data"])
        for var in [v for v in os.environ if v.startswith("TANDEM_")]:
            monkeypatch.delenv(var)
        for name, value in env.items():
            value = value.replace("tandem-etcd:2379", f"127.0.0.1:{etcd.port}").replace(
                "tandem-nats:4222", f"127.0.0.1:{nats_.port}")
            if value.startswith("/etc/tandem/infra-tls/"):
                value = secret[Path(value).name]
            monkeypatch.setenv(name, value)
        module = importlib.import_module(MODULES[router["args"][0]])
        config = dataclasses.replace(config_from_args(module.parse_args(router["args"][1:])), handle_signals=False,
                                     connect_timeout=3, lease_ttl=3)
        assert config.etcd_url.startswith("https://") and config.nats_url.startswith("tls://")
        await registers_and_watches(config)  # etcd over mutual TLS, and NATS over mutual TLS on the way in

        for without in ({"nats_tls_cert": None, "nats_tls_key": None}, {"etcd_tls_cert": None, "etcd_tls_key": None}):
            with pytest.raises(StartupError):  # --tlsverify / --client-cert-auth: a certificate is required
                async with Runtime.connect(dataclasses.replace(config, **without)):
                    pass
    finally:
        etcd.cleanup()
        nats_.cleanup()
