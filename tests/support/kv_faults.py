"""Faults injected into a KV disk-tier directory (tests and ``bench/kv_tier_diff.py``)."""

from __future__ import annotations

import random
import shutil
from pathlib import Path

from workers.engine.kv_disk import HEADER

FAULTS = ("truncate", "flip_payload", "flip_key", "delete", "copy_over")


def damage_block_file(rng: random.Random, directory: Path) -> str | None:
    """Damage one random block file under ``directory`` (its layout folders): truncate it, flip a bit
    of its payload or of its key (the header's hash or parent), delete it, or copy another block's
    whole, valid file over it. Returns what was done (None: no file there)."""
    files = sorted(Path(directory).glob("*/*.kvb"))
    if not files:
        return None
    victim = rng.choice(files)
    kind = rng.choice(FAULTS)
    data = bytearray(victim.read_bytes())
    if kind == "truncate":
        victim.write_bytes(bytes(data[: rng.randrange(0, len(data))]))
    elif kind == "flip_payload":
        data[rng.randrange(HEADER.size, len(data))] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
    elif kind == "flip_key":  # bytes 8-23: the header's hash and parent (after magic, version, block size)
        data[rng.randrange(8, 24)] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
    elif kind == "delete":
        victim.unlink()
    elif len(files) > 1:
        shutil.copyfile(rng.choice([f for f in files if f != victim]), victim)
    return kind
