"""The runtime's error hierarchy.

Remote failures travel as error frames (kind, message, field) and are raised on the client as
:class:`RemoteError`, or as the matching local class when the kind is one of ours. Mapping errors
to HTTP status codes happens only in ``frontend/``.
"""

from __future__ import annotations


class TandemError(Exception):
    """Base of all Tandem errors. ``kind`` names the error on the wire."""

    kind = "internal"


class StartupError(TandemError):
    """A service could not start (NATS or etcd unreachable, a port taken, ...): one line says what
    and where; the service exits non-zero."""

    kind = "startup"


class NoInstances(TandemError):
    """No live instance serves ``component.endpoint`` (optionally for ``model``)."""

    kind = "no_instances"

    def __init__(self, component: str, endpoint: str, model: str = ""):
        self.component, self.endpoint, self.model = component, endpoint, model
        what = f"{component}.{endpoint}" + (f" for model {model!r}" if model else "")
        super().__init__(f"no live instance serves {what}")


class InstanceGone(TandemError):
    """The instance left (lease gone, no responders, stream stalled) before the stream ended."""

    kind = "instance_gone"

    def __init__(self, instance_id: str, reason: str, unreachable: bool = False, stalled: bool = False):
        self.instance_id, self.reason = instance_id, reason
        self.unreachable = unreachable  # NATS reported no responders: nothing listens on its subject
        self.stalled = stalled  # an acknowledged stream went silent, heartbeats and all
        super().__init__(f"instance {instance_id} is gone: {reason}")


class InstanceTimeout(TandemError):
    """The instance did not acknowledge a request in time."""

    kind = "instance_timeout"

    def __init__(self, instance_id: str, timeout: float):
        self.instance_id, self.timeout = instance_id, timeout
        super().__init__(f"instance {instance_id} did not answer within {timeout:g}s")


def declares_gone(exc: BaseException) -> bool:
    """True when ``exc`` says its instance as a whole is gone or hung (nobody listens on its subject,
    a stream stalled, a request went unacknowledged), not only that one stream failed: the caller
    should route nothing more there until it shows a sign of life."""
    if isinstance(exc, InstanceTimeout):
        return True
    return isinstance(exc, InstanceGone) and (exc.unreachable or exc.stalled)


class PayloadTooLarge(TandemError):
    """A message exceeds the NATS server's max payload; raised before anything is sent."""

    kind = "payload_too_large"

    def __init__(self, size: int, max_payload: int):
        self.size, self.max_payload = size, max_payload
        super().__init__(f"payload of {size} bytes exceeds the maximum of {max_payload} bytes")


class ShuttingDown(TandemError):
    """The instance is draining and takes no new requests."""

    kind = "shutting_down"

    def __init__(self, message: str = "instance is shutting down"):
        super().__init__(message)


class InvalidRequest(TandemError):
    """The request is malformed or a parameter is out of range; ``field`` names it."""

    kind = "invalid_request"

    def __init__(self, message: str, field: str = ""):
        self.field = field
        super().__init__(message)


class Overloaded(TandemError):
    """The instance cannot take more work right now."""

    kind = "overloaded"


class EngineFailed(TandemError):
    """A worker's engine failed while running the request (a bug or an out-of-memory in a step); the
    worker keeps serving others, and the request may be retried elsewhere."""

    kind = "engine_failed"


class RemoteError(TandemError):
    """A handler failed on the remote side with an error that has no local class."""

    def __init__(self, kind: str, message: str, field: str = ""):
        self.kind, self.message, self.field = kind, message, field
        super().__init__(f"{kind}: {message}")


_BY_KIND: dict[str, type[TandemError]] = {
    cls.kind: cls for cls in (ShuttingDown, InvalidRequest, Overloaded, EngineFailed)
}


def error_from_frame(kind: str, message: str, field: str = "") -> TandemError:
    """Rebuild the error a remote handler raised from an error frame's fields."""
    cls = _BY_KIND.get(kind)
    if cls is InvalidRequest:
        return InvalidRequest(message, field)
    if cls is not None:
        return cls(message)
    return RemoteError(kind, message, field)


def error_to_frame(exc: BaseException) -> tuple[str, str, str]:
    """(kind, message, field) for an exception raised by a handler."""
    if isinstance(exc, RemoteError):
        return exc.kind, exc.message, exc.field
    if isinstance(exc, TandemError):
        return exc.kind, str(exc), getattr(exc, "field", "")
    return type(exc).__name__, str(exc), ""
