"""Request plane over NATS: one request in, a stream of frames out.

Contract:
- A client publishes a :class:`RequestEnvelope` to the instance's own subject
  (``{ns}.{component}.{endpoint}.{instance_id}``) with a reply subject on its inbox.
- The server answers on that reply subject with :class:`Frame`s: ACK first (the handler started),
  then DATA frames numbered from 0 as the handler yields, then exactly one END or ERROR (a stream a
  drain cancels at its timeout ends with a ``shutting_down`` ERROR, so its client resumes elsewhere). While a
  stream is idle the server sends HEARTBEAT frames every half ``heartbeat_interval``.
- The client raises :class:`InstanceTimeout` when no ACK arrives within ``ack_timeout``,
  :class:`InstanceGone` when NATS reports no responders or the stream stalls (no frame for
  ``stall_factor`` heartbeat intervals), and the remote error when an ERROR frame arrives.
- A stream with no frame for half a heartbeat interval is probed: an empty :class:`Cancel` (it
  cancels nothing) is published to the instance's control subject with the stream's reply subject.
  A live instance ignores it; for a dead one (SIGKILLed: its subscriptions left with its connection)
  NATS answers "no responders" at once, and every stream of that instance fails with
  :class:`InstanceGone` in well under a second instead of after the stall timeout. At most one
  probe per instance per watchdog round, however many streams it serves.
- Closing a stream before its end publishes :class:`Cancel` on the instance's control subject;
  the server cancels the handler's task.
- A requester that vanished without a word (SIGKILLed, cut off) is found by the server: every frame
  it sends to a reply subject (ACK, DATA, HEARTBEAT) carries a reply subject of the server's own
  inbox, so once nobody listens on the stream's reply subject NATS answers "no responders" there,
  and the server cancels the handler (freeing its batch slot and KV) within one frame or heartbeat.
  Idle streams get a heartbeat every half interval, so this takes at most about one interval.
- NATS' "no responders" is no verdict while the connection is being re-established: from a
  disconnect until ``blip_grace`` seconds after the reconnect (other processes resubscribe then), a
  request that found nobody is sent again every ``RESEND_INTERVAL`` seconds until it is
  acknowledged or the grace ends, and a probe that found nobody is ignored.
- Every payload is checked against the server's ``max_payload`` before it is published.
- Frames wait in the stream until its reader takes them. A :class:`PendingBytes` shared by the
  streams of one request counts the bytes waiting and tells its owner once they pass a limit (a
  reader that stopped reading); the bytes of a closed stream are released at once.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import msgspec
from nats.aio.client import Client as NATS

from .errors import (
    InstanceGone,
    InstanceTimeout,
    InvalidRequest,
    PayloadTooLarge,
    ShuttingDown,
    TandemError,
    error_from_frame,
    error_to_frame,
)
from .messages import Cancel, Frame, FrameKind, RequestEnvelope, decode, encode
from .names import control_subject, endpoint_subject

log = logging.getLogger(__name__)

T = TypeVar("T")

STALL_FACTOR = 5  # heartbeat intervals without any frame before a stream counts as dead
PROBE_FACTOR = 0.5  # heartbeat intervals without any frame before the instance is probed
BLIP_GRACE_S = 3.0  # after a reconnect, how long "no responders" may mean "not resubscribed yet"
RESEND_INTERVAL = 0.1  # seconds between sends of a request that found nobody during that grace
_NO_RESPONDERS = "503"


@dataclass(frozen=True)
class RequestContext:
    """What a handler knows about the request it serves."""

    request_id: str
    instance_id: str


Handler = Callable[[Any, RequestContext], AsyncIterator[Any]]


def _check_size(data: bytes, max_payload: int) -> None:
    if len(data) > max_payload:
        raise PayloadTooLarge(len(data), max_payload)


class _ActiveStream:
    __slots__ = ("reply_to", "task", "last_sent", "request_id", "token", "liveness", "drained")

    def __init__(self, request_id: str, reply_to: str, liveness_prefix: str = ""):
        self.request_id = request_id
        self.reply_to = reply_to
        self.token = uuid.uuid4().hex[:12]
        self.liveness = f"{liveness_prefix}.{self.token}" if liveness_prefix else ""  # where NATS says "no responders"
        self.task: asyncio.Task | None = None
        self.last_sent = time.monotonic()
        self.drained = False  # cancelled by a drain that timed out: ends with a ShuttingDown error frame


class RequestServer:
    """Serves the endpoints of one process (one instance id) over NATS."""

    def __init__(self, nc: NATS, namespace: str, instance_id: str, heartbeat_interval: float):
        self._nc = nc
        self._ns = namespace
        self.instance_id = instance_id
        self._heartbeat_interval = heartbeat_interval
        self._streams: dict[str, _ActiveStream] = {}
        self._by_token: dict[str, _ActiveStream] = {}
        self._liveness_prefix = ""
        self._blip_until = 0.0  # monotonic: until then "no responders" is no verdict (inf: disconnected)
        self.requesters_gone = 0  # handlers cancelled because nobody listened on their reply subject
        self._subs: list = []
        self._draining = False
        self._heartbeat_task: asyncio.Task | None = None
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._streams)

    async def start(self) -> None:
        sub = await self._nc.subscribe(control_subject(self._ns, self.instance_id), cb=self._on_control)
        self._subs.append(sub)
        self._liveness_prefix = self._nc.new_inbox()
        self._subs.append(await self._nc.subscribe(self._liveness_prefix + ".*", cb=self._on_liveness))
        self._heartbeat_task = asyncio.create_task(self._heartbeats(), name="request-plane-heartbeats")

    async def serve(self, component: str, endpoint: str, handler: Handler, request_type: type | None) -> str:
        """Subscribe ``handler`` on this instance's subject for the endpoint; returns the subject."""
        subject = endpoint_subject(self._ns, component, endpoint, self.instance_id)

        async def on_request(msg) -> None:
            self._accept(msg, handler, request_type)

        self._subs.append(await self._nc.subscribe(subject, cb=on_request))
        await self._nc.flush()
        return subject

    def _accept(self, msg, handler: Handler, request_type: type | None) -> None:
        try:
            env = decode(msg.data, RequestEnvelope)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            log.warning("dropping undecodable request on %s: %s", msg.subject, exc)
            return
        stream = _ActiveStream(env.request_id, env.reply_to, self._liveness_prefix)
        if self._draining:
            asyncio.create_task(self._send_error(stream, ShuttingDown()))
            return
        self._streams[env.request_id] = stream
        self._by_token[stream.token] = stream
        self._idle.clear()
        stream.task = asyncio.create_task(self._run(stream, env, handler, request_type))

    async def _publish(self, stream: _ActiveStream, frame: Frame) -> None:
        data = encode(frame)
        _check_size(data, self._nc.max_payload)
        stream.last_sent = time.monotonic()
        final = frame.kind in (FrameKind.END, FrameKind.ERROR)
        await self._nc.publish(stream.reply_to, data, reply="" if final else stream.liveness)

    async def _send_error(self, stream: _ActiveStream, exc: BaseException) -> None:
        kind, message, field = error_to_frame(exc)
        try:
            await self._publish(stream, Frame(FrameKind.ERROR, error_kind=kind, error_message=message, error_field=field))
        except Exception as send_exc:
            log.warning("request %s: could not send error frame: %r", stream.request_id, send_exc)

    async def _run(self, stream: _ActiveStream, env: RequestEnvelope, handler: Handler, request_type) -> None:
        rid = env.request_id
        agen = None
        try:
            await self._publish(stream, Frame(FrameKind.ACK))
            if request_type is None:
                request = env.payload
            else:
                try:
                    request = decode(env.payload, request_type)
                except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                    raise InvalidRequest(f"malformed {request_type.__name__}: {exc}") from None
            agen = handler(request, RequestContext(rid, self.instance_id))
            seq = 0
            async for item in agen:
                payload = item if isinstance(item, bytes) else encode(item)
                await self._publish(stream, Frame(FrameKind.DATA, seq, payload))
                seq += 1
            await self._publish(stream, Frame(FrameKind.END, seq))
        except asyncio.CancelledError:
            log.info("request %s: cancelled%s", rid, " (drain timed out)" if stream.drained else "")
            if stream.drained:  # tell the client now: it resumes elsewhere instead of waiting for a stall
                await self._send_error(stream, ShuttingDown("drain timed out: resume on another instance"))
        except TandemError as exc:
            log.info("request %s: %s", rid, exc)
            await self._send_error(stream, exc)
        except Exception as exc:
            log.exception("request %s: handler failed", rid)
            await self._send_error(stream, exc)
        finally:
            if agen is not None:
                try:
                    await agen.aclose()
                except BaseException:
                    pass
            self._streams.pop(rid, None)
            self._by_token.pop(stream.token, None)
            if not self._streams:
                self._idle.set()

    async def _on_control(self, msg) -> None:
        try:
            cancel = decode(msg.data, Cancel)
        except (msgspec.DecodeError, msgspec.ValidationError):
            return
        stream = self._streams.get(cancel.request_id)
        if stream is not None and stream.task is not None:
            log.info("request %s: cancel requested by client", cancel.request_id)
            stream.task.cancel()

    def disconnected(self) -> None:
        self._blip_until = float("inf")

    def reconnected(self, grace: float = BLIP_GRACE_S) -> None:
        self._blip_until = time.monotonic() + grace

    async def _on_liveness(self, msg) -> None:
        """NATS found nobody on a stream's reply subject: its requester is gone."""
        if not (msg.headers and msg.headers.get("Status") == _NO_RESPONDERS):
            return
        if time.monotonic() < self._blip_until:  # the requester may not have resubscribed yet
            return
        stream = self._by_token.get(msg.subject[len(self._liveness_prefix) + 1:])
        if stream is None or stream.task is None or stream.task.done():
            return
        self.requesters_gone += 1
        log.info("request %s: its requester is gone (no responders on its reply subject): cancelling",
                 stream.request_id)
        stream.task.cancel()

    async def _heartbeats(self) -> None:
        beat = encode(Frame(FrameKind.HEARTBEAT))
        half = self._heartbeat_interval / 2  # also the liveness check of a requester whose stream is idle
        while True:
            await asyncio.sleep(half / 2)
            now = time.monotonic()
            for stream in list(self._streams.values()):
                if now - stream.last_sent >= half:
                    stream.last_sent = now
                    try:
                        await self._nc.publish(stream.reply_to, beat, reply=stream.liveness)
                    except Exception:
                        pass

    def stop_accepting(self) -> None:
        self._draining = True

    async def drain(self, timeout: float) -> int:
        """Wait up to ``timeout`` for in-flight streams, then cancel the rest, each ending with a
        :class:`ShuttingDown` error frame (its client migrates at once); returns how many were cancelled."""
        self._draining = True
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            pass
        left = []
        for stream in self._streams.values():
            if stream.task is not None:
                stream.drained = True
                stream.task.cancel()
                left.append(stream.task)
        if left:
            await asyncio.gather(*left, return_exceptions=True)
        return len(left)

    async def close(self) -> None:
        if self._heartbeat_task:
            self._heartbeat_task.cancel()
            await asyncio.gather(self._heartbeat_task, return_exceptions=True)
        for sub in self._subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        self._subs.clear()


class PendingBytes:
    """Bytes of response frames received for one request and not yet read, over all its streams.

    ``on_exceeded`` callbacks run once, synchronously, when the count first passes ``limit``.
    """

    def __init__(self, limit: int):
        self.limit = limit
        self.value = 0
        self.peak = 0
        self.exceeded = False
        self._callbacks: list[Callable[[], None]] = []

    def on_exceeded(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` when the limit is passed (at once if it already was)."""
        if self.exceeded:
            callback()
        else:
            self._callbacks.append(callback)

    def add(self, size: int) -> None:
        self.value += size
        if self.value > self.peak:
            self.peak = self.value
            if self.peak > self.limit and not self.exceeded:
                self.exceeded = True
                for callback in self._callbacks:
                    callback()
                self._callbacks.clear()

    def release(self, size: int) -> None:
        self.value -= size


class ResponseStream(Generic[T]):
    """An async iterator over one request's response items.

    Use ``async with`` (or call :meth:`aclose`) so that leaving early cancels the remote handler.
    """

    def __init__(self, client: RequestClient, token: str, instance_id: str, request_id: str, response_type,
                 pending: PendingBytes | None = None, resend: tuple[str, bytes, str] | None = None):
        self._client = client
        self._resend = resend  # (subject, data, reply): the request as sent, should NATS lose it in a blip
        self._token = token
        self.instance_id = instance_id
        self.request_id = request_id
        self._type = response_type
        self._queue: asyncio.Queue = asyncio.Queue()  # (frame or exception, its size in bytes)
        self._pending = pending
        self._queued_bytes = 0
        self._acked = False
        self._done = False
        self._next_seq = 0
        self.last_frame = time.monotonic()
        self._sent_at = self.last_frame
        self._probed_at = 0.0

    def _push(self, item, size: int = 0) -> None:
        self.last_frame = time.monotonic()
        self._put(item, size)

    def _put(self, item, size: int = 0) -> None:
        self._queue.put_nowait((item, size))
        if size and self._pending is not None:
            self._queued_bytes += size
            self._pending.add(size)

    def __aiter__(self) -> ResponseStream[T]:
        return self

    async def __anext__(self) -> T:
        while True:
            if self._done:
                raise StopAsyncIteration
            item, size = await self._queue.get()
            if size and self._pending is not None:
                self._queued_bytes -= size
                self._pending.release(size)
            if isinstance(item, BaseException):
                self._finish()
                raise item
            frame: Frame = item
            kind = frame.kind
            if kind == FrameKind.DATA:
                self._acked = True
                if frame.seq != self._next_seq:
                    self._finish()
                    raise InstanceGone(self.instance_id, f"frame {self._next_seq} lost (got {frame.seq})")
                self._next_seq += 1
                return frame.payload if self._type is None else decode(frame.payload, self._type)
            if kind == FrameKind.END:
                self._finish()
                if frame.seq != self._next_seq:
                    raise InstanceGone(self.instance_id, f"stream ended after {frame.seq} frames, got {self._next_seq}")
                raise StopAsyncIteration
            if kind == FrameKind.ERROR:
                self._finish()
                raise error_from_frame(frame.error_kind, frame.error_message, frame.error_field)
            self._acked = True  # ACK or HEARTBEAT

    def _check_stall(self, now: float, ack_timeout: float, stall_timeout: float) -> None:
        if self._done:
            return
        if not self._acked:
            if now - self._sent_at > ack_timeout:
                self._put(InstanceTimeout(self.instance_id, ack_timeout))
                self._done_pending()
        elif now - self.last_frame > stall_timeout:
            self._put(InstanceGone(self.instance_id, f"stream stalled: no frame for {now - self.last_frame:.1f}s",
                                   stalled=not self._client.in_blip()))
            self._done_pending()

    def _needs_probe(self, now: float, probe_after: float) -> bool:
        """Acknowledged, silent for ``probe_after`` seconds, and not probed in that time."""
        if self._done or not self._acked:
            return False
        if now - self.last_frame <= probe_after or now - self._probed_at <= probe_after:
            return False
        self._probed_at = now
        return True

    def _done_pending(self) -> None:
        self._client._streams.pop(self._token, None)

    def _finish(self) -> None:
        self._done = True
        self._client._streams.pop(self._token, None)
        if self._queued_bytes:  # nobody will read these frames now: free them
            self._pending.release(self._queued_bytes)
            self._queued_bytes = 0
            while not self._queue.empty():
                self._queue.get_nowait()

    @property
    def finished(self) -> bool:
        return self._done

    async def aclose(self) -> None:
        """Stop listening; if the stream had not ended, ask the instance to cancel the handler."""
        if self._done:
            return
        self._finish()
        await self._client._send_cancel(self.instance_id, self.request_id)

    async def __aenter__(self) -> ResponseStream[T]:
        return self

    async def __aexit__(self, *exc) -> None:
        await self.aclose()


class RequestClient:
    """Sends requests to instances and demultiplexes their frames from one inbox subscription."""

    def __init__(self, nc: NATS, namespace: str, ack_timeout: float, heartbeat_interval: float,
                 blip_grace: float = BLIP_GRACE_S):
        self._nc = nc
        self._blip_grace = blip_grace
        self._blip_until = 0.0  # monotonic: until then "no responders" is no verdict (inf: disconnected)
        self._ns = namespace
        self._ack_timeout = ack_timeout
        self._stall_timeout = heartbeat_interval * STALL_FACTOR
        self._probe_after = heartbeat_interval * PROBE_FACTOR
        self._probe = encode(Cancel(""))
        self._streams: dict[str, ResponseStream] = {}
        self._prefix = ""
        self._sub = None
        self._watchdog: asyncio.Task | None = None
        self._frame_decoder = msgspec.msgpack.Decoder(Frame)
        self._resends: set[asyncio.Task] = set()
        # instances declared gone (id -> anything), and what to call when one of them sends a frame
        self.suspects: dict = {}
        self.on_alive: Callable[[str], None] | None = None

    async def start(self) -> None:
        self._prefix = self._nc.new_inbox()
        self._sub = await self._nc.subscribe(self._prefix + ".*", cb=self._on_frame, pending_msgs_limit=-1, pending_bytes_limit=-1)
        self._watchdog = asyncio.create_task(self._watch_stalls(), name="request-plane-watchdog")

    async def close(self) -> None:
        if self._watchdog:
            self._watchdog.cancel()
            await asyncio.gather(self._watchdog, return_exceptions=True)
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:
                pass

    def disconnected(self) -> None:
        """The NATS connection dropped: "no responders" means nothing until it is back."""
        self._blip_until = float("inf")

    def reconnected(self) -> None:
        """The connection is back; the other processes may take ``blip_grace`` seconds to resubscribe."""
        self._blip_until = time.monotonic() + self._blip_grace

    def in_blip(self) -> bool:
        """True while NATS' "no responders" may only mean that subscriptions are being re-established."""
        return time.monotonic() < self._blip_until

    async def _resend_later(self, stream: ResponseStream) -> None:
        await asyncio.sleep(RESEND_INTERVAL)
        if stream._done or stream._acked or stream._token not in self._streams:
            return
        subject, data, reply = stream._resend
        stream._sent_at = time.monotonic()  # the acknowledgement timeout counts from this send
        try:
            await self._nc.publish(subject, data, reply=reply)
        except Exception as exc:
            log.debug("request %s: resend failed: %r", stream.request_id, exc)

    async def _on_frame(self, msg) -> None:
        stream = self._streams.get(msg.subject[len(self._prefix) + 1 :])
        if stream is None:
            return
        if msg.headers and msg.headers.get("Status") == _NO_RESPONDERS:
            if self.in_blip():
                if not stream._acked and stream._resend is not None:
                    log.info("request %s: no responders on %s while NATS reconnects: sending again",
                             stream.request_id, stream.instance_id)
                    task = asyncio.ensure_future(self._resend_later(stream))
                    self._resends.add(task)
                    task.add_done_callback(self._resends.discard)
                return  # a probe: the stall timeout still catches an instance that is really gone
            if not stream._acked:  # the request itself found nobody
                stream._push(InstanceGone(stream.instance_id, "no responders on its subject", unreachable=True))
                stream._done_pending()
                return
            # a probe found nobody: the instance is gone, and with it every stream it was serving
            for other in [s for s in self._streams.values() if s.instance_id == stream.instance_id and s._acked]:
                other._push(InstanceGone(other.instance_id, "no responders to a probe mid-stream", unreachable=True))
                other._done_pending()
            return
        stream._resend = None  # it answered: the request need not be kept for a resend
        if self.suspects and stream.instance_id in self.suspects and self.on_alive is not None:
            self.on_alive(stream.instance_id)
        try:
            stream._push(self._frame_decoder.decode(msg.data), len(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            stream._push(InstanceGone(stream.instance_id, f"undecodable frame: {exc}"))

    async def call(
        self,
        component: str,
        endpoint: str,
        instance_id: str,
        request: Any,
        response_type: type[T] | None = None,
        request_id: str | None = None,
        pending: PendingBytes | None = None,
    ) -> ResponseStream[T]:
        """Send ``request`` (a Struct or bytes) to one instance; returns its response stream, whose
        unread frames ``pending`` counts.

        Raises :class:`PayloadTooLarge` before sending when the request does not fit.
        """
        request_id = request_id or uuid.uuid4().hex
        token = uuid.uuid4().hex[:12]
        reply_to = f"{self._prefix}.{token}"
        payload = request if isinstance(request, bytes) else encode(request)
        data = encode(RequestEnvelope(request_id, payload, reply_to))
        _check_size(data, self._nc.max_payload)
        subject = endpoint_subject(self._ns, component, endpoint, instance_id)
        stream: ResponseStream[T] = ResponseStream(self, token, instance_id, request_id, response_type, pending,
                                                   (subject, data, reply_to))
        self._streams[token] = stream
        try:
            await self._nc.publish(subject, data, reply=reply_to, headers=None)
        except Exception:
            self._streams.pop(token, None)
            raise
        return stream

    async def _send_cancel(self, instance_id: str, request_id: str) -> None:
        try:
            await self._nc.publish(control_subject(self._ns, instance_id), encode(Cancel(request_id)))
        except Exception as exc:
            log.warning("request %s: could not send cancel to %s: %r", request_id, instance_id, exc)

    async def _watch_stalls(self) -> None:
        period = min(0.25, self._probe_after / 2)
        while True:
            await asyncio.sleep(period)
            now = time.monotonic()
            probed: set[str] = set()  # one probe per instance per round, however many streams it serves
            for stream in list(self._streams.values()):
                stream._check_stall(now, self._ack_timeout, self._stall_timeout)
                if stream.instance_id not in probed and stream._needs_probe(now, self._probe_after):
                    probed.add(stream.instance_id)
                    try:  # the answer, if any, is NATS's "no responders" on the stream's own reply subject
                        await self._nc.publish(control_subject(self._ns, stream.instance_id), self._probe,
                                               reply=f"{self._prefix}.{stream._token}")
                    except Exception as exc:
                        log.debug("probe of %s failed: %r", stream.instance_id, exc)


async def collect(stream: ResponseStream[T]) -> list[T]:
    """All items of a stream, closing it on error."""
    async with stream:
        return [item async for item in stream]

