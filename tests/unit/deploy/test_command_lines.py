"""Every command line the deployment files give a component parses with that component's own flags:
the Kubernetes manifests, the compose services and the local launcher's plan."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import yaml

from deploy.stack import StackConfig, component_names, plan
from tests.support.kustomize import MODULES, build, pod_specs

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
BY_MODULE = {"frontend": "frontend", "router": "router", "workers.target": "target", "workers.draft": "draft",
             "workers.mock": "mock"}


def parse(component: str, args: list[str]) -> None:
    try:
        importlib.import_module(MODULES[component]).parse_args(args)
    except SystemExit as exc:
        pytest.fail(f"`{component} {' '.join(args)}` is rejected by its parser (exit {exc.code})")


def k8s_command_lines() -> list[tuple[str, list[str]]]:
    out = []
    for overlay in ("base", "overlays/cpu-demo", "overlays/gpu", "overlays/gpu-disagg"):
        for obj in build(ROOT / "k8s" / overlay):
            for spec in pod_specs(obj):
                for container in spec["containers"]:
                    args = container.get("args", [])
                    if args and args[0] in MODULES:
                        out.append((args[0], args[1:]))
    return out


def compose_command_lines() -> list[tuple[str, list[str]]]:
    compose = yaml.safe_load((ROOT / "deploy" / "docker-compose.yml").read_text())
    out = []
    for svc in compose["services"].values():
        command = svc.get("command", [])
        if command and command[0] in MODULES:
            # ${VAR:-default} as compose would expand it with VAR unset.
            out.append((command[0], [re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", a) for a in command[1:]]))
    return out


def launcher_command_lines() -> list[tuple[str, list[str]]]:
    out = []
    for cfg in (StackConfig(mock=True, targets=2, mock_token_latency_ms=0, num_speculative_tokens=2),
                StackConfig(model="/m", drafts=2, num_speculative_tokens=4, standalone_router=True),
                StackConfig(model="/m", draft_method="draft_model", draft_model="/d"),
                StackConfig(model="/m", draft_method="eagle3", draft_model="/h", speculative_eagle_topk=2,
                            speculative_num_steps=3)):
        ports = {n: 9000 + i for i, n in enumerate(component_names(cfg))}
        for comp in plan(cfg, cfg.model, ports):
            out.append((BY_MODULE[comp.module], list(comp.args)))
    return out


@pytest.mark.parametrize("source", [k8s_command_lines, compose_command_lines, launcher_command_lines])
def test_command_lines_parse(source):
    lines = source()
    assert lines
    for component, args in lines:
        parse(component, args)
