"""Every overlay, and every component over the overlays, builds with the oldest kubectl the project supports
(1.30) and the newest (1.37), into the same objects: operators run anything in between, and kustomize's
behaviour changed between them (a file of two ``$patch: delete`` documents failed to parse in 1.30 and
panicked 1.31-1.33's kustomize 5.5.0, while 1.37's built it)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support.kustomize import NEWEST, OLDEST, build, kubectl

pytestmark = pytest.mark.unit

K8S = Path(__file__).resolve().parents[3] / "k8s"
OVERLAYS = ["base"] + sorted(f"overlays/{p.name}" for p in (K8S / "overlays").iterdir() if p.is_dir())
COMPONENTS = sorted(p.name for p in (K8S / "components").iterdir() if p.is_dir())


def test_the_pinned_kubectls_are_the_oldest_and_newest_supported():
    assert kubectl(OLDEST) != kubectl(NEWEST)


def _key(obj: dict) -> tuple[str, str, str]:
    return obj["kind"], obj["metadata"].get("namespace", ""), obj["metadata"]["name"]


def _same_with_both(directory: Path) -> list[dict]:
    old, new = build(directory, OLDEST), build(directory, NEWEST)
    assert sorted(map(_key, old)) == sorted(map(_key, new)), directory
    assert sorted(old, key=_key) == sorted(new, key=_key), directory
    return new


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_overlay_builds_the_same_with_the_oldest_and_newest_kubectl(overlay):
    assert _same_with_both(K8S / overlay)


@pytest.mark.parametrize("component", COMPONENTS)
def test_every_component_over_the_gpu_overlay_builds_with_both(component, tmp_path):
    rel = os.path.relpath(K8S, tmp_path)
    (tmp_path / "kustomization.yaml").write_text(
        f"resources: [{rel}/overlays/gpu]\ncomponents: [{rel}/components/{component}]\n")
    assert _same_with_both(tmp_path)


def test_the_cpu_demo_drops_both_disruption_budgets_with_both():
    names = {o["metadata"]["name"] for o in _same_with_both(K8S / "overlays/cpu-demo")
             if o["kind"] == "PodDisruptionBudget"}
    assert names == {"tandem-etcd"}
