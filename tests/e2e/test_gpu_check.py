"""``bench/gpu_check.sh --dry-run``: the GPU check's every part starts on this machine (no GPU), the
GPU-only parts skip with a reason, and the served demo stack answers through the frontend, so the
script a GPU session runs in one go is not first exercised on the GPU."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]


def test_gpu_check_dry_run_starts_every_part(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, OUT=str(out), PYTHON=sys.executable)
    done = subprocess.run(["bash", "bench/gpu_check.sh", "--dry-run"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=240)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
    summary = (out / "summary.md").read_text()
    rows = {line.split("|")[1].strip(): line for line in summary.splitlines() if line.startswith("| ")}
    assert rows["tests"].split("|")[2].strip() == "ok" and "tests collected" in rows["tests"]
    for part in ("bench", "quant", "sweep", "oracle"):
        assert "skipped:" in rows[part], summary  # each GPU part says why it did not run
    served = rows["served"]
    assert served.split("|")[2].strip() == "ok", summary
    assert "equal 1/1" in served, summary  # speculation through the stack gave the plain output
    for log in ("tests", "served", "bench", "quant", "sweep", "oracle"):
        assert (out / f"{log}.log").exists()
