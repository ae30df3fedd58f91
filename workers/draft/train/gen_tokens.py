"""The target's replies to the prompt bank, kept as token ids in a resumable corpus (no hidden states).

Usage: python -m workers.draft.train.gen_tokens --out workers/draft/train/corpora/smollm2-135m-instruct
       [TARGET_DIR] [--batch 16 --shard-size 64 --threads 1 --max-shards N]   (Ctrl-C / kill: resumes)

Shard k is conversations ``[k·S, (k+1)·S)`` of :func:`workers.draft.train.bank.bank_conversation`;
shards already on disk are skipped, so a killed run started again carries on where it stopped, in
this session or a later one. ``tandem train-draft --data-from DIR`` trains on the corpus, recomputing
the hidden states with one forward per conversation. Generation runs through our engine (continuous
batching across shard and turn boundaries, :mod:`.pump`), on the CPU or with ``--device cuda``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from ...engine.engine import Engine, EngineConfig
from ...engine.model_runner import ModelRunner
from .bank import BANK_VERSION, bank_conversation
from .corpus import Conversation, check_manifest, shard_path, write_shard
from .pump import ConversationPump

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class GenConfig:
    target: str
    out: str
    seed: int = 0
    shard_size: int = 64
    max_shards: int | None = None  # new shards to make in this run (None: until stopped)
    last_shard: int = 99_999  # shard numbers stop here (5 digits)
    batch: int = 16
    max_tokens: int = 256
    max_len: int = 1024
    temperature: float = 0.7
    sampled_fraction: float = 0.25
    device: str = "cpu"
    threads: int | None = None

    def __post_init__(self):
        if self.shard_size <= 0 or self.batch <= 0 or self.max_tokens <= 0 or self.max_len <= 16:
            raise ValueError("--shard-size, --batch and --max-tokens must be positive, --max-len above 16")
        if self.max_shards is not None and self.max_shards <= 0:
            raise ValueError(f"--max-shards must be positive, got {self.max_shards}")
        if not 0 <= self.last_shard <= 99_999:
            raise ValueError(f"--last-shard must be in [0, 99999], got {self.last_shard}")
        if not 0.0 <= self.sampled_fraction <= 1.0 or self.temperature < 0:
            raise ValueError("--sampled-fraction must be in [0, 1] and --temperature >= 0")
        if not (Path(self.target) / "config.json").exists():
            raise ValueError(f"target {self.target!r} is not a model directory with a config.json")

    def manifest(self, vocab_size: int) -> dict:
        """What decides the corpus's contents (not how fast it is made: batch, device, threads)."""
        return {"bank": "workers.draft.train.bank", "bank_version": BANK_VERSION, "seed": self.seed,
                "shard_size": self.shard_size, "max_tokens": self.max_tokens, "max_len": self.max_len,
                "temperature": self.temperature, "sampled_fraction": self.sampled_fraction,
                "target": Path(self.target).name, "vocab_size": vocab_size}


def todo_shards(out: Path, cfg: GenConfig) -> Iterator[int]:
    """Shard numbers not on disk yet, in order (at most ``max_shards``)."""
    missing = (k for k in range(cfg.last_shard + 1) if not shard_path(out, k).exists())
    return itertools.islice(missing, cfg.max_shards) if cfg.max_shards is not None else missing


def generate(cfg: GenConfig, engine: Engine, tokenizer, vocab_size: int) -> dict:
    """Make the missing shards; returns totals (conversations, reply tokens, seconds)."""
    out = Path(cfg.out)
    check_manifest(out, cfg.manifest(vocab_size))
    for stale in out.glob("*.tmp"):  # a write a kill interrupted
        stale.unlink()
    pump = ConversationPump(engine, tokenizer, batch=cfg.batch, max_tokens=cfg.max_tokens, max_len=cfg.max_len,
                            temperature=cfg.temperature, sampled_fraction=cfg.sampled_fraction, seed=cfg.seed)
    pending: dict[int, list[Conversation | None]] = {}
    totals = {"shards": 0, "conversations": 0, "reply_tokens": 0, "tokens": 0}
    started, cpu_started = time.perf_counter(), time.process_time()

    def source() -> Iterator[tuple[int, dict]]:
        for k in todo_shards(out, cfg):
            pending[k] = []
            for i in range(k * cfg.shard_size, (k + 1) * cfg.shard_size):
                yield i, bank_conversation(cfg.seed, i)

    def done(index: int, conv: Conversation | None) -> None:
        k = index // cfg.shard_size
        pending[k].append(conv)
        if len(pending[k]) < cfg.shard_size:
            return
        kept = [c for c in pending.pop(k) if c is not None]
        write_shard(shard_path(out, k), kept, vocab_size)
        reply = sum(sum(c.mask) for c in kept)
        totals["shards"] += 1
        totals["conversations"] += len(kept)
        totals["reply_tokens"] += reply
        totals["tokens"] += sum(len(c.tokens) for c in kept)
        seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
        # per CPU-second as well: on a shared machine the wall-clock rate says more about the neighbours
        log.info("shard %05d: %d conversations, %d reply tokens; this run %d shards, %d reply tokens in %.0f s "
                 "(%.1f reply tok/s, %.1f per CPU-s; generated %.1f tok/s, %.1f per CPU-s)", k, len(kept), reply,
                 totals["shards"], totals["reply_tokens"], seconds, totals["reply_tokens"] / seconds,
                 totals["reply_tokens"] / cpu, pump.generated / seconds, pump.generated / cpu)

    pump.run(source(), done)
    return {**totals, "seconds": time.perf_counter() - started, "generated_tokens": pump.generated}


def build_engine(model, batch: int, max_len: int) -> Engine:
    """A plain engine sized for ``batch`` sequences at full length (prefix caching shares system prompts)."""
    kv_bytes = max(256 << 20, batch * -(-max_len // 16) * ModelRunner.bytes_per_block(model, 16))
    return Engine(model, EngineConfig(block_size=16, max_num_seqs=batch, max_num_batched_tokens=2048,
                                      max_model_len=max_len, kv_cache_bytes=kv_bytes, enable_prefix_caching=True))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m workers.draft.train.gen_tokens", description=__doc__.splitlines()[0])
    p.add_argument("target", nargs="?", default=None, help="target model directory (default: the demo model)")
    p.add_argument("--out", required=True, help="corpus directory (shards and manifest.json)")
    p.add_argument("--seed", type=int, default=0, help="prompt bank seed")
    p.add_argument("--shard-size", type=int, default=64, help="conversations per shard")
    p.add_argument("--max-shards", type=int, default=None,
                   help="new shards to make, then stop (default: run until killed)")
    p.add_argument("--last-shard", type=int, default=99_999, help="highest shard number to make")
    p.add_argument("--batch", type=int, default=16, help="conversations in flight (continuous batching)")
    p.add_argument("--max-tokens", type=int, default=256, help="reply length per turn")
    p.add_argument("--max-len", type=int, default=1024, help="longest conversation in tokens")
    p.add_argument("--temperature", type=float, default=0.7, help="temperature of the sampled replies")
    p.add_argument("--sampled-fraction", type=float, default=0.25, help="share of conversations with sampled replies")
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
        torch.set_num_interop_threads(1)
    target = args.target
    if target is None:
        from workers.demo_model import demo_model_dir

        target = str(demo_model_dir())
    try:
        cfg = GenConfig(target=target, out=args.out, seed=args.seed, shard_size=args.shard_size,
                        max_shards=args.max_shards, last_shard=args.last_shard, batch=args.batch,
                        max_tokens=args.max_tokens, max_len=args.max_len, temperature=args.temperature,
                        sampled_fraction=args.sampled_fraction, device=args.device, threads=args.threads)
    except ValueError as exc:
        p.error(str(exc))
    from transformers import AutoTokenizer

    from ...engine.weights import load_model

    model = load_model(cfg.target, device=cfg.device, max_positions=cfg.max_len)
    tokenizer = AutoTokenizer.from_pretrained(cfg.target)
    try:
        totals = generate(cfg, build_engine(model, cfg.batch, cfg.max_len), tokenizer, model.cfg.vocab_size)
    except ValueError as exc:
        p.error(str(exc))
    print(f"{totals['shards']} shards, {totals['conversations']} conversations, {totals['reply_tokens']} reply tokens "
          f"in {totals['seconds']:.0f} s ({totals['reply_tokens'] / max(totals['seconds'], 1e-9):.1f} reply tok/s)")


if __name__ == "__main__":
    main()
