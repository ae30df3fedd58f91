"""Capped exponential backoff: the one formula every retry in Tandem waits by (etcd watches and
connects, draft workers that failed, draft streams that were late)."""

from __future__ import annotations


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Seconds before retry ``attempt`` (0: the first): ``base``, doubling per attempt, at most ``cap``."""
    return min(cap, base * 2.0 ** min(attempt, 64))
