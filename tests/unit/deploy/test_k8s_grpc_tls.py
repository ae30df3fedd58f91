"""k8s/components/grpc-tls: mutual TLS between targets and drafts, built over each overlay with the
real ``kubectl kustomize``; every path a worker is given lies in the mounted Secret, and the name a
draft registers is one its certificate can carry and the cluster's DNS resolves."""

from __future__ import annotations

import importlib
import os
import re
from pathlib import Path

import pytest

from tests.unit.deploy import test_k8s
from tests.support.kustomize import build
from workers.speculation.spec_config import speculative_config

pytestmark = pytest.mark.unit

K8S = Path(__file__).resolve().parents[3] / "k8s"
SECRET_KEYS = {"ca.crt", "tls.crt", "tls.key"}


@pytest.fixture(scope="module", params=["overlays/gpu", "overlays/cpu-demo"])
def with_tls(request, tmp_path_factory) -> tuple[str, list[dict]]:
    root = tmp_path_factory.mktemp("grpc-tls")
    rel = os.path.relpath(K8S, root)
    (root / "kustomization.yaml").write_text(
        f"resources: [{rel}/{request.param}]\ncomponents: [{rel}/components/grpc-tls]\n")
    return request.param, build(root)


def _expand(env: list[dict], fields: dict[str, str]) -> dict[str, str]:
    """The container's environment as the kubelet builds it: $(VAR) refers to an earlier entry."""
    out: dict[str, str] = {}
    for e in env:
        if "value" in e:
            out[e["name"]] = re.sub(r"\$\(([A-Z_]+)\)", lambda m: out.get(m.group(1), m.group(0)), e["value"])
        elif "fieldRef" in e.get("valueFrom", {}):
            out[e["name"]] = fields[e["valueFrom"]["fieldRef"]["fieldPath"]]
    return out


def _parse(component: str, container: dict, env: dict[str, str], monkeypatch):
    for var in [v for v in os.environ if v.startswith("TANDEM_")]:
        monkeypatch.delenv(var)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    args = [re.sub(r"\$\(([A-Z_]+)\)", lambda m: env[m.group(1)], a) for a in container["args"][1:]]
    return importlib.import_module(test_k8s.MODULES[component]).parse_args(args)


def _secret_file(spec: dict, container: dict, path: str) -> tuple[str, str]:
    """(secret name, key) that ``path`` is in the container."""
    mounts = [m for m in container["volumeMounts"] if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert len(mounts) == 1, path
    [volume] = [v for v in spec["volumes"] if v["name"] == mounts[0]["name"]]
    assert mounts[0].get("readOnly") is True
    return volume["secret"]["secretName"], path[len(mounts[0]["mountPath"].rstrip("/")) + 1:]


def test_targets_and_drafts_get_their_certificates_from_the_secret(with_tls, monkeypatch):
    overlay, objs = with_tls
    deps = test_k8s.by_kind(objs, "Deployment")
    fields = {"metadata.name": "tandem-draft-5d8f7-abcde", "metadata.namespace": "tandem", "status.podIP": "10.0.0.7"}

    draft_spec = deps["tandem-draft"]["spec"]["template"]["spec"]
    [draft] = draft_spec["containers"]
    env = _expand(draft["env"], fields)
    args = _parse("draft", draft, env, monkeypatch)
    files = {_secret_file(draft_spec, draft, p) for p in (args.grpc_tls_cert, args.grpc_tls_key, args.grpc_tls_client_ca)}
    assert files == {("tandem-grpc-tls", k) for k in SECRET_KEYS}, overlay
    # The registered name: the pod's hostname under its subdomain, a headless Service that selects it
    # and publishes it before it is ready (a draft registers before its readiness probe passes).
    subdomain = draft_spec["subdomain"]
    assert args.advertise_host == f"{fields['metadata.name']}.{subdomain}.{fields['metadata.namespace']}.svc"
    svc = test_k8s.by_kind(objs, "Service")[subdomain]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert test_k8s._selects({"matchLabels": svc["spec"]["selector"]}, deps["tandem-draft"]["spec"]["template"]["metadata"]["labels"])
    assert args.grpc_host == fields["status.podIP"]  # it still listens on its pod IP

    target_spec = deps["tandem-target"]["spec"]["template"]["spec"]
    [target] = target_spec["containers"]
    args = _parse("target", target, _expand(target.get("env", []), fields), monkeypatch)
    spec = speculative_config(args.speculative_config)
    files = {_secret_file(target_spec, target, p) for p in (spec.draft_tls_ca, spec.draft_tls_cert, spec.draft_tls_key)}
    assert files == {("tandem-grpc-tls", k) for k in SECRET_KEYS}, overlay


def test_the_component_keeps_every_overlay_valid_and_locked_down(with_tls):
    overlay, objs = with_tls
    test_k8s.assert_valid_and_locked_down(overlay, objs)
