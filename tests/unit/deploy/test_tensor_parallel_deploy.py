"""--tensor-parallel-size reaches the target from every launcher: ``tandem up`` (the plan), compose
(an environment variable, as many GPUs reserved) and the k8s ``gpu-tp2`` overlay (the tensor-parallel
component: the variable, 2 GPUs, a shared-memory /dev/shm)."""

from __future__ import annotations

from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from deploy.cli import build_parser, stack_config
from deploy.stack import StackConfig, plan
from tests.support.kustomize import build

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def _target_args(argv: list[str]):
    import workers.target.__main__ as target_main

    return target_main.parse_args(argv)


def test_tandem_up_passes_the_size_to_every_target():
    args = build_parser().parse_args(["up", "--model", "/m", "--targets", "2", "--tensor-parallel-size", "2",
                                      "--draft-method", "ngram"])
    config = stack_config(args)
    assert config.tensor_parallel_size == 2
    ports = {n: 9000 + i for i, n in enumerate(["draft-0", "target-0", "target-1", "frontend"])}
    targets = [c for c in plan(config, "/m", ports) if c.kind == "target"]
    assert len(targets) == 2
    for comp in targets:
        assert _target_args(list(comp.args)).tensor_parallel_size == 2
    single = plan(StackConfig(model="/m", draft_method="ngram"), "/m", ports)
    assert not any("--tensor-parallel-size" in c.args for c in single)


def test_bad_sizes_are_refused():
    with pytest.raises(ValueError, match="at least 1"):
        StackConfig(model="/m", tensor_parallel_size=0)
    with pytest.raises(ValueError, match="mock"):
        StackConfig(mock=True, tensor_parallel_size=2)


def test_compose_target_reads_the_size_and_reserves_that_many_gpus(monkeypatch):
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    target = compose["services"]["target"]
    assert "--tensor-parallel-size=${TANDEM_TENSOR_PARALLEL_SIZE:-1}" in target["command"]
    [device] = target["deploy"]["resources"]["reservations"]["devices"]
    assert device["count"] == "${TANDEM_TENSOR_PARALLEL_SIZE:-1}"
    assert target["shm_size"]


def test_k8s_gpu_tp2_overlay_splits_targets_over_two_gpus(monkeypatch):
    objs = build(ROOT / "k8s" / "overlays" / "gpu-tp2")
    deps = {o["metadata"]["name"]: o for o in objs if o["kind"] == "Deployment"}
    pod = deps["tandem-target"]["spec"]["template"]["spec"]
    [container] = pod["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["TANDEM_TENSOR_PARALLEL_SIZE"] == "2"
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    assert {"name": "dshm", "mountPath": "/dev/shm"} in container["volumeMounts"]
    assert [v for v in pod["volumes"] if v["name"] == "dshm"][0]["emptyDir"]["medium"] == "Memory"
    # the target reads the variable as its flag, with the overlay's own arguments
    monkeypatch.setenv("TANDEM_TENSOR_PARALLEL_SIZE", env["TANDEM_TENSOR_PARALLEL_SIZE"])
    assert _target_args(container["args"][1:]).tensor_parallel_size == 2
    draft = deps["tandem-draft"]["spec"]["template"]["spec"]["containers"][0]
    assert draft["resources"]["limits"]["nvidia.com/gpu"] == "1"
    for obj in objs:
        if obj["kind"] != "ServiceMonitor":  # a CRD: test_k8s checks it against its own schema
            kubernetes_validate.validate(obj, kubernetes_validate.utils.latest_version(), strict=True)
