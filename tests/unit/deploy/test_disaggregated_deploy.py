"""Prefill/decode disaggregation in the deployment files: the k8s ``gpu-disagg`` overlay
(components/disaggregated over ``gpu``) and the compose profile ``disagg``. Prefill workers run
``--role=prefill``, the targets ``--role=decode``, both with the same model, image and GPU; the
network policy lets decode pods reach prefill pods on any TCP port (UCX picks its ports) and nothing
else reach them."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy import test_k8s
from tests.support.kustomize import build

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
K8S = ROOT / "k8s"
# ports UCX's TCP transport might listen on: it picks them at random
UCX_PORTS = (1024, 9100, 35393, 45103, 65535)


def _target_args(argv: list[str]):
    import workers.target.__main__ as target_main

    return target_main.parse_args(argv)


def _target_config(argv: list[str], tmp_path: Path):
    """The flags parsed and turned into the worker's config, whose checks refuse bad combinations (the
    model directory, which must exist, made up under ``tmp_path``)."""
    import workers.target.__main__ as target_main

    args = _target_args(argv)
    model = tmp_path / args.model.lstrip("/")
    model.mkdir(parents=True, exist_ok=True)
    return target_main.target_config(args, model)


@pytest.fixture(autouse=True)
def _no_tandem_env(monkeypatch):
    for var in [v for v in os.environ if v.startswith("TANDEM_")]:
        monkeypatch.delenv(var)


@pytest.fixture(scope="module")
def disagg() -> list[dict]:
    return build(K8S / "overlays" / "gpu-disagg")


def _container(objs: list[dict], name: str) -> dict:
    [container] = test_k8s.by_kind(objs, "Deployment")[name]["spec"]["template"]["spec"]["containers"]
    return container


def _pod(objs: list[dict], name: str) -> dict:
    return test_k8s.by_kind(objs, "Deployment")[name]["spec"]["template"]["spec"]


def test_prefill_workers_run_role_prefill_and_targets_role_decode_on_the_same_model(disagg, tmp_path):
    prefill, decode = _container(disagg, "tandem-prefill"), _container(disagg, "tandem-target")
    assert prefill["args"][0] == decode["args"][0] == "target"
    p, d = _target_config(prefill["args"][1:], tmp_path), _target_config(decode["args"][1:], tmp_path)
    assert (p.role, d.role) == ("prefill", "decode")
    assert "--role=prefill" in prefill["args"] and "--role=decode" in decode["args"]
    # a decode worker reads the prefill worker's blocks as its own: the same model, name and cache layout
    assert (p.model, p.served_model_name, p.block_size, p.dtype) == (d.model, d.served_model_name, d.block_size, d.dtype)
    assert p.kv_cache_gb == d.kv_cache_gb > _target_args([]).kv_cache_gb  # sized for a GPU, not the CPU default
    # the rest of the gpu overlay's target, unchanged but for the role
    gpu_target = _container(build(K8S / "overlays" / "gpu"), "tandem-target")
    assert [a for a in decode["args"] if a != "--role=decode"] == gpu_target["args"]
    assert [a for a in prefill["args"] if a != "--role=prefill"] == gpu_target["args"]


def test_prefill_pods_get_the_targets_image_env_gpu_and_models(disagg):
    prefill, decode = _container(disagg, "tandem-prefill"), _container(disagg, "tandem-target")
    assert prefill["image"] == decode["image"] == "registry.example.com/tandem:0.1.0"
    assert prefill["env"] == decode["env"] and prefill["envFrom"] == decode["envFrom"]
    assert prefill["resources"] == decode["resources"] and prefill["resources"]["limits"]["nvidia.com/gpu"] == "1"
    assert prefill["volumeMounts"] == decode["volumeMounts"]
    pod, target_pod = _pod(disagg, "tandem-prefill"), _pod(disagg, "tandem-target")
    for key in ("nodeSelector", "tolerations", "volumes", "securityContext", "terminationGracePeriodSeconds"):
        assert pod[key] == target_pod[key], key
    for probe in ("startupProbe", "readinessProbe", "livenessProbe", "lifecycle", "ports"):
        assert prefill[probe] == decode[probe], probe
    # the headless Service names the health port, as the targets' does (the ServiceMonitor finds it)
    svc = test_k8s.by_kind(disagg, "Service")["tandem-prefill"]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["ports"][0]["targetPort"] == "health"
    labels = test_k8s.by_kind(disagg, "Deployment")["tandem-prefill"]["spec"]["template"]["metadata"]["labels"]
    assert test_k8s._selects({"matchLabels": svc["spec"]["selector"]}, labels)
    assert not test_k8s._selects({"matchLabels": svc["spec"]["selector"]},
                                 test_k8s.by_kind(disagg, "Deployment")["tandem-target"]["spec"]["template"]["metadata"]["labels"])


def test_the_overlay_adds_the_prefill_pool_and_its_policy_and_nothing_else(disagg):
    names = {(o["kind"], o["metadata"]["name"]) for o in disagg}
    gpu = {(o["kind"], o["metadata"]["name"]) for o in build(K8S / "overlays" / "gpu")}
    assert names - gpu == {("Deployment", "tandem-prefill"), ("Service", "tandem-prefill"),
                           ("NetworkPolicy", "tandem-kv-transfer")}
    assert gpu <= names


def assert_kv_transfer_only_from_decode(objs: list[dict]) -> None:
    """Decode pods reach prefill pods on any TCP port; no other pod, namespace or client reaches them
    but Prometheus on the health port, and prefill pods reach neither decode pods nor drafts."""
    here = {"kubernetes.io/metadata.name": "tandem"}
    pods = test_k8s._pods(objs)
    src = {name: (here, labels) for name, (labels, _) in pods.items()}
    outside = ({"kubernetes.io/metadata.name": "default"}, {"app": "client"})
    monitoring = ({"kubernetes.io/metadata.name": "monitoring"}, {"app.kubernetes.io/name": "prometheus"})
    for port in UCX_PORTS:
        assert test_k8s.ingress_allowed(objs, src["tandem-target"], "tandem-prefill", port), port
        for other in [n for n in src if n != "tandem-target"]:  # prefill pods do not read each other
            assert not test_k8s.ingress_allowed(objs, src[other], "tandem-prefill", port), (other, port)
        assert not test_k8s.ingress_allowed(objs, outside, "tandem-prefill", port), port
        if port != pods["tandem-prefill"][1]["health"]:  # Prometheus reads /metrics there
            assert not test_k8s.ingress_allowed(objs, monitoring, "tandem-prefill", port), port
        # one way only: the reading side opens every connection
        assert not test_k8s.ingress_allowed(objs, src["tandem-prefill"], "tandem-target", port), port
    grpc = int(test_k8s._flag(_container(objs, "tandem-draft")["args"], "grpc-port"))
    assert not test_k8s.ingress_allowed(objs, src["tandem-prefill"], "tandem-draft", grpc)  # prefill dials no draft
    assert test_k8s.ingress_allowed(objs, monitoring, "tandem-prefill", pods["tandem-prefill"][1]["health"])
    [policy] = [p for p in objs if p["kind"] == "NetworkPolicy" and p["metadata"]["name"] == "tandem-kv-transfer"]
    assert all(entry.get("protocol") == "TCP" for rule in policy["spec"]["ingress"] for entry in rule["ports"])


def test_decode_pods_reach_prefill_pods_on_any_tcp_port_and_nothing_else_does(disagg):
    assert_kv_transfer_only_from_decode(disagg)


def test_the_policy_check_catches_a_policy_open_to_every_pod(disagg):
    objs = copy.deepcopy(disagg)
    [policy] = [p for p in objs if p["kind"] == "NetworkPolicy" and p["metadata"]["name"] == "tandem-kv-transfer"]
    policy["spec"] = {**policy["spec"], "ingress": [{"from": [{"podSelector": {}}], "ports": [{"protocol": "TCP"}]}]}
    with pytest.raises(AssertionError):
        assert_kv_transfer_only_from_decode(objs)
    policy["spec"] = {**policy["spec"], "ingress": []}  # and one that shuts the transfer out
    with pytest.raises(AssertionError):
        assert_kv_transfer_only_from_decode(objs)


def test_the_evaluator_reads_port_ranges_and_protocols():
    ports = {"health": 9100}
    assert test_k8s._port_matches({"protocol": "TCP"}, ports, 45103)
    assert test_k8s._port_matches({}, ports, 1)
    assert not test_k8s._port_matches({"protocol": "UDP"}, ports, 45103)
    assert test_k8s._port_matches({"port": 40000, "endPort": 50000}, ports, 45103)
    assert not test_k8s._port_matches({"port": 40000, "endPort": 45000}, ports, 45103)
    assert test_k8s._port_matches({"port": "health"}, ports, 9100) and not test_k8s._port_matches({"port": "health"}, ports, 9101)


def test_the_overlay_is_valid_and_locked_down(disagg):
    test_k8s.assert_valid_and_locked_down("overlays/gpu-disagg", disagg)


@pytest.mark.parametrize("overlay", ["base", "overlays/cpu-demo"])
def test_the_component_over_other_overlays_gives_prefill_the_targets_image(overlay, tmp_path):
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{rel}/{overlay}]\ncomponents: [{rel}/components/disaggregated]\n")
    objs = build(tmp_path)
    assert _container(objs, "tandem-prefill")["image"] == _container(objs, "tandem-target")["image"] != "tandem"
    assert "--role=decode" in _container(objs, "tandem-target")["args"]
    test_k8s.assert_valid_and_locked_down(overlay, objs)
    assert_kv_transfer_only_from_decode(objs)


# ------------------------------------------------------------------------------------------ compose


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())


def _expanded(command: list[str]) -> list[str]:
    """``${VAR:-default}`` as compose expands it with VAR unset."""
    return [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in command]


def test_compose_disagg_profile_runs_prefill_and_decode_in_place_of_the_target(compose, tmp_path):
    services = compose["services"]
    in_profile = {name for name, svc in services.items() if "disagg" in svc.get("profiles", [])}
    assert in_profile == {"frontend", "router", "draft", "prefill", "decode"}
    prefill, decode = (_target_config(_expanded(services[n]["command"])[1:], tmp_path) for n in ("prefill", "decode"))
    assert (prefill.role, decode.role) == ("prefill", "decode")
    assert (prefill.model, prefill.served_model_name) == (decode.model, decode.served_model_name)
    for name in ("prefill", "decode"):
        svc = services[name]
        assert svc["command"][0] == "target"
        assert svc["image"] == services["target"]["image"] and svc["environment"] == services["target"]["environment"]
        assert svc["volumes"] == services["target"]["volumes"]
        [device] = svc["deploy"]["resources"]["reservations"]["devices"]
        assert device["count"] == 1 and device["capabilities"] == ["gpu"]  # one device: no TP with a role
        # Prometheus finds targets by the DNS name `target` (deploy/prometheus/prometheus.yml)
        assert "target" in svc["networks"]["default"]["aliases"]
    prometheus = yaml.safe_load((ROOT / "deploy" / "prometheus" / "prometheus.yml").read_text())
    [job] = [j for j in prometheus["scrape_configs"] if j["job_name"] == "target"]
    assert job["dns_sd_configs"][0]["names"] == ["target"] and job["dns_sd_configs"][0]["port"] == 9100
