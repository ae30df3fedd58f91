"""Building a router by mode name: the one place that knows every kind of router.

Kept apart from :mod:`router.base` (the interface) so the abstract module imports none of its
subclasses.
"""

from __future__ import annotations

from runtime import Runtime

from .base import ROUTER_MODES, RandomRouter, RoundRobinRouter, Router
from .kv_router import KvRouter
from .remote import RemoteRouter


async def create_router(rt: Runtime, mode: str = "kv", *, remote: bool = False, component: str = "target",
                        **options) -> Router:
    """A started router of ``mode`` over the runtime's live ``component.generate`` instances (the
    targets; ``prefill`` for prefill workers, which the shared router service does not serve).

    ``remote=True`` returns a :class:`router.remote.RemoteRouter` that asks the shared
    ``python -m router`` service instead (the service's own ``--mode`` decides), with a router of
    ``mode`` in this process as its fallback while the service is unreachable.
    ``options`` for ``kv`` are the fields of :class:`router.cost.KvRouterConfig`; ``seed`` for the others.
    """
    if mode not in ROUTER_MODES:
        raise ValueError(f"router mode must be one of {ROUTER_MODES}, got {mode!r}")
    if remote:
        if component != "target":
            raise ValueError("the shared router service routes target instances only")
        router: Router = await RemoteRouter.create(rt, fallback=await _local(rt, mode, {}), **options)
    else:
        router = await _local(rt, mode, options, component)
    await router.start()
    return router


async def _local(rt: Runtime, mode: str, options: dict, component: str = "target") -> Router:
    """A router of ``mode`` in this process, not started."""
    if mode != "kv" and set(options) - {"seed"}:
        raise ValueError(f"router mode {mode!r} takes only the option 'seed', got {sorted(options)}")
    client = await rt.client(component, "generate")
    if mode == "round_robin":
        return RoundRobinRouter(client.instances, options.get("seed"))
    if mode == "random":
        return RandomRouter(client.instances, options.get("seed"))
    return await KvRouter.create(rt, client, **options)
