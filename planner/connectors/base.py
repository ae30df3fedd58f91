"""The connector interface: how many workers each pool was asked for, and asking for another number."""

from __future__ import annotations

from typing import Protocol

from runtime.messages import InstanceRecord


class ScaleError(RuntimeError):
    """The connector could not read or change a pool's size; the message says why."""


class Connector(Protocol):
    name: str

    async def replicas(self) -> dict[str, int]:
        """Workers asked for, per pool this connector manages (pools it does not manage are absent)."""

    async def scale(self, pool: str, replicas: int, remove_first: list[InstanceRecord], reason: str) -> None:
        """Ask for ``replicas`` workers in ``pool``; when shrinking, ``remove_first`` are the preferred
        workers to stop (least loaded first). Raises :class:`ScaleError`."""

    async def close(self) -> None:
        """Release what the connector holds."""


class NoConnector:
    """Decides and reports, enacts nothing: replicas are whatever discovery shows."""

    name = "none"

    async def replicas(self) -> dict[str, int]:
        return {}

    async def scale(self, pool: str, replicas: int, remove_first: list[InstanceRecord], reason: str) -> None:
        return None

    async def close(self) -> None:
        return None
