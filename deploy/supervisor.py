"""Restarting the launcher's children that exit without being asked: when, and how often.

A child that dies (a crash, an OOM kill, an operator's ``kill -9``) is started again with the same
command line, so on the same ports and under the same name; the rest of the stack keeps serving
meanwhile. Restarts back off: the first comes at once (``initial_delay``), each further one within
a burst of failures waits ``factor`` times longer, up to ``max_delay``; a child that then stays up
for ``stable_after`` seconds has its count reset. Only the launcher's own stop (or a planner's
scale-down, which marks the child ``expected_exit``) ends a child for good.

Why not a library: supervisord and circus are daemons with their own config files and control
sockets (XML-RPC, ZeroMQ), honcho restarts nothing, and none of them would keep what the launcher
gives its children (one process group each, ``PR_SET_PDEATHSIG``, ``[name]`` log lines, a planner
that adds and removes workers). The policy here is a pure function of times; the launcher's
supervise loop applies it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RestartPolicy:
    """How soon a dead child is started again."""

    initial_delay: float = 0.0  # the first restart of a burst: at once
    second_delay: float = 0.5  # the second; each further one ``factor`` times the one before
    factor: float = 2.0
    max_delay: float = 10.0
    stable_after: float = 30.0  # up this long: the next death starts a new burst

    def __post_init__(self) -> None:
        if min(self.initial_delay, self.second_delay, self.max_delay, self.stable_after) < 0 or self.factor < 1:
            raise ValueError("restart delays must be >= 0 and factor >= 1")

    def delay(self, failures: int) -> float:
        """The wait before restart number ``failures`` (1-based) of one burst."""
        if failures <= 1:
            return self.initial_delay
        return min(self.max_delay, self.second_delay * self.factor ** (failures - 2))


@dataclass
class RestartState:
    """One child's restarts: how many in the current burst, and when the next is due."""

    policy: RestartPolicy
    started_at: float = 0.0
    failures: int = 0  # deaths in the current burst
    restarts: int = 0  # over the child's life
    due: float | None = None  # when the pending restart should happen; None: none pending

    def started(self, now: float) -> None:
        self.started_at = now
        self.due = None

    def died(self, now: float) -> float:
        """Record a death at ``now``; returns the delay before the restart."""
        if now - self.started_at >= self.policy.stable_after:
            self.failures = 0
        self.failures += 1
        delay = self.policy.delay(self.failures)
        self.due = now + delay
        return delay

    def ready(self, now: float) -> bool:
        return self.due is not None and now >= self.due
