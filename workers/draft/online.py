"""Online distillation: an EAGLE-3 draft head that learns the traffic it serves (``--online-distill``).

Every proposal request and verdict already brings the draft worker the target's hidden states for
the committed tokens and the tokens the target chose: exactly what :mod:`.train.ttt` trains on, on
the real traffic. Three parts, each bounded:

- **Recorder** (in the serving process, on the proposer's thread): per greedy sequence, the hidden
  rows as they arrive (float16, three layers concatenated); when the target releases the sequence
  the finished sample (tokens, hidden rows, reply mask: everything after the prompt) is offered to
  the trainer. Sampled requests are not recorded (their tokens are draws, not the target's argmax,
  which is what the head learns). Offering never blocks: a full queue drops the sample.
- **Trainer** (:mod:`.train.online_trainer`, a separate process, so that a crash, a NaN or a slow step never touches serving; on
  a CPU it runs at a lower priority with ``threads`` torch threads): a buffer of recent samples
  bounded by ``buffer_tokens`` (oldest dropped first; one sample in ``holdout_every`` is held back for
  evaluation, bounded by ``eval_tokens``), training-time-test steps as ``tandem train-draft`` takes
  them (same loss, AdamW), throttled to ``share`` of its time: after a step of t seconds it sleeps
  t · (1 / share − 1). The head's ``fc`` (target hidden states → features) stays frozen, so the
  features a live sequence already holds stay valid across a swap. Every ``eval_every`` steps the
  candidate and the serving weights are scored on the held-back samples (teacher-forced greedy
  acceptance length at γ = ``steps``); the candidate replaces them only when it accepts at least
  ``min_gain`` more. A non-finite loss puts the candidate back to the serving weights.
- **Swap** (:meth:`workers.draft.eagle_proposer.EagleProposer.load_weights`): the new weights go
  through the draft service's work queue, so they land between two proposal batches, never during
  one; live sequences drop their drafted tails and recompute the head's KV on their next proposal.
  Proposals are checked by the target like any draft's, so a swap can change acceptance, never
  output.

Checkpoints: with ``out_dir`` every accepted candidate is written there in the ``speculators``
layout (``vNNNNN/``, and ``LATEST`` naming the newest, both replaced atomically). Any draft worker
loads such a head with ``--eagle-model DIR/vNNNNN``, and ``--distill-config '{"follow": "DIR"}'`` makes a draft
worker take each new one as it appears: one trainer, many readers.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from runtime.backoff import backoff_delay

from .train.online_trainer import DistillConfig, trainable_state, trainer_main

__all__ = ["DistillConfig", "DistillStats", "Distiller", "Follower", "Recorder", "trainable_state"]

log = logging.getLogger(__name__)


@dataclass
class DistillStats:
    """What online distillation did (the draft worker's metrics read these)."""

    samples_offered: int = 0
    samples_dropped: int = 0  # the trainer's queue was full
    train_steps: int = 0
    train_seconds: float = 0.0  # the trainer's compute time (steps and evaluations)
    trainer_seconds: float = 0.0  # the trainer's wall time alive (share = train_seconds / this)
    buffer_tokens: int = 0
    swaps: int = 0
    rejected: int = 0  # candidates that did not accept more
    nonfinite: int = 0  # steps whose loss was NaN/inf (candidate reset)
    failures: int = 0  # trainer processes that died or raised
    last_loss: float = float("nan")
    serving_acceptance: float = float("nan")  # the serving weights' held-back acceptance length
    candidate_acceptance: float = float("nan")
    version: int = 0  # accepted candidates so far


# ---------------------------------------------------------------------------- recording (serving side)


@dataclass
class _Recording:
    prompt: int  # tokens of the prompt: the reply starts after them
    chunks: list[torch.Tensor] = field(default_factory=list)  # hidden rows [n, 3H], positions 0 .. covered-1
    covered: int = 0
    broken: bool = False


class Recorder:
    """Hidden rows of greedy sequences as they arrive; a finished sequence becomes a sample."""

    def __init__(self, sink: Callable[[dict], None], min_reply: int = 4):
        self.sink = sink
        self.min_reply = min_reply
        self._recs: dict[str, _Recording] = {}

    def rows(self, seq_id: str, start: int, hidden: list[torch.Tensor], rows: int, new_tokens: int,
             greedy: bool) -> None:
        """Target hidden rows for positions start .. start+rows-1 of ``seq_id`` (``new_tokens``: the
        tokens that came with them; on a sequence's first message, its prompt and first token)."""
        if not greedy or rows <= 0 or len(hidden) == 0:
            self._recs.pop(seq_id, None)
            return
        rec = self._recs.get(seq_id)
        if start == 0:  # first sight, or the target re-sent the sequence from scratch
            rec = self._recs[seq_id] = _Recording(prompt=max(new_tokens - 1, 0))
        if rec is None or rec.broken:
            return
        if start > rec.covered:  # a gap (rows never sent): keep what is contiguous
            rec.broken = True
            return
        block = torch.cat([h.reshape(rows, -1) for h in hidden], dim=-1).to(torch.float16)
        block = block[rec.covered - start :]
        if block.shape[0]:
            rec.chunks.append(block)
            rec.covered += block.shape[0]

    def finish(self, seq_id: str, tokens: list[int]) -> None:
        """The sequence ended with committed ``tokens``: offer its sample."""
        rec = self._recs.pop(seq_id, None)
        if rec is None or not rec.chunks:
            return
        length = min(len(tokens), rec.covered + 1)  # chains read the rows of positions 0 .. length-2
        if length - rec.prompt < self.min_reply:
            return
        hidden = torch.cat(rec.chunks)[: length - 1]
        hidden = torch.cat([hidden, hidden.new_zeros(1, hidden.shape[1])])  # position length-1: read by no chain
        mask = torch.arange(length) >= rec.prompt
        self.sink({"tokens": torch.tensor(tokens[:length], dtype=torch.long), "hidden": hidden, "mask": mask})

    def drop(self, seq_id: str) -> None:
        self._recs.pop(seq_id, None)

    def __len__(self) -> int:
        return len(self._recs)


# ---------------------------------------------------------------------------- the serving side's handle


class Distiller:
    """Runs the trainer process for one draft worker and hands accepted weights to ``on_swap``
    (called from a background thread: it must only schedule the swap)."""

    RESTART_BASE = 5.0  # seconds before a failed trainer is started again, doubling up to RESTART_MAX
    RESTART_MAX = 300.0

    def __init__(self, cfg: DistillConfig, on_swap: Callable[[dict[str, torch.Tensor]], None]):
        self.cfg = cfg
        self.on_swap = on_swap
        self.stats = DistillStats()
        self.recorder = Recorder(self._offer)
        self._ctx = mp.get_context("spawn")
        self._inbox = self._outbox = None
        self._proc = None
        self._state: dict[str, torch.Tensor] | None = None  # the serving weights after the latest swap
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._restarts = 0
        self._base_busy = self._base_alive = 0.0  # of trainers that ended

    def start(self) -> None:
        self._spawn()
        self._thread = threading.Thread(target=self._watch, name="distill-watch", daemon=True)
        self._thread.start()

    def _spawn(self) -> None:
        self._close_queues()  # a failed trainer's
        self._inbox = self._ctx.Queue(self.cfg.queue_samples)
        self._outbox = self._ctx.Queue()
        self._proc = self._ctx.Process(target=trainer_main, args=(self.cfg, self._state, self._inbox, self._outbox,
                                                                         self.stats.version),
                                       name="tandem-distill", daemon=True)
        self._proc.start()
        log.info("online distillation: trainer process %d started (share %.2f, buffer %d tokens)", self._proc.pid,
                 self.cfg.share, self.cfg.buffer_tokens)

    def _offer(self, sample: dict) -> None:
        self.stats.samples_offered += 1
        try:  # as numpy arrays: pickled by value (torch tensors would travel as shared memory, one fd each)
            self._inbox.put_nowait(("sample", {k: v.numpy() for k, v in sample.items()}))
        except (queue.Full, ValueError, OSError, AttributeError):
            self.stats.samples_dropped += 1

    def _watch(self) -> None:
        last_busy = last_alive = 0.0
        while not self._stopping.is_set():
            try:
                msg = self._outbox.get(timeout=0.5)
            except queue.Empty:
                msg = None
            except (EOFError, OSError, ValueError):
                msg = ("error", "the trainer's queue broke")
            if msg is not None:
                last_busy, last_alive = self._handle(msg, last_busy, last_alive)
                if msg[0] != "error":
                    continue
            elif self._proc.is_alive():
                continue
            if self._stopping.is_set():
                return
            # the trainer raised or died: serving goes on with the weights it has; try again later
            self.stats.failures += 1
            self._base_busy += last_busy
            self._base_alive += last_alive
            last_busy = last_alive = 0.0
            self._kill()
            wait = backoff_delay(self._restarts, self.RESTART_BASE, self.RESTART_MAX)
            self._restarts += 1
            log.warning("online distillation: trainer failed (%s); serving keeps its weights, restarting in %.0f s",
                        msg[1] if msg else f"exit code {self._proc.exitcode}", wait)
            if self._stopping.wait(wait):
                return
            self._spawn()

    def _handle(self, msg: tuple, last_busy: float, last_alive: float) -> tuple[float, float]:
        kind, st = msg[0], self.stats
        if kind == "step":
            info = msg[1]
            st.train_steps += 1
            st.last_loss = info["loss"]
            st.buffer_tokens = info["buffer_tokens"]
            st.train_seconds = self._base_busy + info["busy"]
            st.trainer_seconds = self._base_alive + info["alive"]
            return info["busy"], info["alive"]
        if kind == "swap":
            _, version, state, scores = msg
            self._state = state
            st.swaps += 1
            st.version = version
            st.serving_acceptance = st.candidate_acceptance = scores["candidate"]  # the candidate serves now
            self._restarts = 0
            log.info("online distillation: candidate %d accepts %.3f on held-back traffic against %.3f: swapping it in",
                     version, scores["candidate"], scores["serving"])
            try:
                self.on_swap(state)
            except Exception:
                log.exception("online distillation: scheduling the swap failed")
        elif kind == "rejected":
            st.rejected += 1
            st.serving_acceptance, st.candidate_acceptance = msg[1]["serving"], msg[1]["candidate"]
        elif kind == "nonfinite":
            st.nonfinite += 1
            log.warning("online distillation: non-finite loss; the candidate went back to the serving weights")
        return last_busy, last_alive

    def _kill(self) -> None:
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.kill()
        if proc is not None:
            proc.join(timeout=5)

    @property
    def trainer_pid(self) -> int | None:
        return self._proc.pid if self._proc is not None else None

    def stop(self) -> None:
        self._stopping.set()
        try:
            self._inbox.put_nowait(("stop",))
        except Exception:
            pass
        if self._proc is not None:
            self._proc.join(timeout=5)
        self._kill()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._close_queues()

    def _close_queues(self) -> None:
        for q in (self._inbox, self._outbox):
            if q is not None:
                q.cancel_join_thread()
                q.close()


# ---------------------------------------------------------------------------- readers


class Follower:
    """Takes each head a trainer writes to ``directory`` (``LATEST``), polling every ``interval``
    seconds; ``on_swap`` gets its trainable weights (from a background thread)."""

    def __init__(self, directory: str | Path, load: Callable[[Path], dict[str, torch.Tensor]],
                 on_swap: Callable[[dict[str, torch.Tensor]], None], interval: float = 5.0):
        self.directory = Path(directory)
        self.load = load
        self.on_swap = on_swap
        self.interval = interval
        self.current = ""
        self.swaps = 0
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def poll(self) -> bool:
        """Load the newest head if it changed; True when one was handed over."""
        try:
            name = (self.directory / "LATEST").read_text().strip()
        except OSError:
            return False
        if not name or name == self.current:
            return False
        try:
            state = self.load(self.directory / name)
        except Exception as exc:  # a head that does not load (or does not fit) is skipped, loudly
            log.warning("--distill-config's follow: %s not taken: %s", self.directory / name, exc)
            self.current = name
            return False
        self.current = name
        self.on_swap(state)
        self.swaps += 1
        log.info("--distill-config's follow: serving %s", self.directory / name)
        return True

    def start(self) -> None:
        def run():
            while not self._stopping.wait(self.interval):
                self.poll()

        self.poll()
        self._thread = threading.Thread(target=run, name="distill-follow", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
