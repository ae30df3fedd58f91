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

from .client import PendingBytes, RequestClient, ResponseStream, collect
from .server import Handler, RequestContext, RequestServer
from .wire import BLIP_GRACE_S, PROBE_FACTOR, RESEND_INTERVAL, STALL_FACTOR

__all__ = ["BLIP_GRACE_S", "PROBE_FACTOR", "RESEND_INTERVAL", "STALL_FACTOR", "Handler", "PendingBytes",
           "RequestClient", "RequestContext", "RequestServer", "ResponseStream", "collect"]
