"""Routing: which target instance serves a request.

Embedded (the frontend holds the router)::

    router = await create_router(rt, "kv")            # or "round_robin", "random"
    selection = await router.select(model, token_ids, exclude=frozenset(), request_id=rid)
    ...                                               # call selection.instance_id
    router.release(selection)                         # exactly once, however the request ended

Shared (several frontends use one ``python -m router`` service, which keeps the KV index and the
in-flight accounting for all of them)::

    router = await create_router(rt, "kv", remote=True)   # a RemoteRouter: same select/release

Modules: :mod:`router.base` (interface, load-blind modes), :mod:`router.factory` (``create_router``),
:mod:`router.kv_router` (KV-aware mode),
:mod:`router.indexer` (block index), :mod:`router.cost` (cost and choice, ``KvRouterConfig``),
:mod:`router.load` (load tracking), :mod:`router.spec_stats` (spec-decode aggregates),
:mod:`router.metrics` (Prometheus and JSON sinks), :mod:`router.remote` (service and client).
See docs/router.md.
"""

from .base import ROUTER_MODES, Router, Selection
from .factory import create_router

__all__ = ["ROUTER_MODES", "Router", "Selection", "create_router"]
