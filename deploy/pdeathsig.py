"""``python -m deploy.pdeathsig PARENT_PID COMMAND [ARGS...]``: run COMMAND so that it gets SIGTERM
when PARENT_PID, its parent, dies (Linux ``PR_SET_PDEATHSIG``, which survives ``exec``).

Launchers start their children through this rather than setting the signal in a ``preexec_fn``: a
``preexec_fn`` makes ``subprocess`` fork the launcher, and forking a process whose gRPC threads run
(the launcher's ``launcher.scale`` service talks to etcd) let gRPC restart its poller in the child,
which then aborted when the child closed its file descriptors before ``exec``. Without one,
``subprocess`` uses ``vfork``, which runs no fork handlers.

The same guarantee for processes that import the runtime anyway is :func:`runtime.lifetime.die_with_parent`;
this trampoline keeps its own five lines because it runs before every child of every launcher and
importing the ``runtime`` package costs 0.4 s.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> None:
    parent, command = int(argv[0]), argv[1:]
    if sys.platform == "linux":
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before the signal was set: nobody would send it
            sys.exit(1)
    os.execvp(command[0], command)


if __name__ == "__main__":
    main(sys.argv[1:])
