"""The calling end of the request plane: requests out, frames demultiplexed from one inbox into
:class:`ResponseStream`s, stalled streams probed and failed (the contract: :mod:`runtime.request_plane`)."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import msgspec
from nats.aio.client import Client as NATS

from ..errors import InstanceGone, InstanceTimeout, error_from_frame
from ..messages import Cancel, Frame, FrameKind, RequestEnvelope, decode, encode
from ..names import control_subject, endpoint_subject
from .wire import BLIP_GRACE_S, NO_RESPONDERS, PROBE_FACTOR, RESEND_INTERVAL, STALL_FACTOR, Blip, check_size

log = logging.getLogger(__name__)

T = TypeVar("T")


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
        self._first_sent_at = self.last_frame  # resends in a blip never push the acknowledgement past a bound
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
            # from the latest send (a resend in a NATS blip restarts it), but never longer than the blip
            # grace and two acknowledgement timeouts from the first: a blip that never ends is no excuse
            if (now - self._sent_at > ack_timeout
                    or now - self._first_sent_at > 2 * ack_timeout + self._client._blip_grace):
                self._put(InstanceTimeout(self.instance_id, ack_timeout))
                self._done_pending()
        elif now - self.last_frame > stall_timeout:
            self._put(InstanceGone(self.instance_id, f"stream stalled: no frame for {now - self.last_frame:.1f}s",
                                   stalled=not self._client.in_blip()))
            self._done_pending()

    def _needs_probe(self, now: float, probe_after: float) -> bool:
        """Silent for ``probe_after`` seconds (acknowledged or not: a request sent as its instance
        died is never acknowledged, and the probe's "no responders" says so long before the
        acknowledgement timeout), and not probed in that time."""
        if self._done:
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
        self.blip = Blip()  # while NATS reconnects, "no responders" is no verdict
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
        self.blip.disconnected()

    def reconnected(self) -> None:
        """The connection is back; the other processes may take ``blip_grace`` seconds to resubscribe."""
        self.blip.reconnected(self._blip_grace)

    def in_blip(self) -> bool:
        """True while NATS' "no responders" may only mean that subscriptions are being re-established."""
        return self.blip.active()

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
        if msg.headers and msg.headers.get("Status") == NO_RESPONDERS:
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
            # a probe found nobody: the instance is gone, and with it every stream it was serving and
            # every request still waiting for its acknowledgement (re-sent now, not at the ack timeout)
            self.fail_instance(stream.instance_id, "no responders to a probe mid-stream")
            return
        stream._resend = None  # it answered: the request need not be kept for a resend
        if self.suspects and stream.instance_id in self.suspects and self.on_alive is not None:
            self.on_alive(stream.instance_id)
        try:
            stream._push(self._frame_decoder.decode(msg.data), len(msg.data))
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            stream._push(InstanceGone(stream.instance_id, f"undecodable frame: {exc}"))

    def fail_instance(self, instance_id: str, why: str) -> int:
        """The instance is known gone: end each of its streams, acknowledged or not, with
        ``InstanceGone`` now (their callers move them elsewhere); returns how many."""
        streams = [s for s in self._streams.values() if s.instance_id == instance_id and not s._done]
        for s in streams:
            s._push(InstanceGone(instance_id, why, unreachable=True))
            s._done_pending()
        return len(streams)

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
        check_size(data, self._nc.max_payload)
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
