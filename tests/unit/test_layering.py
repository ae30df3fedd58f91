"""Imports point down: proto <- runtime <- {router, workers} <- frontend <- deploy."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]
FORBIDDEN = {
    "proto": {"runtime", "router", "workers", "frontend", "deploy"},
    "runtime": {"router", "workers", "frontend", "deploy", "torch", "transformers"},
    "router": {"workers", "frontend", "deploy", "torch"},
    "workers": {"router", "frontend", "deploy"},
    "frontend": {"workers", "deploy"},
}


def imported_roots(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), str(path))
    roots = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            roots |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_package_imports_point_down(package):
    bad = []
    for path in sorted((ROOT / package).rglob("*.py")):
        wrong = imported_roots(path) & FORBIDDEN[package]
        if wrong:
            bad.append(f"{path.relative_to(ROOT)} imports {sorted(wrong)}")
    assert not bad, "\n".join(bad)
