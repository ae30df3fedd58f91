"""The serving end of the request plane: one process's endpoints over NATS (the contract:
:mod:`runtime.request_plane`). Answers each request with ACK, DATA, then END or ERROR; heartbeats idle
streams; cancels a handler on the client's Cancel, on a requester that is gone, or at a drain's end."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from nats.aio.client import Client as NATS

from ..errors import InvalidRequest, ShuttingDown, TandemError, error_to_frame
from ..messages import Cancel, Frame, FrameKind, RequestEnvelope, decode, encode
from ..names import control_subject, endpoint_subject
from .wire import BLIP_GRACE_S, NO_RESPONDERS, Blip, check_size

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class RequestContext:
    """What a handler knows about the request it serves."""

    request_id: str
    instance_id: str


Handler = Callable[[Any, RequestContext], AsyncIterator[Any]]


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
        self.blip = Blip()  # while NATS reconnects, "no responders" is no verdict
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
        check_size(data, self._nc.max_payload)
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
        self.blip.disconnected()

    def reconnected(self, grace: float = BLIP_GRACE_S) -> None:
        self.blip.reconnected(grace)

    async def _on_liveness(self, msg) -> None:
        """NATS found nobody on a stream's reply subject: its requester is gone."""
        if not (msg.headers and msg.headers.get("Status") == NO_RESPONDERS):
            return
        if self.blip.active():  # the requester may not have resubscribed yet
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
