"""The wire contract between the planner and a Tandem launcher (``tandem up``, ``tandem ray up``).

A launcher that can grow and shrink its own workers serves ``{ns}.launcher.scale`` on the request
plane. The planner sends a :class:`ScaleRequest` and reads one :class:`ScaleReply`. A request with
``replicas`` None only asks how many workers each pool has. msgspec Structs, positional on the
wire like :mod:`runtime.messages`; add fields only at the end, with defaults.
"""

from __future__ import annotations

import msgspec

COMPONENT = "launcher"
ENDPOINT = "scale"


class _Wire(msgspec.Struct, array_like=True, omit_defaults=True, frozen=True):
    """Base of the planner's wire messages."""


class ScaleRequest(_Wire):
    """Set ``pool`` (prefill, target, draft) to ``replicas`` workers. When workers must go, the
    launcher stops those whose pids are in ``remove_first`` first, in that order (the planner lists
    the least loaded first), then the newest."""

    pool: str
    replicas: int | None = None  # None: change nothing, report
    remove_first: list[int] = []
    reason: str = ""


class PoolReplicas(_Wire):
    pool: str
    replicas: int  # workers asked for (started and not being stopped)
    stopping: int = 0  # workers told to stop that are still draining


class ScaleReply(_Wire):
    pools: list[PoolReplicas] = []
    started: list[str] = []  # names of the workers this request started
    stopping: list[str] = []  # ... and of those it told to stop (they drain, then exit)
    error: str = ""  # the request was refused (unknown pool, a pool this stack cannot run, ...)
