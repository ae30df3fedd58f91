"""Drafts of two kinds side by side on Kubernetes: ``overlays/gpu-draft-kinds`` (components/draft-kinds over
``gpu``), built with the real ``kubectl kustomize``. A suffix draft (tandem-draft) and an EAGLE-3 draft
(tandem-draft-eagle3) carry the draft workers' labels, their Deployments' selectors stay apart, the
targets' gRPC reaches both and nothing else does, and each runs flags its worker accepts."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.kustomize import build
from tests.unit.deploy import test_k8s

pytestmark = pytest.mark.unit

K8S = Path(__file__).resolve().parents[3] / "k8s"
DRAFTS = ("tandem-draft", "tandem-draft-eagle3")


@pytest.fixture(autouse=True)
def _no_tandem_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith("TANDEM_")]:
        monkeypatch.delenv(var)


@pytest.fixture(scope="module")
def kinds() -> list[dict]:
    return build(K8S / "overlays" / "gpu-draft-kinds")


def _container(objs: list[dict], name: str) -> dict:
    [container] = test_k8s.by_kind(objs, "Deployment")[name]["spec"]["template"]["spec"]["containers"]
    return container


def test_the_overlay_stays_valid_locked_down_and_complete(kinds, monkeypatch):
    built = ("overlays/gpu-draft-kinds", kinds)
    test_k8s.assert_valid_and_locked_down(*built)
    test_k8s.test_selectors_find_their_pods_services_and_deployments(built)
    test_k8s.test_tandem_pods_probe_health_and_live_and_terminate_gracefully(built)
    test_k8s.test_credentials_come_from_the_secret_and_each_component_reads_them(built, monkeypatch)
    gpu = {(o["kind"], o["metadata"]["name"]) for o in build(K8S / "overlays" / "gpu")}
    added = {(o["kind"], o["metadata"]["name"]) for o in kinds} - gpu
    assert added == {("Deployment", "tandem-draft-eagle3"), ("Service", "tandem-draft-eagle3")}


def test_two_draft_kinds_carry_the_draft_labels_with_selectors_apart(kinds):
    deployments = test_k8s.by_kind(kinds, "Deployment")
    labels = {name: deployments[name]["spec"]["template"]["metadata"]["labels"] for name in DRAFTS}
    for name in DRAFTS:
        assert labels[name]["app.kubernetes.io/component"] == "draft"
        others = [other for other in deployments if other != name
                  and test_k8s._selects(deployments[other]["spec"]["selector"], labels[name])]
        assert not others, f"{name}'s pods are also selected by {others}"
    # the ServiceMonitor of the workers scrapes both
    monitor = test_k8s.by_kind(kinds, "ServiceMonitor")["tandem-workers"]
    services = test_k8s.by_kind(kinds, "Service")
    for name in DRAFTS:
        assert test_k8s._selects(monitor["spec"]["selector"], services[name]["metadata"]["labels"]), name


def test_each_kind_runs_flags_its_worker_accepts(kinds, tmp_path):
    from workers.draft.__main__ import draft_config, parse_args

    suffix, eagle3 = (_container(kinds, name) for name in DRAFTS)
    assert parse_args(suffix["args"][1:]).method == "suffix"
    assert draft_config(parse_args(suffix["args"][1:])).method == "suffix"
    args = parse_args(eagle3["args"][1:])
    assert (args.method, args.eagle_model, args.device, args.dtype) == ("eagle3", "/models/eagle3-head", "cuda", "bfloat16")
    target = _container(kinds, "tandem-target")["args"]
    # the head reads the targets' model, and serves the name they serve
    assert f"--model={args.target_model}" in target
    for draft in (suffix, eagle3):
        assert test_k8s._flag(draft["args"], "served-model-name") == test_k8s._flag(target, "served-model-name")
        assert "--grpc-host=$(POD_IP)" in draft["args"]
        assert draft["image"] == _container(kinds, "tandem-target")["image"]  # pinned, the overlay's
    # the EAGLE-3 draft has a GPU and the models volume; the suffix draft needs neither GPU nor model
    assert eagle3["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert "nvidia.com/gpu" not in suffix["resources"].get("limits", {})
    spec = test_k8s.by_kind(kinds, "Deployment")["tandem-draft-eagle3"]["spec"]["template"]["spec"]
    [models] = [v for v in spec["volumes"] if v["name"] == "models"]
    assert models["persistentVolumeClaim"] == {"claimName": "tandem-models", "readOnly": True}


def test_targets_reach_both_kinds_and_nothing_else_does(kinds):
    here = {"kubernetes.io/metadata.name": "tandem"}
    pods = test_k8s._pods(kinds)
    grpc = int(test_k8s._flag(_container(kinds, "tandem-draft")["args"], "grpc-port"))
    for name in DRAFTS:
        assert test_k8s.ingress_allowed(kinds, (here, pods["tandem-target"][0]), name, grpc), name
        for other in ("tandem-frontend", "tandem-router", *DRAFTS):
            assert not test_k8s.ingress_allowed(kinds, (here, pods[other][0]), name, grpc), (other, name)
