"""The ``tandem`` command: ``tandem up`` (local stack) and ``tandem ray up`` (Ray actors).

Usage: tandem up [--mock] [--targets N] [--drafts M] [--http-port 8000] ...
       tandem ray up --address auto --etcd http://HOST:2379 --nats nats://HOST:4222 [--mock] ...
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from deploy.stack import DRAFT_METHODS, ROUTER_MODES, StackConfig

log = logging.getLogger(__name__)


def add_stack_args(parser: argparse.ArgumentParser) -> None:
    """Flags describing the stack, shared by ``up`` and ``ray up`` (other tools script against these)."""
    parser.add_argument("--model", default=None, help="model directory (default: the bundled SmolLM2-135M demo)")
    parser.add_argument("--served-model-name", default=None, help="name clients pass as \"model\"")
    parser.add_argument("--draft-method", choices=DRAFT_METHODS, default="ngram",
                        help="how draft workers propose tokens (default ngram)")
    parser.add_argument("--draft-model", default=None, help="draft model / EAGLE head directory")
    parser.add_argument("--num-speculative-tokens", type=int, default=None, help="tokens proposed per round (γ)")
    parser.add_argument("--targets", type=int, default=1, help="target workers (default 1)")
    parser.add_argument("--drafts", type=int, default=None,
                        help="draft workers (default 1 for a real model, 0 with --mock or --draft-method none)")
    parser.add_argument("--router-mode", choices=ROUTER_MODES, default="kv", help="routing (default kv)")
    parser.add_argument("--standalone-router", action="store_true",
                        help="run the router as its own process (python -m router) instead of inside the frontend")
    parser.add_argument("--http-port", type=int, default=8000, help="frontend HTTP port (default 8000; 0: any free)")
    parser.add_argument("--host", default="127.0.0.1", help="frontend bind address (default 127.0.0.1)")
    parser.add_argument("--mock", action="store_true", help="mock target workers (no model, no drafts)")
    parser.add_argument("--mock-token-latency-ms", type=float, default=None,
                        help="mock worker time per generated token (0: as fast as possible)")
    parser.add_argument("--namespace", default=None, help="Tandem namespace (env TANDEM_NAMESPACE, default tandem)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds a stopping worker may drain")
    parser.add_argument("--log-level", default="INFO")


def stack_config(args: argparse.Namespace) -> StackConfig:
    return StackConfig(
        model=args.model, served_model_name=args.served_model_name, draft_method=args.draft_method,
        draft_model=args.draft_model, num_speculative_tokens=args.num_speculative_tokens,
        targets=args.targets, drafts=args.drafts, router_mode=args.router_mode,
        standalone_router=args.standalone_router, http_port=args.http_port, host=args.host, mock=args.mock,
        mock_token_latency_ms=args.mock_token_latency_ms,
        namespace=args.namespace or os.environ.get("TANDEM_NAMESPACE", "tandem"),
        drain_timeout=args.drain_timeout,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Run Tandem: speculative decoding across workers")
    sub = parser.add_subparsers(dest="command", required=True)

    up = sub.add_parser("up", help="start the whole stack locally on 127.0.0.1")
    add_stack_args(up)
    up.add_argument("--etcd", default=None, help="use this etcd (URL) instead of starting one")
    up.add_argument("--nats", default=None, help="use this NATS server (URL) instead of starting one")
    up.add_argument("--etcd-port", type=int, default=0, help="port for the etcd it starts (default: free)")
    up.add_argument("--nats-port", type=int, default=0, help="port for the nats-server it starts (default: free)")
    up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")

    ray = sub.add_parser("ray", help="run Tandem on a Ray cluster")
    ray_sub = ray.add_subparsers(dest="ray_command", required=True)
    ray_up = ray_sub.add_parser("up", help="place the components as Ray actors")
    add_stack_args(ray_up)
    ray_up.add_argument("--address", default="auto", help="Ray cluster address (default auto)")
    ray_up.add_argument("--etcd", default=os.environ.get("TANDEM_ETCD"), required="TANDEM_ETCD" not in os.environ,
                        help="etcd URL reachable from every Ray node (env TANDEM_ETCD)")
    ray_up.add_argument("--nats", default=os.environ.get("TANDEM_NATS"), required="TANDEM_NATS" not in os.environ,
                        help="NATS URL reachable from every Ray node (env TANDEM_NATS)")
    ray_up.add_argument("--gpus-per-worker", type=float, default=1.0,
                        help="GPUs reserved per target/draft actor (real model; 0 for CPU clusters)")
    ray_up.add_argument("--cpus-per-component", type=float, default=1.0, help="CPUs reserved per actor")
    ray_up.add_argument("--startup-timeout", type=float, default=600.0, help="seconds to wait for /health")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s [tandem] %(levelname)s %(message)s")
    try:
        config = stack_config(args)
    except ValueError as exc:
        sys.exit(f"tandem: error: {exc}")
    if args.command == "up":
        from deploy.launcher import LocalOptions, run_local

        try:
            options = LocalOptions(etcd_url=args.etcd, nats_url=args.nats, etcd_port=args.etcd_port,
                                   nats_port=args.nats_port, startup_timeout=args.startup_timeout)
        except ValueError as exc:
            sys.exit(f"tandem: error: {exc}")
        sys.exit(run_local(config, options))
    from deploy.ray_launcher import RayOptions, run_ray

    try:
        options = RayOptions(address=args.address, etcd_url=args.etcd, nats_url=args.nats,
                             gpus_per_worker=args.gpus_per_worker,
                             cpus_per_component=args.cpus_per_component, startup_timeout=args.startup_timeout)
    except ValueError as exc:
        sys.exit(f"tandem: error: {exc}")
    sys.exit(run_ray(config, options))


if __name__ == "__main__":
    main()
