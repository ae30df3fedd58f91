"""The online-distillation trainer (see :mod:`workers.draft.online`): its own process, fed samples
of recent traffic by the draft worker; it trains the EAGLE-3 head with the training-time-test loss
(:mod:`.ttt`), scores candidates on held-back samples, and sends back weights that accept more."""

from __future__ import annotations

import math
import os
import queue
import random
import shutil
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch

FROZEN = ("fc.",)  # parameters online training leaves alone: live sequences' features stay valid


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
            raise ValueError(f"--distill-config's 'share' must be in (0, 1], got {self.share}")
        for name in ("buffer_tokens", "batch_tokens", "eval_every", "threads", "steps", "holdout_every"):
            if getattr(self, name) <= 0:  # the --distill-config keys by their key, the rest as fields
                what = (f"--distill-config's {name!r}" if name in ("buffer_tokens", "eval_every", "threads")
                        else f"DistillConfig.{name}")
                raise ValueError(f"{what} must be positive, got {getattr(self, name)}")
        if self.lr <= 0 or self.min_gain < 0:
            raise ValueError("--distill-config's 'lr' must be > 0 and 'min_gain' >= 0")


def trainable_state(head: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The parameters online training changes, detached copies on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in head.state_dict().items()
            if not k.startswith(FROZEN) and k not in ("d2t", "t2d") and v.is_floating_point()}


class _Trainer:
    def __init__(self, cfg: DistillConfig, start_state: dict | None, inbox, outbox, version: int = 0):
        from ..eagle import Eagle3Head, load_eagle, load_target_parts

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
        ids = torch.arange(head.d2t.shape[0], device=head.d2t.device) + head.d2t.long()
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
        sample = {k: torch.as_tensor(v) for k, v in sample.items()}  # sent as numpy arrays (by value)
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
        from .ttt import ttt_forward

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
        from .checkpoint import save_eagle3

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


def trainer_main(cfg: DistillConfig, start_state: dict | None, inbox, outbox, version: int = 0) -> None:
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
