"""The frontend's configuration: one frozen dataclass, built once from CLI flags."""

from __future__ import annotations

from dataclasses import dataclass

from router.base import ROUTER_MODES
from router.queue import QUEUE_POLICIES

from .tool_parsers import PARSERS

DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
DEFAULT_MAX_STREAM_BUFFER_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True)
class FrontendConfig:
    """What the HTTP frontend needs; the runtime's own settings live in ``RuntimeConfig``."""

    host: str = "127.0.0.1"
    http_port: int = 8000
    router_mode: str = "kv"
    remote_router: bool = False  # use the shared ``python -m router`` service instead of an embedded router
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES  # larger request bodies get a 413
    max_n: int = 16  # most choices (n, times the number of prompts) one request may ask for
    max_migrations: int = 3  # re-sends of one request to another worker after its worker failed
    # a request (or a stream whose worker died) with no live worker left waits this long for one (a
    # restart) before its 503, when a worker served the model here (0: 503 at once)
    restart_wait_s: float = 30.0
    max_inflight: int = 0  # requests served at once before new ones get a 429 (0: no limit)
    retry_after_s: int = 1  # Retry-After on 429 and 503 answers
    tokenizer_timeout_s: float = 120.0  # how long a request waits for its model's tokenizer to load
    write_timeout_s: float = 30.0  # a stream whose client reads nothing for this long is dropped
    max_stream_buffer_bytes: int = DEFAULT_MAX_STREAM_BUFFER_BYTES  # a stream with more output waiting is dropped
    body_timeout_s: float = 30.0  # a request body not complete by then is a 408 (slow or stalled uploads)
    header_timeout_s: float = 10.0  # a connection whose request headers are not complete by then is closed
    idle_timeout_s: float = 30.0  # a connection with no request (new, or kept alive) is closed after this
    api_keys: tuple[str, ...] = ()  # any of these as "Authorization: Bearer <key>" (none: no authentication)
    metrics_require_key: bool = False  # /metrics needs a key too (/health and /live never do)
    # prefill/decode disaggregation (only where prefill workers serve the model): a prompt is prefilled
    # on a prefill worker when the decode worker lacks at least this many of its tokens ...
    disagg_min_tokens: int = 256
    prefill_max_queue: int = 8  # ... and the chosen prefill worker has fewer requests queued or in flight
    render_processes: int = 1  # child processes rendering large chat templates (0: render them in a thread)
    strict_fields: bool = False  # unknown request fields are 400s (default: accepted, logged, counted, ignored)
    tool_call_parser: str | None = None  # tool_choice "auto": this format for every model (None: the chat template's)
    # the embedded kv router's queue (router/queue.py; with remote_router, the service's flags decide)
    router_queue_threshold: float | None = None
    router_queue_policy: str = "fcfs"

    def __post_init__(self) -> None:
        if not self.host:
            raise ValueError("host must not be empty")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"http_port must be in [0, 65535], got {self.http_port}")
        if self.router_mode not in ROUTER_MODES:
            raise ValueError(f"router_mode must be one of {ROUTER_MODES}, got {self.router_mode!r}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be at least 1024, got {self.max_body_bytes}")
        if self.tool_call_parser is not None and self.tool_call_parser not in PARSERS:
            raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {self.tool_call_parser!r}")
        if self.router_queue_threshold is not None and self.router_mode != "kv":
            raise ValueError("--router-queue-threshold needs --router-mode kv")
        if self.router_queue_threshold is not None and not self.router_queue_threshold > 0:
            raise ValueError(f"--router-queue-threshold must be > 0, got {self.router_queue_threshold}")
        if self.router_queue_policy not in QUEUE_POLICIES:
            raise ValueError(f"router_queue_policy must be one of {', '.join(QUEUE_POLICIES)}")
        if self.max_n < 1:
            raise ValueError(f"max_n must be at least 1, got {self.max_n}")
        if self.max_inflight < 0:
            raise ValueError(f"max_inflight must be >= 0, got {self.max_inflight}")
        if self.max_migrations < 0:
            raise ValueError(f"max_migrations must be >= 0, got {self.max_migrations}")
        if self.restart_wait_s < 0:
            raise ValueError(f"restart_wait_s must be >= 0, got {self.restart_wait_s}")
        if self.retry_after_s < 0:
            raise ValueError(f"retry_after_s must be >= 0, got {self.retry_after_s}")
        if any(not k or any(c.isspace() for c in k) for k in self.api_keys):
            raise ValueError("API keys must be non-empty and contain no whitespace")
        if self.metrics_require_key and not self.api_keys:
            raise ValueError("--metrics-require-key needs an --api-key")
        if self.max_stream_buffer_bytes < 64 * 1024:
            raise ValueError(f"max_stream_buffer_bytes must be at least 65536, got {self.max_stream_buffer_bytes}")
        if self.write_timeout_s <= 0:
            raise ValueError(f"write_timeout_s must be > 0, got {self.write_timeout_s}")
        if self.body_timeout_s <= 0:
            raise ValueError(f"body_timeout_s must be > 0, got {self.body_timeout_s}")
        if self.header_timeout_s <= 0 or self.idle_timeout_s <= 0:
            raise ValueError("header_timeout_s and idle_timeout_s must be > 0")
        if self.disagg_min_tokens < 1 or self.prefill_max_queue < 1:
            raise ValueError("disagg_min_tokens and prefill_max_queue must be at least 1")
        if self.render_processes < 0:
            raise ValueError(f"render_processes must be >= 0, got {self.render_processes}")
        if self.tokenizer_timeout_s <= 0:
            raise ValueError(f"tokenizer_timeout_s must be > 0, got {self.tokenizer_timeout_s}")
