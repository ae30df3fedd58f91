"""nats' WebSocket-only dependencies cost a Tandem process nothing until a ``ws://`` URL needs them."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.config import importable_env

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]

CODE = """
import sys
import runtime, nats.aio.transport as transport
print(sorted(m for m in ('aiohttp.client', 'multidict._multidict') if m in sys.modules))
assert transport.aiohttp and transport.multidict  # nats checks that they are there
print(transport.aiohttp.ClientSession.__name__, int(transport.aiohttp.WSMsgType.BINARY), transport.multidict.CIMultiDict.__name__)
import aiohttp, aiohttp.web
print(type(sys.modules['aiohttp']).__name__, aiohttp.web.Application.__name__)
"""


def test_aiohttp_loads_only_when_used():
    out = subprocess.run([sys.executable, "-c", CODE], env=importable_env(dict(os.environ)), cwd=ROOT,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "ClientSession 2 CIMultiDict", "module Application"]
