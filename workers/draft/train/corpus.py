"""A token corpus on disk: the target's conversations as token ids and loss masks, no hidden states.

What is costly to make (the target's replies) and small (2 bytes a token) is kept; what is cheap to
redo and large (hidden states, one teacher-forced forward per conversation) is recomputed when a
head is trained (:func:`workers.draft.train.data.rehidden_shards`). A corpus is a directory:

- ``manifest.json``: what made it (prompt bank and its version, seed, shard size, reply limits,
  sampling mix, target); a run that would make other conversations under the same shard names
  refuses to write there (:func:`check_manifest`);
- ``shard_00000.npz``, ...: shard k holds conversations ``[k·S, (k+1)·S)`` of the bank, less any
  that were dropped (a self-instruct user turn that came out unusable, a prompt over ``max_len``).
  Arrays: ``tokens`` (uint16 when the vocabulary fits, else int32) — every conversation's ids end to
  end; ``offsets`` (int32, n+1) — conversation j is ``tokens[offsets[j]:offsets[j+1]]``; ``mask``
  (uint8, ``np.packbits`` of a bool per token) — True on the tokens the target generated, where the
  loss applies; ``index`` (int32, n) — each conversation's number in the bank; ``sampled`` (uint8,
  n) — 1 where the replies were sampled rather than greedy. Written to a temporary name and renamed,
  so a shard is whole on disk or absent and a killed run resumes where it stopped.
"""

from __future__ import annotations

import io
import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

FORMAT = 1
MANIFEST = "manifest.json"


@dataclass(frozen=True)
class Conversation:
    """One finished conversation: ``tokens`` [T] and ``mask`` [T] (True where the target generated)."""

    index: int
    tokens: list[int]
    mask: list[bool]
    sampled: bool

    def __post_init__(self):
        if len(self.tokens) != len(self.mask):
            raise ValueError(f"conversation {self.index}: {len(self.tokens)} tokens but {len(self.mask)} mask entries")


def shard_path(directory: Path, number: int) -> Path:
    return directory / f"shard_{number:05d}.npz"


def shard_paths(directory: Path) -> list[Path]:
    """Every shard of the corpus in ``directory``, in order."""
    return sorted(Path(directory).glob("shard_*.npz"))


def is_corpus(directory: str | Path) -> bool:
    return (Path(directory) / MANIFEST).is_file()


def read_manifest(directory: str | Path) -> dict:
    return json.loads((Path(directory) / MANIFEST).read_text())


def check_manifest(directory: Path, manifest: dict) -> None:
    """Write ``manifest`` into a new corpus, or check an existing corpus was made the same way."""
    path = directory / MANIFEST
    manifest = {"format": FORMAT, **manifest}
    if path.exists():
        found = json.loads(path.read_text())
        diff = sorted(k for k in set(found) | set(manifest) if found.get(k) != manifest.get(k))
        if diff:
            raise ValueError(f"{directory} holds a corpus made with other settings ({', '.join(diff)}: "
                             f"{[found.get(k) for k in diff]} there, {[manifest.get(k) for k in diff]} now); "
                             f"use another directory")
        return
    directory.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(manifest, indent=2) + "\n")
    tmp.replace(path)


def write_shard(path: Path, conversations: list[Conversation], vocab_size: int) -> None:
    """Write one shard atomically (see the module docstring for its arrays)."""
    convs = sorted(conversations, key=lambda c: c.index)
    lengths = [len(c.tokens) for c in convs]
    offsets = np.zeros(len(convs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    dtype = np.uint16 if vocab_size <= 1 << 16 else np.int32
    tokens = np.fromiter((t for c in convs for t in c.tokens), dtype=dtype, count=int(offsets[-1]))
    mask = np.fromiter((m for c in convs for m in c.mask), dtype=bool, count=int(offsets[-1]))
    buf = io.BytesIO()
    np.savez_compressed(buf, tokens=tokens, offsets=offsets, mask=np.packbits(mask),
                        index=np.array([c.index for c in convs], dtype=np.int32),
                        sampled=np.array([c.sampled for c in convs], dtype=np.uint8))
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as fh:
        fh.write(buf.getvalue())
        fh.flush()
        os.fsync(fh.fileno())
    tmp.replace(path)


def read_shard(path: Path) -> list[Conversation]:
    with np.load(path) as z:
        tokens, offsets = z["tokens"].astype(np.int64), z["offsets"]
        mask = np.unpackbits(z["mask"], count=int(offsets[-1])).astype(bool)
        index, sampled = z["index"], z["sampled"]
    return [Conversation(int(index[j]), tokens[offsets[j]:offsets[j + 1]].tolist(),
                         mask[offsets[j]:offsets[j + 1]].tolist(), bool(sampled[j])) for j in range(len(index))]


def shard_samples(path: Path) -> list[dict]:
    """A shard's conversations as training samples without hidden states: ``tokens`` [T] (long) and
    ``mask`` [T] (bool), the shape :func:`workers.draft.train.data.rehidden_shards` reads."""
    return [{"tokens": torch.tensor(c.tokens, dtype=torch.long), "mask": torch.tensor(c.mask, dtype=torch.bool)}
            for c in read_shard(path)]
