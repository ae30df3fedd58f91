"""Capped exponential backoff for cooldowns that a loop checks (draft workers that failed, late draft
streams, a failed distillation trainer); loops that retry a call (etcd connects, watches) use tenacity."""

from __future__ import annotations


def backoff_delay(attempt: int, base: float, cap: float) -> float:
    """Seconds before retry ``attempt`` (0: the first): ``base``, doubling per attempt, at most ``cap``."""
    return min(cap, base * 2.0 ** min(attempt, 64))
