"""k8s/components/infra-tls and nats-creds, built over each overlay with the real ``kubectl kustomize``:
etcd (client and peer) and NATS serve mutual TLS from the Secret tandem-infra-tls, every Tandem
component reads https:// and tls:// URLs and certificate paths that lie in that Secret as mounted in
its own pod, and nats-creds gives every component a credentials file from tandem-nats-creds.
``tests/integration/test_k8s_infra_tls.py`` runs the rendered server flags and client settings on a
real etcd and nats-server."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

from runtime.config import config_from_args
from tests.unit.deploy import test_k8s
from tests.support.kustomize import K8S, build, build_with

pytestmark = pytest.mark.unit

SECRET_KEYS = {"ca.crt", "tls.crt", "tls.key"}
OVERLAYS = ["overlays/gpu", "overlays/cpu-demo", "overlays/gpu-tp2", "overlays/gpu-disagg"]


@pytest.fixture(scope="module", params=OVERLAYS)
def with_tls(request, tmp_path_factory) -> tuple[str, list[dict]]:
    return request.param, build_with(request.param, ["infra-tls", "nats-creds"], tmp_path_factory.mktemp("infra"))


def mounted(spec: dict, container: dict, path: str) -> tuple[str, str]:
    """(Secret name, key) that file ``path`` is in the container, read-only, readable by the pod's user."""
    mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, path
    [volume] = [v for v in spec["volumes"] if v["name"] == mounts[0]["name"]]
    assert mounts[0].get("readOnly") is True, path
    mode = volume["secret"].get("defaultMode", 0o644)
    security = spec.get("securityContext", {})
    # 0440: the group reads it, and the pod's fsGroup makes the files that group's
    assert mode & 0o004 or (mode & 0o040 and security.get("fsGroup") is not None), (path, oct(mode))
    return volume["secret"]["secretName"], path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]


def component_config(objs: list[dict], container: dict, monkeypatch, root: Path):
    """The component's runtime config, from the environment its pod gets. Files are checked to
    exist, so each path under /etc is given as the same path under ``root``, made there."""
    for var in [v for v in os.environ if v.startswith("TANDEM_")]:
        monkeypatch.delenv(var)
    env = {}
    config_maps = test_k8s.by_kind(objs, "ConfigMap")
    for source in container.get("envFrom", []):
        env.update(config_maps[source["configMapRef"]["name"]]["data"])
    env.update({e["name"]: e["value"] for e in container.get("env", []) if "value" in e})
    for name, value in env.items():
        if value.startswith("/etc/"):
            (root / value[1:]).parent.mkdir(parents=True, exist_ok=True)
            (root / value[1:]).touch()
            value = str(root / value[1:])
        monkeypatch.setenv(name, value)
    args = importlib.import_module(test_k8s.MODULES[container["args"][0]]).parse_args(container["args"][1:])
    config = config_from_args(args)
    for field in ("etcd_tls_ca", "etcd_tls_cert", "etcd_tls_key", "nats_tls_ca", "nats_tls_cert", "nats_tls_key",
                  "nats_creds"):
        value = getattr(config, field)
        if value:
            object.__setattr__(config, field, "/" + os.path.relpath(value, root))  # the path in the pod
    return config


def test_every_tandem_component_connects_with_tls_and_creds_from_the_secrets(with_tls, monkeypatch, tmp_path):
    overlay, objs = with_tls
    deployments = test_k8s.tandem_deployments(objs)
    assert {d["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/component"]
            for d in deployments.values()} == set(test_k8s.TANDEM_COMPONENTS)
    for name, dep in deployments.items():
        spec = dep["spec"]["template"]["spec"]
        [container] = spec["containers"]
        config = component_config(objs, container, monkeypatch, tmp_path)
        assert config.etcd_url.startswith("https://") and config.nats_url.startswith("tls://"), (overlay, name)
        assert config.etcd_security().tls
        files = {mounted(spec, container, getattr(config, f))
                 for f in ("etcd_tls_ca", "etcd_tls_cert", "etcd_tls_key", "nats_tls_ca", "nats_tls_cert", "nats_tls_key")}
        assert files == {("tandem-infra-tls", k) for k in SECRET_KEYS}, (overlay, name)
        assert mounted(spec, container, config.nats_creds) == ("tandem-nats-creds", "nats.creds"), (overlay, name)
        assert config.nats_url.split("//")[1].split(":")[0] == "tandem-nats"  # the name TLS checks


def _server_files(spec: dict, container: dict, args: list[str], flags: tuple[str, ...]) -> set[tuple[str, str]]:
    return {mounted(spec, container, test_k8s._flag(args, f)) for f in flags}


def test_etcd_and_nats_serve_mutual_tls_from_the_secret(with_tls):
    overlay, objs = with_tls
    base = test_k8s.by_kind(build(K8S / overlay), "StatefulSet")["tandem-etcd"]
    sts = test_k8s.by_kind(objs, "StatefulSet")["tandem-etcd"]
    spec = sts["spec"]["template"]["spec"]
    [etcd] = spec["containers"]
    args = etcd["command"]
    # the base's command with https:// client and peer URLs (metrics stay plain HTTP for the probes),
    # plus the certificate flags: a replica count or flag changed in the base shows up here
    [plain] = base["spec"]["template"]["spec"]["containers"]
    tls_flags = {"--client-cert-auth", "--peer-client-cert-auth"}
    with_files = ("cert-file", "key-file", "trusted-ca-file", "peer-cert-file", "peer-key-file", "peer-trusted-ca-file")
    assert [a for a in args if a not in tls_flags and a.split("=")[0][2:] not in with_files] == \
        [a.replace("http://", "https://") if not a.startswith("--listen-metrics-urls") else a for a in plain["command"]]
    assert tls_flags <= set(args)
    assert _server_files(spec, etcd, args, with_files) == {("tandem-infra-tls", k) for k in SECRET_KEYS}
    assert test_k8s._flag(args, "listen-metrics-urls").startswith("http://")
    probe = etcd["readinessProbe"]["httpGet"]
    assert probe.get("scheme", "HTTP") == "HTTP" and probe["port"] == "metrics"

    nats = test_k8s.by_kind(objs, "Deployment")["tandem-nats"]
    spec = nats["spec"]["template"]["spec"]
    [server] = spec["containers"]
    assert {"--tls", "--tlsverify"} <= set(server["args"])  # --tlsverify: clients must present a certificate
    files = _server_files(spec, server, server["args"], ("tlscert", "tlskey", "tlscacert"))
    assert files == {("tandem-infra-tls", k) for k in SECRET_KEYS}, overlay
    assert "--jetstream" not in server["args"] and "-js" not in server["args"]


def test_the_components_keep_every_overlay_valid_and_locked_down(with_tls):
    overlay, objs = with_tls
    assert not [o for o in objs if o["kind"] == "Secret"], "secrets are created by the operator, not committed"
    test_k8s.assert_valid_and_locked_down(overlay, objs)


def test_nats_creds_alone_leaves_the_urls_and_servers_plain(tmp_path, monkeypatch):
    objs = build_with("overlays/cpu-demo", ["nats-creds"], tmp_path)
    for dep in test_k8s.tandem_deployments(objs).values():
        spec = dep["spec"]["template"]["spec"]
        [container] = spec["containers"]
        config = component_config(objs, container, monkeypatch, tmp_path)
        assert config.nats_url.startswith("nats://") and not config.nats_tls_ca
        assert mounted(spec, container, config.nats_creds) == ("tandem-nats-creds", "nats.creds")
