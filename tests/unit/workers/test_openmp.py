"""How a worker's torch threads wait (workers.openmp): a target's GNU OpenMP workers spin briefly,
a draft's sleep at once, and what the user set wins; the environment is read in a fresh process,
as a worker reads it before torch loads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def _configured(spin: bool, **env: str) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    code = ("import json, os; from workers.openmp import configure_waiting; "
            f"configure_waiting(spin={spin}); "
            "print(json.dumps({k: os.environ.get(k) for k in ('OMP_WAIT_POLICY', 'GOMP_SPINCOUNT')}))")
    out = subprocess.run([sys.executable, "-c", code], env={**base, **env}, cwd=ROOT, capture_output=True,
                         text=True, check=True, timeout=60)
    return json.loads(out.stdout)


def test_a_target_spins_briefly_a_draft_sleeps_and_the_user_wins():
    assert _configured(True) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": "10000"}
    assert _configured(False) == {"OMP_WAIT_POLICY": "PASSIVE", "GOMP_SPINCOUNT": None}
    assert _configured(True, OMP_WAIT_POLICY="ACTIVE") == {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": None}
    assert _configured(True, GOMP_SPINCOUNT="0") == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": "0"}
