"""What ``python -m planner`` is told: SLA targets, pool bounds, timings and the draft rule's thresholds.

Durations on the command line take a unit (``50ms``, ``1.5s``); a bare number is seconds
(:func:`parse_seconds`). Inside, every duration is seconds.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

POOLS = ("prefill", "target", "draft")  # component names in discovery: prefill, target (decode/aggregated), draft
CONNECTORS = ("none", "launcher", "kubernetes")

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(ms|s)?\s*$")


def parse_seconds(text: str) -> float:
    """``"50ms"`` -> 0.05, ``"1.5s"`` -> 1.5, ``"0.2"`` -> 0.2 (seconds); ``ValueError`` otherwise."""
    m = _DURATION.match(str(text))
    if not m:
        raise ValueError(f"not a duration: {text!r} (write e.g. 50ms, 0.5s or 0.5 for seconds)")
    value = float(m.group(1))
    return value / 1000 if m.group(2) == "ms" else value


@dataclass(frozen=True)
class Bounds:
    """Replicas one pool may have: ``low <= n <= high``."""

    low: int
    high: int

    def __post_init__(self) -> None:
        if self.low < 0 or self.high < self.low:
            raise ValueError(f"pool bounds need 0 <= min <= max, got min {self.low}, max {self.high}")

    def clamp(self, n: int) -> int:
        return max(self.low, min(self.high, n))


@dataclass(frozen=True)
class DraftRule:
    """Thresholds of the draft pool's rule (docs/planner.md gives the formulas)."""

    wait_high: float = 0.10  # targets spend at least this share of their busy time waiting on proposals
    busy_high: float = 0.60  # drafts compute proposals at least this share of wall time: saturated
    busy_low: float = 0.15  # below this share a draft idles
    min_accepted_length: float = 1.3  # tokens per verify step for drafting to pay
    max_ratio: float | None = None  # optional safety bound: drafts per target at most (None: none)
    late_high: float = 0.20  # at least this share of proposals reach the targets too late to use
    step_high: float = 1.0  # a draft call takes at least this many target steps: proposals cannot keep pace
    batch_high: float = 64.0  # sequences per propose call (the draft head's largest CUDA graph); 0: not read

    def __post_init__(self) -> None:
        for name in ("wait_high", "busy_high", "busy_low", "late_high"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"draft {name.replace('_', '-')} must be a share in [0, 1], got {getattr(self, name)}")
        if self.busy_low >= self.busy_high:
            raise ValueError(f"draft busy-low ({self.busy_low}) must be below busy-high ({self.busy_high})")
        if self.min_accepted_length < 1.0:
            raise ValueError(f"min accepted length is at least 1 token per step, got {self.min_accepted_length}")
        if self.max_ratio is not None and self.max_ratio <= 0:
            raise ValueError(f"max draft ratio must be > 0, got {self.max_ratio}")
        if self.step_high <= 0:
            raise ValueError(f"draft step-high must be > 0 target steps, got {self.step_high}")
        if self.batch_high < 0:
            raise ValueError(f"draft batch-high must be >= 0 sequences (0: not read), got {self.batch_high}")


@dataclass(frozen=True)
class PlannerConfig:
    """One planner's settings. ``ttft_p90`` / ``itl_p90`` in seconds; None: that SLA is not planned for."""

    ttft_p90: float | None = None
    itl_p90: float | None = None
    bounds: dict[str, Bounds] = field(default_factory=lambda: {
        "prefill": Bounds(0, 0), "target": Bounds(1, 4), "draft": Bounds(0, 4)})
    interval: float = 5.0  # seconds between ticks
    window: float = 15.0  # seconds of latency behind each percentile
    up_cooldown: float = 10.0  # after any change to a pool, no scale-up of it for this long
    down_cooldown: float = 30.0  # ... and no scale-down for this long
    down_ratio: float = 0.7  # scale down only when the estimate after removing one is below this share of the SLA
    min_samples: int = 5  # latency observations a window needs before its percentile counts
    start_timeout: float = 180.0  # a worker asked for and not registered after this long is not waited for
    draft: DraftRule = field(default_factory=DraftRule)
    connector: str = "none"
    frontends: tuple[str, ...] = ()  # frontend base URLs whose /metrics give TTFT and ITL

    def __post_init__(self) -> None:
        for name in ("ttft_p90", "itl_p90"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name.replace('_', '-')} must be > 0 seconds, got {value}")
        if self.ttft_p90 is None and self.itl_p90 is None:
            raise ValueError("give at least one SLA: --ttft-p90 or --itl-p90")
        if set(self.bounds) != set(POOLS):
            raise ValueError(f"bounds must name every pool {POOLS}, got {sorted(self.bounds)}")
        if self.bounds["target"].low < 1:
            raise ValueError("min targets must be at least 1 (nothing serves without a target)")
        if self.interval <= 0 or self.window < self.interval:
            raise ValueError(f"need interval > 0 and window >= interval, got {self.interval}s and {self.window}s")
        if self.up_cooldown < 0 or self.down_cooldown < 0:
            raise ValueError("cooldowns must be >= 0 seconds")
        if not 0.0 < self.down_ratio < 1.0:
            raise ValueError(f"down ratio must be in (0, 1) (hysteresis below the SLA), got {self.down_ratio}")
        if self.min_samples < 1:
            raise ValueError(f"min samples must be >= 1, got {self.min_samples}")
        if self.connector not in CONNECTORS:
            raise ValueError(f"connector must be one of {CONNECTORS}, got {self.connector!r}")
        for url in self.frontends:
            if not url.startswith(("http://", "https://")):
                raise ValueError(f"frontend URL must be http(s)://HOST:PORT, got {url!r}")
