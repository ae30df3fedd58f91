"""The planner service.

Usage: python -m planner --itl-p90 50ms --ttft-p90 1s --max-targets 4 --connector launcher \
           --frontend-url http://127.0.0.1:8000 --health-port 9090
       (etcd / NATS / namespace from --etcd/--nats/--namespace or TANDEM_ETCD/TANDEM_NATS/TANDEM_NAMESPACE)

Every ``--adjustment-interval`` it reads the pools' live workers, load, latencies, acceptance and draft
work, decides each pool's replicas (docs/planner.md) and enacts them through ``--connector``: ``none``
(report only), ``launcher`` (``tandem up`` / ``tandem ray up`` grow and shrink their workers) or
``kubernetes`` (Deployments' scale subresource). Decisions are Prometheus metrics on ``--health-port``
and one log line each.
"""

from __future__ import annotations

import argparse
import asyncio
import logging

from runtime import Runtime
from runtime.config import EnvParser, add_runtime_args, apply_env_defaults, config_from_args
from runtime.service import check_log_level, exit_on_bad_config, run_service

from .config import CONNECTORS, POOLS, Bounds, DraftRule, PlannerConfig, parse_seconds
from .connectors.base import NoConnector, ScaleError
from .metrics import PlannerMetrics
from .planner import Planner
from .signals import Signals

log = logging.getLogger("planner")


def _seconds(flag: str, value) -> float | None:
    """A duration flag's value in seconds (durations stay text until here, so the environment sets them too)."""
    if value is None:
        return None
    try:
        return parse_seconds(value)
    except ValueError as exc:
        raise ValueError(f"{flag}: {exc}") from None


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog="python -m planner",
                                     description="Tandem planner: sizes prefill, target and draft pools to SLAs")
    add_runtime_args(parser)
    sla = parser.add_argument_group("SLA (p90; durations take ms or s, a bare number is seconds)")
    sla.add_argument("--ttft-p90", default=None, help="time to first token, 90th percentile")
    sla.add_argument("--itl-p90", default=None, help="inter-token latency, 90th percentile")
    pools = parser.add_argument_group("pool bounds")
    for pool, low, high, what in (("prefill", 0, 0, "prefill workers (component prefill)"),
                                  ("targets", 1, 4, "target workers (component target: decode or aggregated)"),
                                  ("drafts", 0, 4, "draft workers")):
        pools.add_argument(f"--min-{pool}", type=int, default=low, help=f"fewest {what}")
        pools.add_argument(f"--max-{pool}", type=int, default=high, help=f"most {what}")
    timing = parser.add_argument_group("timing")
    timing.add_argument("--adjustment-interval", default=5.0, help="time between decisions")
    timing.add_argument("--latency-window", default=15.0,
                        help="time behind each latency percentile and work share")
    timing.add_argument("--up-cooldown", default=10.0, help="after a change, no scale-up for this long")
    timing.add_argument("--down-cooldown", default=30.0,
                        help="after a change, no scale-down for this long")
    timing.add_argument("--down-ratio", type=float, default=0.7,
                        help="scale down only when the estimate with one worker fewer is below this share of the SLA")
    timing.add_argument("--min-samples", type=int, default=5, help="latency observations a window needs to count")
    timing.add_argument("--start-timeout", default=180.0,
                        help="how long a worker asked for may take to register before it is no longer waited for")
    draft = parser.add_argument_group("draft pool rule (its own load)")
    draft.add_argument("--draft-wait-high", type=float, default=DraftRule.wait_high,
                       help="add a draft when targets wait on proposals this share of their busy time")
    draft.add_argument("--draft-late-high", type=float, default=DraftRule.late_high,
                       help="add a draft when this share of proposals reaches the targets too late to use")
    draft.add_argument("--draft-step-high", type=float, default=DraftRule.step_high,
                       help="add a draft when a propose call takes this many target steps (proposals cannot keep pace)")
    draft.add_argument("--draft-batch-high", type=float, default=DraftRule.batch_high,
                       help="add a draft when its propose calls batch this many sequences on average (what queued "
                            "for each call; 0: not read)")
    draft.add_argument("--draft-busy-high", type=float, default=DraftRule.busy_high,
                       help="add a draft when drafts compute proposals this share of the time")
    draft.add_argument("--draft-busy-low", type=float, default=DraftRule.busy_low,
                       help="remove a draft when drafts compute proposals less than this share of the time")
    draft.add_argument("--min-accepted-length", type=float, default=DraftRule.min_accepted_length,
                       help="tokens per verify step (1 + accepted per draft) for drafting to pay")
    draft.add_argument("--max-draft-ratio", type=float, default=None,
                       help="optional safety bound: drafts per target at most (default: none, the draft pool follows "
                            "its load up to --max-drafts)")
    where = parser.add_argument_group("signals and connector")
    where.add_argument("--frontend-url", action="append", default=[],
                       help="a frontend's base URL whose /metrics give TTFT and ITL (repeat for several)")
    where.add_argument("--connector", choices=CONNECTORS, default="none",
                       help="who enacts decisions: none (report only), launcher (tandem up / tandem ray up), "
                            "kubernetes (Deployments' scale subresource)")
    where.add_argument("--k8s-namespace", default="tandem", help="Kubernetes namespace of the Deployments")
    where.add_argument("--k8s-deployment", action="append", default=[],
                       help="POOL=DEPLOYMENT, e.g. target=tandem-target (repeat; default: target=tandem-target, "
                            "draft=tandem-draft)")
    where.add_argument("--kubeconfig", default=None,
                       help="kubeconfig file (default: the pod's service account, else ~/.kube/config)")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return apply_env_defaults(parser)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def planner_config(args: argparse.Namespace) -> PlannerConfig:
    bounds = {"prefill": Bounds(args.min_prefill, args.max_prefill), "target": Bounds(args.min_targets, args.max_targets),
              "draft": Bounds(args.min_drafts, args.max_drafts)}
    rule = DraftRule(wait_high=args.draft_wait_high, busy_high=args.draft_busy_high, busy_low=args.draft_busy_low,
                     min_accepted_length=args.min_accepted_length, max_ratio=args.max_draft_ratio,
                     late_high=args.draft_late_high, step_high=args.draft_step_high, batch_high=args.draft_batch_high)
    return PlannerConfig(_seconds("--ttft-p90", args.ttft_p90), _seconds("--itl-p90", args.itl_p90), bounds,
                         _seconds("--adjustment-interval", args.adjustment_interval),
                         _seconds("--latency-window", args.latency_window), _seconds("--up-cooldown", args.up_cooldown),
                         _seconds("--down-cooldown", args.down_cooldown), args.down_ratio, args.min_samples,
                         _seconds("--start-timeout", args.start_timeout), rule, args.connector, tuple(args.frontend_url))


def k8s_deployments(args: argparse.Namespace) -> dict[str, str]:
    """``--k8s-deployment POOL=NAME`` flags as a dict (the base manifests' names by default)."""
    if not args.k8s_deployment:
        return {"target": "tandem-target", "draft": "tandem-draft"}
    out = {}
    for item in args.k8s_deployment:
        pool, sep, name = item.partition("=")
        if not sep or pool not in POOLS or not name:
            raise ValueError(f"--k8s-deployment {item!r}: write POOL=NAME with POOL one of {', '.join(POOLS)}")
        out[pool] = name
    return out


async def make_connector(args: argparse.Namespace, rt):
    if args.connector == "launcher":
        from .connectors.launcher import LauncherConnector

        return await LauncherConnector.connect(rt)
    if args.connector == "kubernetes":
        from .connectors.kubernetes import KubernetesConnector, api_client

        return KubernetesConnector(await asyncio.to_thread(api_client, args.kubeconfig), args.k8s_namespace,
                                   k8s_deployments(args))
    return NoConnector()


async def amain(args: argparse.Namespace) -> None:
    config = planner_config(args)
    async with Runtime.connect(config_from_args(args)) as rt:
        try:
            connector = await make_connector(args, rt)
        except ScaleError as exc:
            log.error("%s", exc)
            raise SystemExit(1) from None
        signals = Signals(rt, config.frontends, config.window)
        await signals.start()
        planner = Planner(config, signals, connector, PlannerMetrics())
        rt.mark_serving()
        log.info("planner %s ready: connector %s, SLA ttft p90 %s, itl p90 %s, every %gs%s", rt.instance_id,
                 connector.name, _ms(config.ttft_p90), _ms(config.itl_p90), config.interval,
                 f", metrics on http://{rt.health.address}/metrics" if rt.health else "")
        stop = asyncio.Event()
        task = asyncio.create_task(planner.run(stop), name="planner-loop")
        await rt.wait_for_shutdown()
        stop.set()
        await task
        await connector.close()


def _ms(seconds: float | None) -> str:
    return "off" if seconds is None else f"{1e3 * seconds:g} ms"


def main(argv=None) -> None:
    args = parse_args(argv)
    exit_on_bad_config("python -m planner", lambda: planner_config(args), lambda: k8s_deployments(args),
                       lambda: check_log_level(args.log_level), lambda: config_from_args(args))
    run_service(lambda: amain(args), args.log_level)


if __name__ == "__main__":
    main()
