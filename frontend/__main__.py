"""The OpenAI-compatible HTTP frontend.

Usage: python -m frontend --http-port 8000 [--host 127.0.0.1] [--router-mode kv|round_robin|random] [--remote-router]
       (etcd / NATS / namespace from --etcd/--nats/--namespace or TANDEM_ETCD/TANDEM_NATS/TANDEM_NAMESPACE)
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from router.base import ROUTER_MODES
from runtime import Runtime
from runtime.config import EnvParser, add_runtime_args, apply_env_defaults, config_from_args
from runtime.service import check_log_level, exit_on_bad_config, run_service

from .app import Frontend
from .auth import ApiKeyAuth, read_keys
from .flags import FRONTEND_FLAGS
from .config import DEFAULT_MAX_BODY_BYTES, DEFAULT_MAX_STREAM_BUFFER_BYTES, FrontendConfig
from .server import HttpServer

log = logging.getLogger("frontend")


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog="python -m frontend", description="Tandem OpenAI-compatible frontend")
    add_runtime_args(parser)
    parser.add_argument("--http-port", "--port", type=int, default=8000, help="HTTP port (0 picks a free one)")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1, loopback only)")
    parser.add_argument("--http-fd", type=int, default=None,
                        help="serve on this inherited listening socket instead of binding --host/--http-port (a "
                             "launcher that holds the socket across restarts of the frontend, as `tandem up` does)")
    parser.add_argument("--router-mode", default="kv", choices=ROUTER_MODES, help="routing (default kv)")
    parser.add_argument("--remote-router", action="store_true",
                        help="route through the shared `python -m router` service instead of an embedded router")
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES, help="larger bodies get a 413")
    parser.add_argument("--max-n", type=int, default=16, help="most choices per request")
    parser.add_argument("--max-migrations", type=int, default=3, help="re-sends of a request whose worker died")
    parser.add_argument("--restart-wait", type=float, default=30.0,
                        help="seconds a request, or a stream whose worker died, waits for a live worker when none "
                             "is left (a restart) before its 503; only for models a worker served here (0: 503 at "
                             "once)")
    parser.add_argument("--max-inflight", type=int, default=0, help="requests at once before a 429 (0: no limit)")
    parser.add_argument("--body-timeout", type=float, default=30.0,
                        help="seconds a client has to send its whole request body (then 408)")
    parser.add_argument("--header-timeout", type=float, default=10.0,
                        help="seconds from a request's first byte to the end of its headers before the connection "
                             "is closed")
    parser.add_argument("--idle-timeout", type=float, default=30.0,
                        help="seconds a connection may send nothing (new, or kept alive between requests) before it "
                             "is closed")
    parser.add_argument("--write-timeout", type=float, default=30.0,
                        help="seconds a streaming client may read nothing before its stream is dropped")
    parser.add_argument("--max-stream-buffer-bytes", type=int, default=DEFAULT_MAX_STREAM_BUFFER_BYTES,
                        help="bytes of a stream's output that may wait for a client that does not read before the "
                             "stream is dropped and its worker work cancelled")
    for flag in FRONTEND_FLAGS:
        flag.add(parser)
    parser.add_argument("--metrics-require-key", action="store_true", help="/metrics needs an API key too")
    parser.add_argument("--disagg-min-tokens", type=int, default=256,
                        help="prefill/decode disaggregation: prefill a prompt on a prefill worker only when its decode "
                             "worker lacks at least this many of its tokens in cache (shorter ones prefill there)")
    parser.add_argument("--prefill-max-queue", type=int, default=8,
                        help="prefill/decode disaggregation: prefill on the decode worker instead when the chosen "
                             "prefill worker has this many requests queued or in flight")
    parser.add_argument("--render-processes", type=int, default=1,
                        help="child processes that render large chat templates (over 16k characters of messages "
                             "and tools) off the event loop's GIL; 0: render them in a thread")
    parser.add_argument("--strict-fields", action="store_true",
                        help="answer request fields this server does not know with a 400 naming them (default: accept "
                             "and ignore them, with a log line and tandem_frontend_ignored_fields_total, as vLLM does)")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds open requests get on SIGTERM")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    parser.add_argument("--spare", action="store_true",
                        help="load the code, then wait for a line on stdin before starting (a launcher's spare, "
                             "started ahead of need to replace a frontend that dies; EOF: exit)")
    return apply_env_defaults(parser)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def build_config(args: argparse.Namespace) -> FrontendConfig:
    return FrontendConfig(host=args.host, http_port=args.http_port, router_mode=args.router_mode,
                          remote_router=args.remote_router,
                          max_body_bytes=args.max_body_bytes, max_n=args.max_n, max_migrations=args.max_migrations,
                          restart_wait_s=args.restart_wait,
                          max_inflight=args.max_inflight, body_timeout_s=args.body_timeout,
                          write_timeout_s=args.write_timeout, header_timeout_s=args.header_timeout,
                          idle_timeout_s=args.idle_timeout, max_stream_buffer_bytes=args.max_stream_buffer_bytes,
                          api_keys=read_keys(args.api_key or ()),
                          metrics_require_key=args.metrics_require_key, disagg_min_tokens=args.disagg_min_tokens,
                          prefill_max_queue=args.prefill_max_queue, strict_fields=args.strict_fields,
                          render_processes=args.render_processes, tool_call_parser=args.tool_call_parser,
                          router_queue_threshold=args.router_queue_threshold,
                          router_queue_policy=args.router_queue_policy)


async def amain(args: argparse.Namespace) -> None:
    config = build_config(args)
    async with Runtime.connect(config_from_args(args, drain_timeout=args.drain_timeout)) as rt:
        if rt.health is not None:  # the health port guards /metrics as the main port does
            rt.health.protect(lambda app: ApiKeyAuth(app, config.api_keys, config.metrics_require_key))
        async with Frontend.start(rt, config) as frontend:
            server = await HttpServer(frontend.app, config.host, config.http_port, args.drain_timeout,
                                      idle_timeout=config.idle_timeout_s, header_timeout=config.header_timeout_s,
                                      fd=args.http_fd).start()
            rt.mark_serving()
            frontend.serving()
            log.info("frontend ready on %s (router %s)", server.url, config.router_mode)
            await rt.wait_for_shutdown()
            log.info("shutting down: finishing open requests")
            await server.stop()


def wait_as_spare() -> bool:
    """Load what starting would load later (the event loop, uvicorn's HTTP protocol), then wait for
    the launcher's word on stdin: True to start, False (end of file) to exit."""
    try:
        import uvloop  # noqa: F401
    except ImportError:
        pass
    from .server import preload

    preload()
    print(f"spare frontend (pid {os.getpid()}) loaded; it starts when the launcher says so", flush=True)
    return bool(sys.stdin.readline())


def main(argv=None) -> None:
    args = parse_args(argv)
    exit_on_bad_config("python -m frontend", lambda: build_config(args), lambda: check_log_level(args.log_level),
                       lambda: config_from_args(args, drain_timeout=args.drain_timeout))
    if args.spare and not wait_as_spare():
        return
    try:
        run_service(lambda: amain(args), args.log_level)
    except OSError as exc:  # e.g. the HTTP port is taken
        logging.getLogger("frontend").error("%s", exc)
        sys.exit(1)


if __name__ == "__main__":
    main()
