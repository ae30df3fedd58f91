"""Modules that a dependency imports at start-up but Tandem's processes seldom use, loaded on first use.

nats-py imports aiohttp and multidict as it is imported, for its WebSocket transport alone (``ws://``
NATS URLs); aiohttp was 0.1-0.3 s of every Tandem process's start, about half of what importing
:mod:`runtime` costs a restarted worker. :func:`defer` puts a stand-in in ``sys.modules`` that imports
the real module at the first access to one of its attributes and forwards every access to it, so a
``ws://`` URL still works (at the cost of that import then). The standard library's
:class:`importlib.util.LazyLoader` cannot serve here: on Python 3.11 an ``import`` statement of a
module already in ``sys.modules`` reads its ``__spec__``, which makes LazyLoader load it at once.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types

DEFERRED = ("aiohttp", "multidict")  # imported by nats.aio.transport, used only by its WebSocket transport


class _Deferred(types.ModuleType):
    """Stands for a module until one of its attributes is read; then the real one replaces it."""

    def __init__(self, name: str, spec) -> None:
        super().__init__(name)
        self.__spec__ = spec  # what the import system reads of a module in sys.modules: no load for it

    def __getattr__(self, attr: str):  # only for attributes this stand-in does not have
        name = self.__name__
        if sys.modules.get(name) is self:
            del sys.modules[name]
        return getattr(importlib.import_module(name), attr)


def defer(name: str) -> None:
    """Make ``import name`` cheap until ``name`` is used; nothing when it is imported already or missing."""
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is not None:
        sys.modules[name] = _Deferred(name, spec)


def defer_unused() -> None:
    for name in DEFERRED:
        defer(name)
