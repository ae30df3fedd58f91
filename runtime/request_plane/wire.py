"""What both ends of the request plane share: the liveness timings (heartbeats, probes, stalls), the
window after a NATS reconnect in which "no responders" is no verdict, and the payload limit."""

from __future__ import annotations

import time

from ..errors import PayloadTooLarge

STALL_FACTOR = 5  # heartbeat intervals without any frame before a stream counts as dead
PROBE_FACTOR = 0.5  # heartbeat intervals without any frame before the instance is probed
BLIP_GRACE_S = 3.0  # after a reconnect, how long "no responders" may mean "not resubscribed yet"
RESEND_INTERVAL = 0.1  # seconds between sends of a request that found nobody during that grace
NO_RESPONDERS = "503"  # NATS' status header: nobody subscribes to the subject


class Blip:
    """From a NATS disconnect until ``grace`` seconds after the reconnect (other processes
    resubscribe then), "no responders" may only mean that subscriptions are being re-established."""

    def __init__(self) -> None:
        self._until = 0.0  # monotonic (inf: disconnected)

    def disconnected(self) -> None:
        self._until = float("inf")

    def reconnected(self, grace: float = BLIP_GRACE_S) -> None:
        self._until = time.monotonic() + grace

    def active(self) -> bool:
        return time.monotonic() < self._until


def check_size(data: bytes, max_payload: int) -> None:
    if len(data) > max_payload:
        raise PayloadTooLarge(len(data), max_payload)
