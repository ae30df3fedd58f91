"""Triton kernels on CPU for the tests: Triton's interpreter (``TRITON_INTERPRET=1``) while one test
module's tests run, not for the whole session. Triton reads the variable when a kernel is defined and
again while it runs, so :func:`interpreted` imports the kernel modules (reloads those imported without
it) with the variable set and keeps it set until the block ends. With CUDA nothing changes."""

from __future__ import annotations

import contextlib
import importlib
import sys
from collections.abc import Iterator
from types import ModuleType

import pytest
import torch


@contextlib.contextmanager
def interpreted(*names: str) -> Iterator[list[ModuleType]]:
    if torch.cuda.is_available():
        yield [importlib.import_module(name) for name in names]
        return
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TRITON_INTERPRET", "1")
        yield [importlib.reload(sys.modules[name]) if name in sys.modules else importlib.import_module(name)
               for name in names]
