"""The draft stream's fast lane: its messages over a Unix-domain socket when target and draft share a host.

A target steps every millisecond or two and each step sends the draft one message and reads its
proposals back. Through gRPC's asyncio API that costs about 130 µs of the event loop's CPU per
message sent and as much again across its threads per message read (measured on the 2-core VM;
several wake-ups of its poller thread and of the loop per message), which on a fast target is a
large share of a step. The same bytes written to a Unix-domain socket from the event loop cost one
system call each way.

The gRPC stream stays the pair's control channel: the handshake (Hello/HelloAck) runs on it and
agrees on a lane, and it stays open for the pair's lifetime (either side closing one ends both).
The draft listens on one socket for all its targets, in a directory only its user can enter; each
stream gets a random token in its HelloAck, which the target sends as the lane's first frame, so a
connection binds to exactly one stream and no other process can take it over. From then on every
message of the stream travels as a frame: a 4-byte little-endian length and the serialized
protobuf. A target that cannot reach the socket (the draft runs on another host or in another
container) keeps everything on gRPC: the lane is an optimization, never a requirement.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

UNIX = "unix"
HEADER = struct.Struct("<I")
MAX_FRAME = 1 << 30  # a longer length is a corrupt stream, not a message (gRPC's own limit is 64 MiB)
TOKEN_BYTES = 16
CONNECT_TIMEOUT = 1.0
DIR_PREFIX = "tandem-lane-"
SOCKET_NAME = "draft.sock"
STALE_AFTER = 60.0  # seconds: a lane directory this old whose socket takes no connection is a dead worker's


def available() -> bool:
    """Whether this platform has Unix-domain sockets."""
    return hasattr(socket, "AF_UNIX")


def sweep_stale(parent: str | None = None, *, older_than: float = STALE_AFTER) -> list[str]:
    """Remove the lane directories that draft workers killed without a clean stop left in ``parent``
    (the temporary directory): this user's, older than ``older_than`` seconds, whose socket is gone
    or takes no connection (a live worker's always does). Returns the paths removed."""
    parent = parent or tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(parent) if n.startswith(DIR_PREFIX)]
    except OSError:
        return []
    removed, now = [], time.time()
    for name in names:
        path = os.path.join(parent, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or now - st.st_mtime < older_than:
            continue  # another user's, not a directory, or one a worker may still be setting up
        if _listening(os.path.join(path, SOCKET_NAME)):
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _listening(address: str) -> bool:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(CONNECT_TIMEOUT)
        try:
            sock.connect(address)
        except OSError:  # no such file, refused: nobody listens there
            return False
    return True


class LaneProtocol(asyncio.Protocol):
    """One lane connection: frames in (``on_frame(bytes)``, in order), frames out (:meth:`send`), and
    ``on_lost(reason)`` once when the connection ends or a frame is malformed."""

    def __init__(self, on_frame: Callable[[bytes], None] | None = None,
                 on_lost: Callable[[str], None] | None = None):
        self.on_frame = on_frame
        self.on_lost = on_lost
        self.transport: asyncio.Transport | None = None
        self._buf = bytearray()
        self.closed = False
        self.bytes_sent = 0
        self.bytes_received = 0

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.bytes_received += len(data)
        buf = self._buf
        buf += data
        start = 0
        while len(buf) - start >= HEADER.size:
            (n,) = HEADER.unpack_from(buf, start)
            if n > MAX_FRAME:
                self._lose(f"frame of {n} bytes")
                return
            if len(buf) - start - HEADER.size < n:
                break
            frame = bytes(buf[start + HEADER.size : start + HEADER.size + n])
            start += HEADER.size + n
            try:
                self.on_frame(frame)
            except Exception as exc:  # a malformed message: end the lane (and with it the stream)
                log.warning("fast lane: bad frame: %r", exc)
                self._lose(f"bad frame: {exc!r}")
                return
            if self.closed:
                return
        if start:
            del buf[:start]

    def send(self, payload: bytes) -> None:
        if self.closed or self.transport is None:
            raise ConnectionError("fast lane closed")
        self.transport.writelines((HEADER.pack(len(payload)), payload))
        self.bytes_sent += HEADER.size + len(payload)

    def connection_lost(self, exc) -> None:
        self._lose(f"connection lost ({exc!r})" if exc else "closed by the other side")

    def _lose(self, reason: str) -> None:
        if self.closed:
            return
        self.closed = True
        if self.transport is not None:
            self.transport.close()
        if self.on_lost is not None:
            self.on_lost(reason)

    def close(self) -> None:
        """Close from this side (``on_lost`` is not called)."""
        self.on_lost = None
        self._lose("closed")


class LaneServer:
    """The draft worker's listening socket: binds each incoming connection to the stream whose token
    it presents first (:meth:`expect`), then hands it that stream's frames."""

    def __init__(self):
        self.address = ""
        self._dir = ""
        self._server: asyncio.AbstractServer | None = None
        self._expected: dict[bytes, Callable[[LaneProtocol], Callable[[bytes], None]]] = {}

    async def start(self) -> bool:
        """Listen; False (and no lane offered) where Unix sockets are missing or the bind fails."""
        if not available():
            return False
        for path in sweep_stale():
            log.info("removed %s, a lane directory a draft worker left when it was killed", path)
        try:
            self._dir = tempfile.mkdtemp(prefix=DIR_PREFIX)  # mode 0700: only this user connects
            self.address = os.path.join(self._dir, SOCKET_NAME)
            self._server = await asyncio.get_running_loop().create_unix_server(self._accept, self.address)
        except OSError as exc:
            log.warning("no fast lane (Unix socket): %r; streams keep to gRPC", exc)
            await self.close()
            return False
        return True

    def expect(self, bind: Callable[[LaneProtocol], Callable[[bytes], None]]) -> bytes:
        """A fresh token; a connection that presents it is passed to ``bind``, which returns the
        function that takes the lane's further frames."""
        token = secrets.token_bytes(TOKEN_BYTES)
        self._expected[token] = bind
        return token

    def forget(self, token: bytes) -> None:
        self._expected.pop(token, None)

    def _accept(self) -> LaneProtocol:
        proto = LaneProtocol()

        def first(frame: bytes) -> None:
            bind = self._expected.pop(frame, None)
            if bind is None:
                raise ValueError("unknown lane token")
            proto.on_frame = bind(proto)

        proto.on_frame = first
        return proto

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None
        if self._dir:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = ""
        self._expected.clear()


async def connect(address: str, token: bytes, on_frame: Callable[[bytes], None], on_lost: Callable[[str], None],
                  timeout: float = CONNECT_TIMEOUT) -> LaneProtocol:
    """Open the lane at ``address`` and bind it with ``token``; raises OSError (or TimeoutError) when
    the socket is out of reach."""
    loop = asyncio.get_running_loop()
    _, proto = await asyncio.wait_for(
        loop.create_unix_connection(lambda: LaneProtocol(on_frame, on_lost), address), timeout)
    proto.send(token)
    return proto
