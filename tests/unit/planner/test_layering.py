"""The planner sits beside the frontend: it may import runtime and router's pure statistics, never
workers, frontend, deploy or torch (it must start in a small image, and never load a model)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.unit.test_layering import imported_roots

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


def test_planner_imports_point_down():
    bad = [f"{p.relative_to(ROOT)} imports {sorted(imported_roots(p) & {'workers', 'frontend', 'deploy', 'torch'})}"
           for p in sorted((ROOT / "planner").rglob("*.py"))
           if imported_roots(p) & {"workers", "frontend", "deploy", "torch", "transformers"}]
    assert not bad, "\n".join(bad)
