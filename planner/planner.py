"""One planner tick: observe the pools, decide each (:mod:`planner.policy`), enact through the connector,
report every decision as metrics and one log line.

Which SLA drives which pool: the prefill pool is sized against TTFT when it may have workers
(``--max-prefill`` > 0); the target pool against ITL, and against TTFT as well when there is no
prefill pool to take it; the draft pool by its own load (targets' wait, late proposals, drafting time
per step, queueing, busy time). Pools change by at most one worker per tick.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from .config import PlannerConfig
from .connectors.base import Connector, ScaleError
from .estimate import LoadFit
from .metrics import PlannerMetrics
from .policy import Decision, PoolView, SlaCheck, Timing, decide_drafts, decide_latency_pool
from .signals import Observation, Signals

log = logging.getLogger("planner")

NEVER = float("-inf")


class Planner:
    def __init__(self, config: PlannerConfig, signals: Signals, connector: Connector, metrics: PlannerMetrics,
                 clock: Callable[[], float] = time.monotonic):
        self.config = config
        self.signals = signals
        self.connector = connector
        self.metrics = metrics
        self._clock = clock
        self.timing = Timing(config.up_cooldown, config.down_cooldown, config.down_ratio, config.min_samples,
                             config.start_timeout)
        self.fits = {("prefill", "ttft"): LoadFit(), ("target", "ttft"): LoadFit(), ("target", "itl"): LoadFit()}
        self.changed_at: dict[str, float] = {}
        self.short_since: dict[str, float] = {}
        self._last_reason: dict[str, str] = {}
        self.ticks = 0
        metrics.observe_sla(config.ttft_p90, config.itl_p90)

    # ------------------------------------------------------------------ one tick

    async def tick(self) -> list[Decision]:
        obs = await self.signals.observe()
        for error in obs.errors:
            log.debug("signal not read: %s", error)
        try:
            asked = await self.connector.replicas()
        except ScaleError as exc:
            log.warning("%s: deciding from discovery alone this tick", exc)
            asked = {}
        now = self._clock()
        replicas = {pool: asked.get(pool, len(p.live)) for pool, p in obs.pools.items()}
        self.metrics.observe(obs, replicas)
        decisions = [self._decide(pool, obs, replicas, now) for pool in self.managed(obs)]
        for decision in decisions:
            await self._enact(decision, obs, now)
        self.ticks += 1
        return decisions

    def managed(self, obs: Observation) -> list[str]:
        """The pools this planner sizes: target always; prefill and draft when they may or do have workers."""
        bounds = self.config.bounds
        pools = ["prefill"] if bounds["prefill"].high > 0 or obs.pools["prefill"].live else []
        pools.append("target")
        if bounds["draft"].high > 0 or obs.pools["draft"].live:
            pools.append("draft")
        return pools

    def _view(self, pool: str, obs: Observation, replicas: dict[str, int], now: float) -> PoolView:
        live = len(obs.pools[pool].live)
        if live < replicas[pool]:
            self.short_since.setdefault(pool, now)
        else:
            self.short_since.pop(pool, None)
        return PoolView(pool, replicas[pool], live, obs.pools[pool].load,
                        now - self.changed_at.get(pool, NEVER), now - self.short_since.get(pool, now))

    def _checks(self, pool: str, obs: Observation) -> list[SlaCheck]:
        cfg = self.config
        prefill_pool = cfg.bounds["prefill"].high > 0 or bool(obs.pools["prefill"].live)
        wanted = []
        if pool == "prefill" or (pool == "target" and not prefill_pool):
            if cfg.ttft_p90 is not None:
                wanted.append(("ttft", cfg.ttft_p90, obs.ttft))
        if pool == "target" and cfg.itl_p90 is not None:
            wanted.append(("itl", cfg.itl_p90, obs.itl))
        p = obs.pools[pool]
        checks = []
        for name, sla, stat in wanted:
            fit = self.fits[(pool, name)]
            if stat.p90 is not None and stat.samples >= cfg.min_samples:
                fit.add(p.load, stat.p90)
            after = fit.after_removal(stat.p90 if stat.samples >= cfg.min_samples else None, p.load, len(p.live))
            checks.append(SlaCheck(name, sla, stat.p90, stat.samples, after))
        self.metrics.observe_checks(pool, checks)
        return checks

    def _decide(self, pool: str, obs: Observation, replicas: dict[str, int], now: float) -> Decision:
        view = self._view(pool, obs, replicas, now)
        bounds = self.config.bounds[pool]
        if pool == "draft":
            return decide_drafts(view, obs.draft, bounds, self.config.draft, self.timing)
        return decide_latency_pool(view, self._checks(pool, obs), bounds, self.timing)

    async def _enact(self, decision: Decision, obs: Observation, now: float) -> None:
        self.metrics.observe_decision(decision)
        pool = decision.pool
        if decision.action == "hold":
            if self._last_reason.get(pool) != decision.reason:
                log.info("pool %s: hold at %d (%s): %s", pool, decision.current, decision.reason, decision.detail)
            else:
                log.debug("pool %s: hold at %d (%s): %s", pool, decision.current, decision.reason, decision.detail)
            self._last_reason[pool] = decision.reason
            return
        self._last_reason[pool] = decision.reason
        log.info("pool %s: %d -> %d (%s): %s", pool, decision.current, decision.desired, decision.reason,
                 decision.detail)
        remove_first = obs.pools[pool].least_loaded() if decision.action == "down" else []
        try:
            await self.connector.scale(pool, decision.desired, remove_first, decision.reason)
        except ScaleError as exc:
            self.metrics.scale_errors.labels(pool).inc()
            log.error("pool %s: could not scale to %d: %s", pool, decision.desired, exc)
            return
        self.changed_at[pool] = now

    # ------------------------------------------------------------------ the loop

    async def run(self, stop: asyncio.Event) -> None:
        """Tick every ``interval`` seconds until ``stop`` is set; a failing tick is logged, not fatal."""
        while not stop.is_set():
            started = self._clock()
            try:
                await self.tick()
            except Exception:
                log.exception("planner tick failed")
            delay = max(0.0, self.config.interval - (self._clock() - started))
            try:
                await asyncio.wait_for(stop.wait(), delay)
            except asyncio.TimeoutError:
                pass
