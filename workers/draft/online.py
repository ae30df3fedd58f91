"""Online distillation: an EAGLE-3 draft head that learns the traffic it serves (``--online-distill``).

Every proposal request and verdict already brings the draft worker the target's hidden states for
the committed tokens and the tokens the target chose: exactly what :mod:`.train.ttt` trains on, on
the real traffic. Three parts, each bounded:

- **Recorder** (in the serving process, on the proposer's thread): per greedy sequence, the hidden
  rows as they arrive (float16, three layers concatenated); when the target releases the sequence
  the finished sample (tokens, hidden rows, reply mask: everything after the prompt) is offered to
  the trainer. Sampled requests are not recorded (their tokens are draws, not the target's argmax,
  which is what the head learns). Offering never blocks: a full queue drops the sample.
- **Trainer** (a separate process, so that a crash, a NaN or a slow step never touches serving; on
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
loads such a head with ``--eagle-model DIR/vNNNNN``, and ``--distill-follow DIR`` makes a draft
worker take each new one as it appears: one trainer, many readers.
"""

from __future__ import annotations

import logging
import math
import multiprocessing as mp
import os
import queue
import random
import shutil
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

log = logging.getLogger(__name__)

FROZEN = ("fc.",)  # parameters online training leaves alone (see the module docstring)


@dataclass(frozen=True)
class DistillConfig:
    head_dir: str  # the head serving starts from
    target_dir: str  # the target's checkpoint (embedding) and config
    max_len: int = 4096  # positions the head's rotary table covers
    steps: int = 3  # training-time-test depth: the γ the acceptance is scored at
    buffer_tokens: int = 65536  # training samples kept (oldest dropped first)
    eval_tokens: int = 8192  # held-back samples kept
    holdout_every: int = 5  # one sample in this many is held back for evaluation
    min_tokens: int = 2048  # training starts once the buffer holds this many tokens
    min_eval_chains: int = 0  # ... and the held-back samples this many scored chains (0: min_tokens / 10)
    batch_tokens: int = 2048  # tokens per optimizer step
    lr: float = 1e-4
    eval_every: int = 20  # optimizer steps between evaluations
    min_gain: float = 0.02  # acceptance length a candidate must add to be swapped in
    share: float = 0.5  # of its time the trainer may compute
    threads: int = 1  # torch threads of the trainer (CPU)
    nice: int = 10  # CPU priority of the trainer process (added)
    queue_samples: int = 64  # samples in flight to the trainer before new ones are dropped
    out_dir: str | None = None  # write accepted heads here (speculators layout)
    seed: int = 0
    device: str = "cpu"  # where the trainer computes (the draft's device)

    def __post_init__(self):
        if not 0 < self.share <= 1:
            raise ValueError(f"--distill-share must be in (0, 1], got {self.share}")
        for name in ("buffer_tokens", "batch_tokens", "eval_every", "threads", "steps", "holdout_every"):
            if getattr(self, name) <= 0:
                raise ValueError(f"--distill-{name.replace('_', '-')} must be positive, got {getattr(self, name)}")
        if self.lr <= 0 or self.min_gain < 0:
            raise ValueError("--distill-lr must be > 0 and --distill-min-gain >= 0")


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


# ---------------------------------------------------------------------------- training (its own process)


def trainable_state(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters online training changes, detached copies on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in head.state_dict().items()
            if not k.startswith(FROZEN) and k not in ("d2t", "t2d") and v.is_floating_point()}


class _Trainer:
    def __init__(self, cfg: DistillConfig, start_state: dict | None, inbox, outbox, version: int = 0):
        from .eagle import Eagle3Head, load_eagle, load_target_parts

        self.cfg, self.inbox, self.outbox = cfg, inbox, outbox
        embed, lm_head, target_cfg = load_target_parts(cfg.target_dir)
        head, self.layers = load_eagle(cfg.head_dir, embed, lm_head, target_cfg, cfg.max_len)
        if not isinstance(head, Eagle3Head):
            raise ValueError(f"{cfg.head_dir}: online distillation trains EAGLE-3 heads only")
        self.device = torch.device(cfg.device)
        head = head.float().to(self.device)
        embed = embed.to(self.device)
        if start_state:
            head.load_state_dict(start_state, strict=False)
        embed.weight.requires_grad_(False)
        for name, p in head.named_parameters():
            p.requires_grad_(not name.startswith(FROZEN))
        self.head, self.embed = head.train(), embed
        ids = torch.arange(head.d2t.shape[0]) + head.d2t.long()
        self.t2d = torch.full((target_cfg.vocab_size,), -1, dtype=torch.long, device=ids.device)
        self.t2d[ids] = torch.arange(ids.shape[0], device=ids.device)
        self.draft_ids = ids.cpu()
        self.optimizer = self._optimizer()
        self.serving = trainable_state(head)  # the weights the draft worker serves with
        self.train: deque[dict] = deque()
        self.held: deque[dict] = deque()
        self.train_tokens = self.held_tokens = 0
        self.seen = 0
        self.steps = 0
        self.version = version  # accepted candidates so far (a restarted trainer goes on counting)
        self.rng = random.Random(cfg.seed)
        self.busy = 0.0
        self.started = time.perf_counter()

    def _optimizer(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in self.head.parameters() if p.requires_grad], lr=self.cfg.lr,
                                 betas=(0.9, 0.95), weight_decay=0.0)

    # -- data

    def _take(self, sample: dict) -> None:
        n = int(sample["tokens"].shape[0])
        self.seen += 1
        if self.seen % self.cfg.holdout_every == 0:
            self.held.append(sample)
            self.held_tokens += n
            while self.held_tokens > self.cfg.eval_tokens and len(self.held) > 1:
                self.held_tokens -= int(self.held.popleft()["tokens"].shape[0])
        else:
            self.train.append(sample)
            self.train_tokens += n
            while self.train_tokens > self.cfg.buffer_tokens and len(self.train) > 1:
                self.train_tokens -= int(self.train.popleft()["tokens"].shape[0])

    def _held_chains(self) -> int:
        return sum(int(s["mask"][2:].sum()) for s in self.held)

    def _ready(self) -> bool:
        chains = self.cfg.min_eval_chains or max(1, self.cfg.min_tokens // 10)
        return self.train_tokens >= self.cfg.min_tokens and self._held_chains() >= chains

    def _drain(self, block: bool) -> bool:
        """Take what the serving side sent; False when told to stop."""
        try:
            msg = self.inbox.get(timeout=1.0) if block else self.inbox.get_nowait()
            while True:
                if msg[0] == "stop":
                    return False
                self._take(msg[1])
                msg = self.inbox.get_nowait()
        except queue.Empty:
            return True

    # -- steps

    def _forward(self, sample: dict):
        from .train.ttt import ttt_forward

        d = self.device
        return ttt_forward(self.head, self.embed, sample["tokens"].to(d), sample["hidden"].to(d).float(),
                           sample["mask"].to(d), self.t2d, self.cfg.steps)

    def _step(self) -> float:
        """One optimizer step over about ``batch_tokens`` tokens of random samples; its mean loss."""
        batch, n = [], 0
        while n < self.cfg.batch_tokens and len(batch) < len(self.train):
            s = self.train[self.rng.randrange(len(self.train))]
            batch.append(s)
            n += int(s["tokens"].shape[0])
        self.optimizer.zero_grad(set_to_none=True)
        losses = []
        for s in batch:
            st = self._forward(s)
            losses.append(float(st.loss.detach()))
            if not math.isfinite(losses[-1]):
                return losses[-1]  # nothing is stepped: the caller resets the candidate
            (st.loss * int(s["tokens"].shape[0]) / n).backward()
        grads = [p.grad for p in self.head.parameters() if p.grad is not None]
        if any(not bool(torch.isfinite(g).all()) for g in grads):
            return float("nan")
        torch.nn.utils.clip_grad_norm_(self.head.parameters(), 0.5)
        self.optimizer.step()
        return sum(losses) / len(losses)

    @torch.no_grad()
    def _acceptance(self, state: dict[str, torch.Tensor] | None = None) -> float:
        """Teacher-forced greedy acceptance length on the held-back samples (of ``state`` if given)."""
        saved = trainable_state(self.head) if state is not None else None
        if state is not None:
            self.head.load_state_dict(state, strict=False)
        self.head.eval()
        try:
            chains = accepted = 0
            for s in self.held:
                st = self._forward(s)
                chains += st.chains
                accepted += st.accepted
            return 1 + accepted / chains if chains else float("nan")
        finally:
            self.head.train()
            if saved is not None:
                self.head.load_state_dict(saved, strict=False)

    def _reset(self) -> None:
        self.head.load_state_dict(self.serving, strict=False)
        self.optimizer = self._optimizer()

    def _evaluate(self) -> None:
        candidate = self._acceptance()
        serving = self._acceptance(self.serving)
        stats = {"candidate": candidate, "serving": serving}
        if math.isfinite(candidate) and candidate >= serving + self.cfg.min_gain:
            self.serving = trainable_state(self.head)
            self.version += 1
            self.outbox.put(("swap", self.version, self.serving, stats))
            if self.cfg.out_dir:
                self._save()
        else:
            self.outbox.put(("rejected", stats))

    def _save(self) -> None:
        from .train.checkpoint import save_eagle3

        out = Path(self.cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        name = f"v{self.version:05d}"
        tmp = out / f".{name}.tmp"
        t2d = torch.zeros(self.t2d.shape[0], dtype=torch.bool)  # on the host, as the head is written from there
        t2d[self.draft_ids] = True
        save_eagle3(self.head, t2d, tmp, layers=self.layers, verifier=str(self.cfg.target_dir),
                    num_speculative_tokens=self.cfg.steps, dtype=torch.float32,
                    extra={"online_distill": {"version": self.version, "steps": self.steps}})
        if (out / name).exists():  # left by an earlier run of this directory
            shutil.rmtree(out / name)
        os.replace(tmp, out / name)
        latest = out / ".LATEST.tmp"
        latest.write_text(name + "\n")
        os.replace(latest, out / "LATEST")

    def run(self) -> None:
        while True:
            if not self._drain(block=not self._ready()):
                return
            if not self._ready():
                continue
            started = time.perf_counter()
            loss = self._step()
            self.steps += 1
            if not math.isfinite(loss):
                self._reset()
                self.outbox.put(("nonfinite", loss))
            elif self.steps % self.cfg.eval_every == 0:
                self._evaluate()
            took = time.perf_counter() - started
            self.busy += took
            self.outbox.put(("step", {"loss": loss, "busy": self.busy, "alive": time.perf_counter() - self.started,
                                      "buffer_tokens": self.train_tokens + self.held_tokens}))
            if self.cfg.share < 1:
                time.sleep(took * (1 / self.cfg.share - 1))


def _trainer_main(cfg: DistillConfig, start_state: dict | None, inbox, outbox, version: int = 0) -> None:
    torch.set_num_threads(cfg.threads)
    if cfg.nice:
        try:
            os.nice(cfg.nice)
        except OSError:
            pass
    try:
        _Trainer(cfg, start_state, inbox, outbox, version).run()
    except BaseException as exc:  # noqa: BLE001 — reported to the serving side, which restarts it
        outbox.put(("error", f"{type(exc).__name__}: {exc}"))
        raise SystemExit(1) from None


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
        self._inbox = self._ctx.Queue(self.cfg.queue_samples)
        self._outbox = self._ctx.Queue()
        self._proc = self._ctx.Process(target=_trainer_main, args=(self.cfg, self._state, self._inbox, self._outbox,
                                                                         self.stats.version),
                                       name="tandem-distill", daemon=True)
        self._proc.start()
        log.info("online distillation: trainer process %d started (share %.2f, buffer %d tokens)", self._proc.pid,
                 self.cfg.share, self.cfg.buffer_tokens)

    def _offer(self, sample: dict) -> None:
        self.stats.samples_offered += 1
        try:
            self._inbox.put_nowait(("sample", sample))
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
            wait = min(self.RESTART_BASE * 2 ** self._restarts, self.RESTART_MAX)
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
            log.warning("--distill-follow: %s not taken: %s", self.directory / name, exc)
            self.current = name
            return False
        self.current = name
        self.on_swap(state)
        self.swaps += 1
        log.info("--distill-follow: serving %s", self.directory / name)
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
