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


# Inside workers/: speculation <- engine <- {draft, target}; draft and target never import each other.
# (speculation is the maths and the wire payloads; the engine's one step verifies with it.)
WORKERS_FORBIDDEN = {
    "speculation": {"engine", "draft", "target", "mock", "demo_model"},
    "engine": {"draft", "target", "mock", "demo_model"},
    "draft": {"target", "mock"},
    "target": {"draft", "mock"},
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def workers_imports() -> dict[str, set[str]]:
    """Module -> the workers modules it imports (relative imports resolved, lazy ones included)."""
    modules = {_module_name(p): p for p in (ROOT / "workers").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - node.level + 1]
                    module = ".".join(base + ([node.module] if node.module else []))
                else:
                    module = node.module or ""
                targets = [f"{module}.{alias.name}" if f"{module}.{alias.name}" in modules else module
                           for alias in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def test_workers_subpackages_import_down():
    bad = []
    for module, imports in sorted(workers_imports().items()):
        parts = module.split(".")
        if len(parts) < 2 or parts[1] not in WORKERS_FORBIDDEN:
            continue
        for target in sorted(imports):
            if target.split(".")[1] in WORKERS_FORBIDDEN[parts[1]]:
                bad.append(f"{module} imports {target}")
    assert not bad, "\n".join(bad)


def test_no_import_cycle_in_workers():
    graph = workers_imports()
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    cycles = []

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                # a package and its own __init__ re-exports are not a cycle of modules
                cycle = path[path.index(nxt):] + [nxt]
                if not all(a.startswith(b + ".") or b.startswith(a + ".") for a, b in zip(cycle, cycle[1:])):
                    cycles.append(" -> ".join(cycle))
            elif nxt not in state:
                visit(nxt, path + [nxt])
        state[node] = 2

    for node in sorted(graph):
        if node not in state:
            visit(node, [node])
    assert not cycles, "\n".join(cycles)


# Inside workers/engine/: the Engine composes its parts, which sit below it and are handed their state.
ENGINE_PARTS = ("admission", "commits", "news", "outputs", "sizing")


def test_engine_parts_sit_below_the_engine():
    graph = workers_imports()
    bad = [f"workers.engine.{part} imports workers.engine.engine"
           for part in ENGINE_PARTS if "workers.engine.engine" in graph[f"workers.engine.{part}"]]
    assert not bad, "\n".join(bad)


# The config modules sit below what they configure: the speculation schema (read by the target, the
# draft and tandem up alike) and the draft methods' names know no engine, draft or target; the
# target's config, in the engine package, knows neither worker; the settings base knows no workers at
# all. Transitively, lazy imports included (workers_imports follows both).
CONFIG_MODULES = {
    "workers.speculation.spec_config": ("workers.engine", "workers.draft", "workers.target"),
    "workers.speculation.methods": ("workers.engine", "workers.draft", "workers.target"),
    "workers.engine.target_config": ("workers.draft", "workers.target"),
}


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        for nxt in graph[todo.pop()] - seen:
            seen.add(nxt)
            todo.append(nxt)
    return seen


@pytest.mark.parametrize("module", sorted(CONFIG_MODULES))
def test_config_modules_sit_below_what_they_configure(module):
    graph = workers_imports()
    bad = sorted(m for m in _reachable(graph, module) if m.startswith(CONFIG_MODULES[module]))
    assert not bad, f"{module} reaches {bad}"


def test_the_settings_base_imports_no_workers():
    assert "workers" not in imported_roots(ROOT / "runtime" / "settings.py")
    assert imported_roots(ROOT / "runtime" / "settings.py") <= {"__future__", "json", "collections", "pathlib",
                                                                  "typing", "pydantic"}


def test_config_modules_import_light():
    """Importing the config modules loads pydantic, not torch nor a worker (tandem up validates with them).
    One interpreter for all: none of them may load these, so neither may their union."""
    import subprocess
    import sys

    modules = ", ".join([*sorted(CONFIG_MODULES), "runtime.settings"])
    code = (f"import sys, {modules}; print(sorted(m for m in sys.modules if m == 'torch' or "
            "m.startswith(('workers.draft', 'workers.target', 'workers.engine.engine'))))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", f"the config modules load {out.stdout.strip()}"
