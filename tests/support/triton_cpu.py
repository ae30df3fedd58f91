"""Triton kernels on CPU for the tests: Triton's interpreter (``TRITON_INTERPRET=1``). Triton decides
when it is first imported whether its own library (``tl.sum``, …) is interpreted, so
``tests/conftest.py`` sets the variable for the whole session on a machine without CUDA. Triton also
reads it when a kernel is defined and while it runs, so :func:`interpreted` imports a test module's
kernel modules (reloads those imported without it) with the variable set, and keeps it set until the
block ends. With CUDA nothing changes."""

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
