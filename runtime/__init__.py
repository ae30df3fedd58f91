"""Tandem's distributed runtime: discovery over etcd, request and event planes over NATS.

No torch and no model code in this package.
"""

from .lazy_imports import defer_unused

defer_unused()  # before anything imports nats

from .config import RuntimeConfig  # noqa: E402
from .errors import (
    InstanceGone,
    InstanceTimeout,
    InvalidRequest,
    NoInstances,
    Overloaded,
    PayloadTooLarge,
    RemoteError,
    ShuttingDown,
    TandemError,
)
from .request_plane import PendingBytes, RequestContext, ResponseStream
from .runtime import EndpointClient, Runtime

__all__ = [
    "EndpointClient",
    "InstanceGone",
    "InstanceTimeout",
    "InvalidRequest",
    "NoInstances",
    "Overloaded",
    "PayloadTooLarge",
    "PendingBytes",
    "RemoteError",
    "RequestContext",
    "ResponseStream",
    "Runtime",
    "RuntimeConfig",
    "ShuttingDown",
    "TandemError",
]
