"""A child process that must not outlive its parent: Linux ``PR_SET_PDEATHSIG``, once, here.

The launcher's children (through ``python -m deploy.pdeathsig``), tensor-parallel followers and the
frontend's render process all need the same guarantee: when the process that started them dies,
however it dies (SIGKILL included), the kernel signals them. The signal is set in the child, so
there is a race: the parent may die before it is set; the child then sees that its parent is no
longer the one it was started by and leaves at once. Comparing with the parent's pid (not with 1)
keeps that right under a subreaper such as tini, where an orphan's new parent is not init.

Note: the kernel sends the signal when the *thread* that created the child exits. Start such
children from a thread that lives as long as the parent (the main thread, or the event loop's).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def die_with_parent(parent_pid: int, sig: int = signal.SIGKILL) -> bool:
    """Have the kernel send ``sig`` to this process when its parent dies; exit at once (status 1)
    if ``parent_pid`` is no longer the parent. Returns False where the platform cannot do it
    (not Linux, or no usable libc): the caller then lives on without the guarantee."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_PDEATHSIG, int(sig))
    except (OSError, AttributeError):
        return False
    if os.getppid() != parent_pid:  # the parent died before the signal was set: nobody would send it
        os._exit(1)
    return True
