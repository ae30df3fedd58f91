"""How a worker process threads torch's CPU work: where its idle intra-op threads wait, and on
which thread its torch work runs.

Torch's Linux wheels run intra-op work on GNU OpenMP. After a parallel region its worker threads
wait for the next one, spinning or asleep, as the process said before torch loaded:

- spinning long (GNU OpenMP's default, 300,000 spins) made small steps up to 70× slower on a
  shared or oversubscribed machine;
- never spinning (``OMP_WAIT_POLICY=PASSIVE``) makes every parallel region wait about 70 µs for
  its workers to wake. A step of a small model runs tens of regions: the tiny target's verify step
  took about 3 ms instead of 1.4.

So a target's workers spin 10,000 times (well under a millisecond), then sleep.

Each thread that starts intra-op work gets its own OpenMP team. Two teams on the machine's cores
count as oversubscribed, and GNU OpenMP then stops spinning whatever it was told, so a worker does
all its torch work on one thread (:func:`torch_thread`), the model's loading included.

Measured on the 2-core VM, the tiny target served through ``tandem up``:
- plain decoding: 322 tok/s before, 434–528 after;
- forced n-gram speculation: 0.95–0.97× of plain before, 1.03–1.05× after, in an alternating A/B
  (0.98–1.07× over nine runs after, mean 1.03×).
See docs/benchmarks.md.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

SPIN_COUNT = 10_000


def configure_waiting(spin: bool = True) -> None:
    """Before torch loads: GNU OpenMP's workers spin ``SPIN_COUNT`` times, then sleep (its
    ``GOMP_SPINCOUNT`` takes precedence over ``OMP_WAIT_POLICY``); other OpenMP runtimes, and every
    runtime when not ``spin``, sleep at once (``PASSIVE``). Either variable set by the user wins.

    A draft worker does not spin: its CPU drafting showed no gain from it (the tiny target's random
    EAGLE-3 head, 2.76 against 3.04 ms a call, one run each), and its spinning threads took 0.77
    against 0.59 ms of CPU a step from the cores it shares with its target."""
    if "OMP_WAIT_POLICY" not in os.environ and "GOMP_SPINCOUNT" not in os.environ:
        os.environ["OMP_WAIT_POLICY"] = "PASSIVE"
        if spin:
            os.environ["GOMP_SPINCOUNT"] = str(SPIN_COUNT)


def torch_thread(name: str) -> ThreadPoolExecutor:
    """The one thread that runs a worker's torch work: load the model there
    (``loop.run_in_executor``) and run every step or proposal there."""
    return ThreadPoolExecutor(1, thread_name_prefix=name)
