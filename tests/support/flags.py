"""Command-line words for the workers' JSON-valued flags, from keywords."""

from __future__ import annotations

import json


def speculative(**keys) -> list[str]:
    """``--speculative-config`` with ``keys`` (the one schema: workers/speculation/spec_config.py)."""
    return ["--speculative-config", json.dumps(keys)]


def kv_offload(**keys) -> list[str]:
    """``--kv-offload-config`` with ``keys`` (host_gb, disk_dir, disk_gb)."""
    return ["--kv-offload-config", json.dumps(keys)]
