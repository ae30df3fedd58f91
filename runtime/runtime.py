"""The distributed runtime of one process: an etcd lease, a NATS connection and their lifecycle.

Usage::

    async with Runtime.connect(RuntimeConfig.from_env()) as rt:
        await rt.serve("target", "generate", handler.generate, GenerateRequest, role="target")
        await rt.register_model(card)
        await rt.wait_for_shutdown()      # SIGTERM / SIGINT

Leaving the ``async with`` block (or a signal) revokes the lease first, so other processes stop
routing here at once, then drains in-flight streams for up to ``drain_timeout`` seconds, cancels
what is left, and closes NATS and etcd.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import ssl
import time
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import aetcd
import msgspec
import nats
from tenacity import AsyncRetrying, retry_if_exception, stop_after_delay, wait_exponential

from .config import RuntimeConfig, fixed_instance_id, redact_url
from .discovery import Registrar, Snapshot
from .etcd import EtcdClient
from .errors import NoInstances, StartupError
from .events import TOPIC_LOAD, EventPlane, Subscription
from .health import HealthServer
from .messages import InstanceRecord, KvAgentRecord, LoadEvent, ModelCard, encode
from .names import (check_token, instance_key, instances_prefix, kv_agent_key, kv_agents_prefix, model_key, models_prefix,
                    new_instance_id)
from .request_plane import Handler, PendingBytes, RequestClient, RequestServer, ResponseStream

log = logging.getLogger(__name__)


def _refused(exc: Exception) -> bool:
    """etcd answered, and said no (credentials or permissions), as opposed to being unreachable."""
    return (isinstance(exc, (aetcd.InvalidArgumentError, aetcd.exceptions.UnauthenticatedError))
            or "permission denied" in str(exc))


def final_cause(exc: BaseException) -> str | None:
    """Why NATS or etcd cannot be reached, when waiting will not change it (nothing listens on the port,
    its TLS certificate is not trusted or ours is refused, our credentials are wrong); None for what
    may pass (a timeout, a name that does not resolve yet, a server still starting)."""
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (nothing listens on that port)"
    if isinstance(exc, ssl.SSLCertVerificationError):
        return f"TLS certificate verification failed ({exc.verify_message or exc.reason})"
    if isinstance(exc, ssl.SSLError):
        return f"TLS handshake failed ({exc.reason or exc})"
    text = str(exc)
    lowered = text.lower()
    if "authorization violation" in lowered:
        return "authorization violation (check the token, user, password or credentials)"
    if "tls required" in lowered or "secure connection" in lowered:
        return "the server requires TLS (give its CA)"
    # etcd, through gRPC: the message of the last connection attempt
    if "connection refused" in lowered:
        return "connection refused (nothing listens on that port)"
    if "certificate_verify_failed" in lowered or "certificate verify failed" in lowered:
        return "TLS certificate verification failed (is the right CA given?)"
    if "handshake failed" in lowered or "wrong_version_number" in lowered:
        return "TLS handshake failed" + (" (is the server plaintext?)" if "wrong_version_number" in lowered else "")
    return None


def gave_up(seconds: float, errors: list[BaseException]) -> str:
    """``gave up after Ns`` with the last error seen, for causes that were worth waiting for."""
    if not errors:
        return f"gave up after {seconds:g}s (no answer)"
    exc = errors[-1]
    text = str(exc).strip()
    return f"gave up after {seconds:g}s: {type(exc).__name__}" + (f": {text[:200]}" if text else "")


UNREACHABLE_HOLD_S = 30.0  # how long an instance declared gone stays out of routing, failing a sign of life

T = TypeVar("T")


class EndpointClient:
    """Calls instances of one ``component.endpoint``; keeps a live snapshot of them."""

    def __init__(self, runtime: Runtime, component: str, endpoint: str, snapshot: Snapshot[InstanceRecord]):
        self._rt = runtime
        self.component = component
        self.endpoint = endpoint
        self.snapshot = snapshot

    def instances(self, model: str | None = None) -> list[InstanceRecord]:
        """Live instances (optionally only those serving ``model``), in a stable order; instances
        marked unreachable (:meth:`mark_unreachable`) are left out until they re-register or the mark
        expires."""
        unreachable = self._rt.unreachable
        found = [r for r in self.snapshot.values()
                 if (model is None or r.model == model) and not (unreachable and self._rt.is_unreachable(r))]
        return sorted(found, key=lambda r: r.instance_id)

    def unreachable_ids(self) -> list[str]:
        """Instances of this endpoint currently marked unreachable."""
        return [r.instance_id for r in self.snapshot.values() if self._rt.unreachable and self._rt.is_unreachable(r)]

    def mark_unreachable(self, instance_id: str, why: str = "no responders") -> None:
        """This instance was declared gone (NATS said nobody listens on its subject: a SIGKILLed
        process whose lease has not expired yet; or a stream of it stalled, or it did not acknowledge
        a request: a hung process): route around it from now on, not only for the request that found
        out, until it shows a sign of life (:meth:`Runtime.alive`)."""
        self._rt.mark_unreachable(instance_id, self.snapshot.values(), why)

    async def wait_for_instances(self, count: int = 1, timeout: float = 30.0, model: str | None = None) -> list[InstanceRecord]:
        """Wait until at least ``count`` instances are live; raises :class:`NoInstances` on timeout."""

        def enough(items: dict[str, InstanceRecord]) -> bool:
            return sum(1 for r in items.values() if model is None or r.model == model) >= count

        try:
            await self.snapshot.wait_for(enough, timeout)
        except asyncio.TimeoutError:
            raise NoInstances(self.component, self.endpoint, model or "") from None
        return self.instances(model)

    async def call(
        self, instance_id: str, request: Any, response_type: type[T] | None = None, request_id: str | None = None,
        pending: PendingBytes | None = None,
    ) -> ResponseStream[T]:
        """Send ``request`` to one instance; iterate the returned stream for its responses (``pending``
        counts the bytes of its frames not read yet)."""
        return await self._rt._requests.call(self.component, self.endpoint, instance_id, request, response_type,
                                             request_id, pending)


class Runtime:
    """One process's connection to the distributed runtime. Build it with :meth:`connect`."""

    def __init__(self, config: RuntimeConfig):
        self.config = config
        self.namespace = config.namespace
        # TANDEM_INSTANCE_ID: a stable worker id across restarts (a StatefulSet pod's name); each start
        # is then told apart by its incarnation, which only grows
        self.instance_id = check_token(fixed_instance_id() or new_instance_id(), "TANDEM_INSTANCE_ID")
        self.incarnation = time.time_ns()
        self.started_at = self.incarnation / 1e9
        self.nc: nats.NATS | None = None
        self.etcd: aetcd.Client | None = None
        self.events: EventPlane | None = None
        self._registrar: Registrar | None = None
        self._server: RequestServer | None = None
        self._requests: RequestClient | None = None
        self._snapshots: dict[tuple[str, type], Snapshot] = {}
        # instance id -> (its record when it was found unreachable, when the mark expires)
        self.unreachable: dict[str, tuple[InstanceRecord | None, float]] = {}
        self._life_watch: asyncio.Future | None = None  # the load-event subscription behind alive()
        self.health: HealthServer | None = None
        self._served = 0
        self._health_checks: list[Callable[[], bool]] = []  # the service's own: all must pass to be ready
        self._shutdown = asyncio.Event()
        self._signals = 0
        self._closed = False
        self._opened = False  # _open finished: _close has something to report

    # ------------------------------------------------------------------ lifecycle

    @classmethod
    @contextlib.asynccontextmanager
    async def connect(cls, config: RuntimeConfig) -> AsyncIterator[Runtime]:
        """Open the runtime; everything is released when the block exits."""
        rt = cls(config)
        try:
            await rt._open()
            yield rt
        finally:
            await rt._close()

    async def _open(self) -> None:
        cfg = self.config
        connected = False
        final: asyncio.Future[str] = asyncio.get_running_loop().create_future()
        last_error: list[BaseException] = []

        async def on_error(exc: Exception) -> None:
            if connected:
                log.warning("nats: %r", exc)
                return
            # Before the first connection: a final cause ends the wait at once, others are retried
            last_error[:] = [exc]
            cause = final_cause(exc)
            if cause is not None and not final.done():
                final.set_result(cause)

        async def on_disconnect() -> None:
            for side in (self._requests, self._server):
                if side is not None:
                    side.disconnected()
            if not self._closed:
                log.warning("nats: disconnected from %s", redact_url(cfg.nats_url))

        async def on_reconnect() -> None:
            for side in (self._requests, self._server):
                if side is not None:
                    side.reconnected()
            log.info("nats: reconnected to %s", redact_url(cfg.nats_url))

        connecting = asyncio.ensure_future(nats.connect(
            cfg.nats_url,
            name=f"tandem-{self.instance_id}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            allow_reconnect=True,
            connect_timeout=min(2.0, cfg.connect_timeout),
            error_cb=on_error,
            disconnected_cb=on_disconnect,
            reconnected_cb=on_reconnect,
            **cfg.nats_options(),
        ))
        await asyncio.wait((connecting, final), timeout=cfg.connect_timeout, return_when=asyncio.FIRST_COMPLETED)
        where = f"NATS at {redact_url(cfg.nats_url)}"
        if not connecting.done():
            connecting.cancel()
            await asyncio.gather(connecting, return_exceptions=True)
            if final.done():
                raise StartupError(f"cannot reach {where}: {final.result()}")
            raise StartupError(f"cannot reach {where}: {gave_up(cfg.connect_timeout, last_error)}")
        try:
            self.nc = connecting.result()
        except (asyncio.TimeoutError, OSError, nats.errors.Error) as exc:
            cause = final_cause(exc) or gave_up(cfg.connect_timeout, [*last_error, exc][-1:])
            raise StartupError(f"cannot reach {where}: {cause}") from None
        connected = True
        host, port = cfg.etcd_host_port
        security = cfg.etcd_security()
        retrying = AsyncRetrying(stop=stop_after_delay(cfg.connect_timeout), wait=wait_exponential(0.1, max=0.5),
                                 retry=retry_if_exception(lambda exc: not _refused(exc) and final_cause(exc) is None),
                                 reraise=True)
        try:  # etcd: retried until the deadline unless the cause is final, then one line
            async for attempt in retrying:
                with attempt:
                    self.etcd = EtcdClient(host, port, security, timeout=min(5.0, cfg.connect_timeout))
                    try:
                        await self.etcd.connect()
                        # a read first: etcd grants leases without auth, so this is what finds missing credentials
                        await self.etcd.get(instances_prefix(self.namespace).encode())
                        self._registrar = Registrar(self.etcd, cfg.lease_ttl)
                        await self._registrar.start()
                    except Exception:
                        await self.etcd.close()
                        raise
        except Exception as exc:
            if _refused(exc):  # wrong user or password, auth required, no permission: retrying will not help
                who = f" as {security.user}" if security.user else ""
                raise StartupError(f"etcd at {redact_url(cfg.etcd_url)} refused us{who}: {exc}") from None
            cause = final_cause(exc) or gave_up(cfg.connect_timeout, [exc])
            raise StartupError(f"cannot reach etcd at {redact_url(cfg.etcd_url)}: {cause}") from None
        self.events = EventPlane(self.nc, self.namespace)
        self._server = RequestServer(self.nc, self.namespace, self.instance_id, cfg.heartbeat_interval)
        await self._server.start()
        self._requests = RequestClient(self.nc, self.namespace, cfg.ack_timeout, cfg.heartbeat_interval)
        self._requests.suspects = self.unreachable
        self._requests.on_alive = self.alive
        await self._requests.start()
        if cfg.health_port is not None:
            self.health = HealthServer(cfg.health_host, cfg.health_port, self.ready)
            await self.health.start()
        if cfg.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.add_signal_handler(sig, self._on_signal, sig)
        self._opened = True
        log.info("runtime %s connected (namespace %s, pid %d)", self.instance_id, self.namespace, os.getpid())

    def _on_signal(self, sig: signal.Signals) -> None:
        self._signals += 1
        if self._signals == 1:
            log.info("%s received: draining (up to %.0fs)", sig.name, self.config.drain_timeout)
            self.shutdown()
        else:
            log.warning("%s received again: cancelling in-flight requests", sig.name)
            if self._server:
                self._server.stop_accepting()
                asyncio.ensure_future(self._server.drain(0))

    def shutdown(self) -> None:
        """Begin a clean shutdown: stop taking work and let :meth:`wait_for_shutdown` return."""
        if self._shutdown.is_set():
            return
        self._shutdown.set()
        if self._server:
            self._server.stop_accepting()
        if self._registrar:
            # Deregister at once so that routers stop sending here while we drain.
            asyncio.ensure_future(self._registrar.revoke())

    def mark_serving(self) -> None:
        """Count a service this process offers outside the request plane (the frontend's HTTP API)
        as served, for :meth:`ready`."""
        self._served += 1

    def add_health_check(self, check: Callable[[], bool]) -> None:
        """``check()`` must be true for :meth:`ready` (e.g. a worker whose engine keeps failing is not)."""
        self._health_checks.append(check)

    def ready(self) -> bool:
        """True while this process serves at least one endpoint, is connected, is not draining and
        passes its service's health checks."""
        return (self._served > 0 and not self._shutdown.is_set() and self.nc is not None and self.nc.is_connected
                and all(check() for check in self._health_checks))

    def mark_unreachable(self, instance_id: str, records, why: str = "no responders") -> None:
        """Leave ``instance_id`` out of every endpoint client's instances until it shows a sign of life
        (:meth:`alive`: a frame on any of its streams, a load event), its record changes (it registered
        again) or for :data:`UNREACHABLE_HOLD_S` — longer than a dead process's lease usually outlives
        it, short enough that a live one that missed its messages comes back."""
        now = time.monotonic()
        self._watch_signs_of_life()
        for gone in [k for k, (_, until) in self.unreachable.items() if until < now]:
            del self.unreachable[gone]
        record = next((r for r in records if r.instance_id == instance_id), None)
        self.unreachable[instance_id] = (record, now + UNREACHABLE_HOLD_S)
        for snap in self._snapshots.values():  # entries held across an etcd data loss: it is gone for sure
            snap.drop_held(instance_id)
        log.warning("instance %s does not answer (%s): routing around it until it shows a sign of life",
                    instance_id, why)

    def alive(self, instance_id: str) -> None:
        """A sign of life from ``instance_id``: route to it again if it was declared gone."""
        if self.unreachable.pop(instance_id, None) is not None:
            log.info("instance %s shows a sign of life: routing to it again", instance_id)

    def _watch_signs_of_life(self) -> None:
        """Once something was declared gone: take every worker's load event as its sign of life."""
        if self._life_watch is not None or self.events is None:
            return

        def on_load(event: LoadEvent) -> None:
            if event.worker_id in self.unreachable:
                self.alive(event.worker_id)

        self._life_watch = asyncio.ensure_future(self.events.subscribe(TOPIC_LOAD, LoadEvent, on_load))

    def is_unreachable(self, record: InstanceRecord) -> bool:
        mark = self.unreachable.get(record.instance_id)
        if mark is None:
            return False
        marked, until = mark
        if time.monotonic() > until or (marked is not None and marked != record):
            del self.unreachable[record.instance_id]
            return False
        return True

    @property
    def shutting_down(self) -> bool:
        return self._shutdown.is_set()

    async def wait_for_shutdown(self) -> None:
        await self._shutdown.wait()

    async def _close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self.config.handle_signals:
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGTERM, signal.SIGINT):
                loop.remove_signal_handler(sig)
        self._shutdown.set()
        if self._server:
            self._server.stop_accepting()
        if self._registrar:
            await self._registrar.revoke()
        if self._server:
            cancelled = await self._server.drain(self.config.drain_timeout)
            if cancelled:
                log.warning("drain timeout: cancelled %d in-flight requests", cancelled)
            await self._server.close()
        for snap in self._snapshots.values():
            await snap.stop()
        if self._life_watch is not None:
            watch = (await asyncio.gather(self._life_watch, return_exceptions=True))[0]
            if not isinstance(watch, BaseException):
                await watch.close()
        if self._requests:
            await self._requests.close()
        if self.health is not None:
            await self.health.stop()
        if self.nc is not None:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=5)
            except Exception:
                await self.nc.close()
        if self.etcd is not None:
            await self.etcd.close()
        if self._opened:  # a start-up failure is its own one line
            log.info("runtime %s closed", self.instance_id)

    # ------------------------------------------------------------------ serving

    async def serve(
        self,
        component: str,
        endpoint: str,
        handler: Handler,
        request_type: type | None = None,
        *,
        role: str = "",
        model: str = "",
        grpc_address: str = "",
        http_address: str = "",
    ) -> InstanceRecord:
        """Serve ``handler`` (an async generator function of ``(request, ctx)``) and register it.

        The NATS subscription is live before the instance appears in etcd, so nobody is routed
        here before we can answer.
        """
        check_token(component, "component")
        check_token(endpoint, "endpoint")
        subject = await self._server.serve(component, endpoint, handler, request_type)
        return await self.register(component, endpoint, subject=subject, role=role, model=model,
                                   grpc_address=grpc_address, http_address=http_address)

    async def register(self, component: str, endpoint: str, *, subject: str = "", role: str = "", model: str = "",
                       grpc_address: str = "", http_address: str = "") -> InstanceRecord:
        """Register an instance under this process's lease without a NATS handler (``subject`` empty)
        — for a process reached another way, e.g. a draft worker over gRPC (``grpc_address``)."""
        check_token(component, "component")
        check_token(endpoint, "endpoint")
        record = InstanceRecord(
            instance_id=self.instance_id,
            namespace=self.namespace,
            component=component,
            endpoint=endpoint,
            subject=subject,
            host=socket.gethostname(),
            pid=os.getpid(),
            role=role,
            model=model,
            grpc_address=grpc_address,
            http_address=http_address or (self.health.advertised_address if self.health else ""),
            started_at=self.started_at,
            incarnation=self.incarnation,
        )
        await self._registrar.put(instance_key(self.namespace, component, endpoint, self.instance_id), encode(record))
        self._served += 1
        log.info("serving %s.%s.%s as instance %s", self.namespace, component, endpoint, self.instance_id)
        return record

    async def register_model(self, card: ModelCard) -> None:
        """Publish a model card on this process's lease."""
        if not card.instance_id:
            card = msgspec.structs.replace(card, instance_id=self.instance_id)
        await self._registrar.put(model_key(self.namespace, card.name, self.instance_id), encode(card))

    async def unregister_model(self, name: str) -> None:
        """Withdraw this process's card for model ``name`` (an unloaded LoRA adapter)."""
        await self._registrar.delete(model_key(self.namespace, name, self.instance_id))

    async def register_kv_agent(self, record: KvAgentRecord) -> None:
        """Publish this process's NIXL agent (metadata and memory layout) on its lease, for decode
        workers that pull KV from it."""
        await self._registrar.put(kv_agent_key(self.namespace, self.instance_id), encode(record))

    async def kv_agents(self) -> Snapshot[KvAgentRecord]:
        """A live view of the namespace's registered NIXL agents, keyed by etcd key."""
        return await self._snapshot(kv_agents_prefix(self.namespace), KvAgentRecord)

    @property
    def in_flight(self) -> int:
        return self._server.in_flight if self._server else 0

    @property
    def lease_changes(self) -> int:
        return self._registrar.lease_changes if self._registrar else 0

    # ------------------------------------------------------------------ discovery and calls

    async def _snapshot(self, prefix: str, type_: type[T]) -> Snapshot[T]:
        key = (prefix, type_)
        snap = self._snapshots.get(key)
        if snap is None:
            snap = self._snapshots[key] = Snapshot(self.etcd, prefix, type_)
            await snap.start()
        return snap

    async def client(self, component: str, endpoint: str) -> EndpointClient:
        """A client for ``component.endpoint`` with a live view of its instances."""
        snap = await self._snapshot(instances_prefix(self.namespace, component, endpoint), InstanceRecord)
        return EndpointClient(self, component, endpoint, snap)

    async def instances(self) -> Snapshot[InstanceRecord]:
        """A live view of every instance in the namespace."""
        return await self._snapshot(instances_prefix(self.namespace), InstanceRecord)

    async def models(self) -> Snapshot[ModelCard]:
        """A live view of every model card in the namespace (one per serving instance)."""
        return await self._snapshot(models_prefix(self.namespace), ModelCard)

    # ------------------------------------------------------------------ events

    async def publish(self, topic: str, event) -> None:
        await self.events.publish(topic, event)

    async def subscribe(self, topic: str, type_: type[T], callback=None) -> Subscription[T]:
        return await self.events.subscribe(topic, type_, callback)
