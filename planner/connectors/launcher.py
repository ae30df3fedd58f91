"""The connector for Tandem's own launchers: ``tandem up`` (processes) and ``tandem ray up`` (Ray actors).

The launcher serves ``launcher.scale`` on the request plane (:mod:`planner.messages`); this side asks
it, over NATS, for a pool's size or to change it. One launcher per namespace is expected; with
several, the first in discovery order is asked.
"""

from __future__ import annotations

import asyncio
import logging

from runtime import TandemError
from runtime.messages import InstanceRecord
from runtime.request_plane import collect

from ..messages import COMPONENT, ENDPOINT, ScaleReply, ScaleRequest
from .base import ScaleError

log = logging.getLogger(__name__)


class LauncherConnector:
    """Scales through the launcher that serves ``launcher.scale`` in this namespace."""

    name = "launcher"

    def __init__(self, client, timeout: float = 30.0):
        """``client``: the runtime's endpoint client for ``launcher.scale`` (``rt.client(...)``)."""
        self._client = client
        self._timeout = timeout

    @classmethod
    async def connect(cls, rt, timeout: float = 30.0) -> LauncherConnector:
        return cls(await rt.client(COMPONENT, ENDPOINT), timeout)

    async def _ask(self, request: ScaleRequest) -> ScaleReply:
        instances = self._client.instances()
        if not instances:
            raise ScaleError(f"no launcher serves {COMPONENT}.{ENDPOINT} in this namespace "
                             "(run the stack with `tandem up` or `tandem ray up`, or pick another --connector)")
        try:
            stream = await self._client.call(instances[0].instance_id, request, ScaleReply)
            [reply] = await asyncio.wait_for(collect(stream), self._timeout)
        except (TandemError, asyncio.TimeoutError, ValueError) as exc:
            raise ScaleError(f"launcher {instances[0].instance_id} did not answer: {exc!r}") from None
        if reply.error:
            raise ScaleError(f"launcher refused {request.pool} -> {request.replicas}: {reply.error}")
        return reply

    async def replicas(self) -> dict[str, int]:
        reply = await self._ask(ScaleRequest("target"))
        return {p.pool: p.replicas for p in reply.pools}

    async def scale(self, pool: str, replicas: int, remove_first: list[InstanceRecord], reason: str) -> None:
        reply = await self._ask(ScaleRequest(pool, replicas, [r.pid for r in remove_first if r.pid], reason))
        if reply.started or reply.stopping:
            log.info("launcher: started %s, stopping %s", reply.started or "none", reply.stopping or "none")

    async def close(self) -> None:
        return None
