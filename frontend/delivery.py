"""Whether a streaming client takes the bytes sent to it, read from its TCP connection.

A write that returns says only that the bytes left the application: a reply small enough for the
socket buffers (ours, the client's, and asyncio's write buffer) is written in full whether or not
the client reads, so a write timeout alone never fires for it. The kernel knows better: bytes still
queued towards the client (asyncio's buffer plus the socket's send queue, ``SIOCOUTQ``) and bytes the
client's TCP acknowledged (``tcpi_bytes_acked`` in ``TCP_INFO``, Linux 4.2+). A client whose receive
window is shut acknowledges nothing new while bytes wait for it; one that reads, however slowly,
keeps acknowledging. Where the whole reply fits in the client's own receive buffer it has the reply
and nothing is lost by finishing it. Elsewhere (no socket, another OS) :meth:`Delivery.check`
answers ``None`` and only the write timeout applies.
"""

from __future__ import annotations

import fcntl
import socket
import struct
import termios

_BYTES_ACKED = 120  # offset of tcpi_bytes_acked (u64) in Linux's struct tcp_info


class Delivery:
    """Samples one connection: :meth:`stalled_for` says how long bytes have waited for a client that
    acknowledged none of them."""

    def __init__(self, transport):
        self._transport = transport
        self._acked: int | None = None
        self._since: float | None = None

    def check(self) -> tuple[int, int] | None:
        """(bytes waiting to reach the client, bytes it acknowledged so far), or None when unknown."""
        sock = self._transport.get_extra_info("socket")
        if sock is None or self._transport.is_closing():
            return None
        try:
            fd = sock.fileno()
            queued = struct.unpack("i", fcntl.ioctl(fd, termios.TIOCOUTQ, b"\0\0\0\0"))[0]
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
        except (OSError, AttributeError, ValueError):
            return None
        if len(info) < _BYTES_ACKED + 8:
            return None
        [acked] = struct.unpack_from("Q", info, _BYTES_ACKED)
        return self._transport.get_write_buffer_size() + queued, acked

    def stalled_for(self, now: float) -> float | None:
        """Seconds that bytes have waited while the client acknowledged nothing (0 while it takes
        them or nothing waits); None when the connection cannot tell."""
        state = self.check()
        if state is None:
            return None
        waiting, acked = state
        if waiting == 0 or acked != self._acked or self._since is None:
            self._acked, self._since = acked, now
            return 0.0
        return now - self._since
