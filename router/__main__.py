"""The shared router service.

Usage: python -m router --mode kv --http-port 8081
       (etcd / NATS / namespace from --etcd/--nats/--namespace or TANDEM_ETCD/TANDEM_NATS/TANDEM_NAMESPACE)

Serves ``router.select`` (see :mod:`router.remote`) over a router of ``--mode``, follows every
worker's spec-decode counters, and with ``--http-port`` serves ``/live``, ``/health``, ``/metrics``
(Prometheus: spec-decode counters, router decisions, index size) and ``/v1/spec_stats`` (JSON) on
127.0.0.1 (``--health-host`` to change).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import logging
from dataclasses import dataclass, field

from prometheus_client import REGISTRY

from runtime import Runtime
from runtime.config import EnvParser, add_runtime_args, apply_env_defaults, config_from_args
from runtime.messages import RouteRelease, RouteRequest
from runtime.service import check_log_level, exit_on_bad_config, run_service

from .base import ROUTER_MODES
from .factory import create_router
from .cost import KvRouterConfig
from .flags import QUEUE_FLAGS
from .metrics import KvRouterCollector, SpecDecodeCollector, spec_stats_json
from .remote import COMPONENT, ENDPOINT, TOPIC_ROUTE_RELEASE, RouterService
from .spec_stats import SpecDecodeStats, follow_spec_stats

log = logging.getLogger("router")


@dataclass(frozen=True)
class RouterServiceConfig:
    """Everything ``python -m router`` is told by its flags (besides the runtime's)."""

    mode: str = "kv"
    kv: KvRouterConfig = field(default_factory=KvRouterConfig)
    stats_window: float = 60.0
    selection_ttl: float = 600.0

    def __post_init__(self) -> None:
        if self.mode not in ROUTER_MODES:
            raise ValueError(f"mode must be one of {ROUTER_MODES}, got {self.mode!r}")
        if self.stats_window <= 0 or self.selection_ttl <= 0:
            raise ValueError("stats_window and selection_ttl must be > 0")

    def router_options(self) -> dict:
        if self.mode == "kv":
            return dataclasses.asdict(self.kv)
        return {"seed": self.kv.seed}


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog="python -m router", description="Tandem shared router service")
    add_runtime_args(parser)
    parser.add_argument("--router-mode", "--mode", dest="mode", default="kv", choices=ROUTER_MODES, help="routing policy")
    parser.add_argument("--http-port", type=int, default=None,
                        help="serve /live, /health, /metrics, /v1/spec_stats here (same as --health-port)")
    parser.add_argument("--block-size", type=int, default=16, help="KV block size until workers' events say theirs")
    parser.add_argument("--overlap-weight", type=float, default=KvRouterConfig.overlap_weight,
                        help="cost of one block of prefill, relative to one active decode block")
    parser.add_argument("--queue-weight", type=float, default=KvRouterConfig.queue_weight,
                        help="cost of one queued request, in blocks")
    parser.add_argument("--tier-hit-weight", type=float, default=KvRouterConfig.tier_hit_weight,
                        help="share of a block's prefill saved when a worker holds it in a lower KV tier (host, "
                             "disk) rather than on its device (0..1; a device hit saves 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="softmax temperature (0: cheapest wins)")
    parser.add_argument("--seed", type=int, default=None, help="random seed for --router-mode random (default: unseeded)")
    for flag in QUEUE_FLAGS:
        flag.add(parser)
    parser.add_argument("--no-dump", action="store_true", help="do not ask workers for their cache state at start")
    parser.add_argument("--stats-window", type=float, default=60.0, help="sliding window of spec-decode stats, seconds")
    parser.add_argument("--selection-ttl", type=float, default=600.0, help="forget unreleased selections after this")
    parser.add_argument("--drain-timeout", type=float, default=5.0, help="seconds open requests get on SIGTERM")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return apply_env_defaults(parser)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def service_config(args: argparse.Namespace) -> RouterServiceConfig:
    kv = KvRouterConfig(block_size=args.block_size, overlap_weight=args.overlap_weight, queue_weight=args.queue_weight,
                        tier_hit_weight=args.tier_hit_weight, temperature=args.temperature, seed=args.seed, request_dump=not args.no_dump,
                        inflight_ttl=args.selection_ttl, queue_threshold=args.router_queue_threshold,
                        queue_policy=args.router_queue_policy)
    return RouterServiceConfig(args.mode, kv, args.stats_window, args.selection_ttl)


async def _expire(service: RouterService) -> None:
    while True:
        await asyncio.sleep(min(10.0, service.ttl / 4))
        service.expire()


async def amain(args: argparse.Namespace) -> None:
    config = service_config(args)
    if args.http_port is not None:
        args.health_port = args.http_port
    async with Runtime.connect(config_from_args(args, drain_timeout=args.drain_timeout)) as rt:
        stats = SpecDecodeStats(config.stats_window)
        await follow_spec_stats(rt, stats)
        router = await create_router(rt, config.mode, **config.router_options())
        service = RouterService(router, rt.instance_id, config.selection_ttl)
        await rt.subscribe(TOPIC_ROUTE_RELEASE, RouteRelease, service.on_release)
        REGISTRY.register(SpecDecodeCollector(stats))
        if config.mode == "kv":
            REGISTRY.register(KvRouterCollector(router))
        if rt.health is not None:
            rt.health.add_route("/v1/spec_stats", lambda: spec_stats_json(stats))
        await rt.serve(COMPONENT, ENDPOINT, service.select, RouteRequest, role="router")
        expiry = asyncio.create_task(_expire(service), name="router-selection-expiry")
        log.info("router %s ready: mode %s%s", rt.instance_id, config.mode,
                 f", http on {rt.health.address}" if rt.health else "")
        await rt.wait_for_shutdown()
        expiry.cancel()
        await router.stop()


def main(argv=None) -> None:
    args = parse_args(argv)
    exit_on_bad_config("python -m router", lambda: service_config(args), lambda: check_log_level(args.log_level),
                       lambda: config_from_args(args, drain_timeout=args.drain_timeout))
    run_service(lambda: amain(args), args.log_level)


if __name__ == "__main__":
    main()
