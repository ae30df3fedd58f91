"""The image's environment: what the Dockerfile bakes in must suit every way the image runs, the
one-container demo (`docker run tandem:cpu up --mock`) as well as compose and Kubernetes."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

import pytest
import yaml

from deploy.cli import build_parser
from runtime.config import RuntimeConfig
from tests.support.kustomize import build

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def image_env(dockerfile: Path = ROOT / "Dockerfile") -> dict[str, str]:
    """The ENV of the Dockerfile's last stage (the image that runs)."""
    text = re.sub(r"\\\n", " ", dockerfile.read_text())
    stages = re.split(r"^FROM .*$", text, flags=re.MULTILINE)
    env: dict[str, str] = {}
    for line in stages[-1].splitlines():
        word, _, rest = line.strip().partition(" ")
        if word.upper() == "ENV":
            env.update(part.split("=", 1) for part in shlex.split(rest))
    return env


def test_the_image_names_no_etcd_or_nats_so_up_starts_its_own(monkeypatch):
    env = image_env()
    assert env["PATH"].startswith("/opt/tandem/bin")  # the parse above found the runtime stage
    for name in [n for n in os.environ if n.startswith("TANDEM_")]:
        monkeypatch.delenv(name)
    for name, value in env.items():
        if name.startswith("TANDEM_"):
            monkeypatch.setenv(name, value)
    args = build_parser().parse_args(["up", "--mock", "--host", "0.0.0.0"])
    # `up` starts etcd and nats-server inside the container only when it is not told to use others.
    assert args.etcd is None and args.nats is None, "the image points `up` at servers that are not there"
    assert not {"TANDEM_ETCD", "TANDEM_NATS"} & set(env)


def test_compose_and_kubernetes_set_the_addresses_the_image_leaves_out():
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    for name, svc in compose["services"].items():
        if "build" in svc:  # the Tandem services, from this Dockerfile
            assert {"TANDEM_ETCD", "TANDEM_NATS"} <= set(svc["environment"]), name
            RuntimeConfig(etcd_url=svc["environment"]["TANDEM_ETCD"], nats_url=svc["environment"]["TANDEM_NATS"])
    for overlay in ("base", "overlays/cpu-demo", "overlays/gpu"):
        [config] = [o for o in build(ROOT / "k8s" / overlay) if o["kind"] == "ConfigMap"
                    and o["metadata"]["name"] == "tandem-config"]
        assert {"TANDEM_ETCD", "TANDEM_NATS"} <= set(config["data"]), overlay


def test_image_env_reads_the_last_stage(tmp_path):
    dockerfile = tmp_path / "Dockerfile"
    dockerfile.write_text("FROM a AS build\nENV X=1\nFROM b AS runtime\nENV PATH=/p:$PATH \\\n    TANDEM_ETCD=http://etcd:2379\n")
    assert image_env(dockerfile) == {"PATH": "/p:$PATH", "TANDEM_ETCD": "http://etcd:2379"}
