"""k8s/components/planner over each overlay, built with the real ``kubectl kustomize``: valid against the
Kubernetes schema and locked down like every component; the planner's RBAC grants exactly what its
Kubernetes connector calls; its args parse with the planner's own parser; the network policies let
it reach etcd, NATS and the workers' metrics."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from planner.__main__ import k8s_deployments, parse_args, planner_config
from tests.unit.deploy import test_k8s
from tests.support.kustomize import build

pytestmark = pytest.mark.unit

K8S = Path(__file__).resolve().parents[3] / "k8s"


@pytest.fixture(scope="module", params=["overlays/cpu-demo", "overlays/gpu"])
def with_planner(request, tmp_path_factory) -> tuple[str, list[dict]]:
    root = tmp_path_factory.mktemp("planner")
    rel = os.path.relpath(K8S, root)
    (root / "kustomization.yaml").write_text(f"resources: [{rel}/{request.param}]\ncomponents: [{rel}/components/planner]\n")
    return request.param, build(root)


def one(objs: list[dict], kind: str, name: str) -> dict:
    [obj] = [o for o in objs if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def test_the_component_keeps_every_overlay_valid_and_locked_down(with_planner):
    overlay, objs = with_planner
    test_k8s.assert_valid_and_locked_down(overlay, objs)


def test_rbac_grants_the_scale_subresource_of_the_sized_deployments_and_nothing_more(with_planner):
    _, objs = with_planner
    deployment = one(objs, "Deployment", "tandem-planner")
    spec = deployment["spec"]["template"]["spec"]
    role = one(objs, "Role", "tandem-planner")
    binding = one(objs, "RoleBinding", "tandem-planner")
    assert binding["roleRef"]["name"] == "tandem-planner"
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": spec["serviceAccountName"],
                                    "namespace": deployment["metadata"]["namespace"]}]
    args = parse_args(spec["containers"][0]["args"][1:])
    planner_config(args)  # a valid configuration, not only parseable flags
    assert args.connector == "kubernetes" and args.k8s_namespace == deployment["metadata"]["namespace"]
    sized = set(k8s_deployments(args).values())
    assert {name for name in sized if any(o["kind"] == "Deployment" and o["metadata"]["name"] == name
                                          for o in objs)} == sized, "it sizes Deployments that exist"
    grants = {(tuple(r["apiGroups"]), tuple(r["resources"]), tuple(sorted(r["verbs"])),
               tuple(sorted(r.get("resourceNames", [])))) for r in role["rules"]}
    assert grants == {(("apps",), ("deployments/scale",), ("get", "patch"), tuple(sorted(sized))),
                      (("",), ("pods",), ("patch",), ())}
    assert deployment["spec"]["replicas"] == 1, "two planners would both act on every tick"


def test_the_planner_reaches_etcd_nats_and_the_workers_metrics(with_planner):
    _, objs = with_planner
    [namespace] = [o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"]
    planner = ({"kubernetes.io/metadata.name": namespace},
               one(objs, "Deployment", "tandem-planner")["spec"]["template"]["metadata"]["labels"])
    config = next(o for o in objs if o["kind"] == "ConfigMap")["data"]
    etcd_port, nats_port = (int(config[k].rsplit(":", 1)[1]) for k in ("TANDEM_ETCD", "TANDEM_NATS"))
    assert test_k8s.ingress_allowed(objs, planner, "tandem-etcd", etcd_port)
    assert test_k8s.ingress_allowed(objs, planner, "tandem-nats", nats_port)
    assert test_k8s.ingress_allowed(objs, planner, "tandem-target", 9100)
    assert test_k8s.ingress_allowed(objs, planner, "tandem-draft", 9100)
    assert not test_k8s.ingress_allowed(objs, planner, "tandem-etcd", 2380)
