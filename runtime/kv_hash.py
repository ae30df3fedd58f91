"""Chained block hashes of token sequences, shared by workers (which publish them) and the router
(which looks them up). Block i's hash covers block i-1's hash and block i's tokens, so equal hashes
mean equal prefixes. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Mapping

from .messages import KvEvent, KvEventKind

ROOT_HASH = 0  # parent of the first block


def chain_root(lora: str | None = None) -> int:
    """Where a request's chain starts: :data:`ROOT_HASH` for the base model, a hash of the name for
    a LoRA adapter, so equal tokens under different adapters (whose KV differs) never share a hash.
    Events still name :data:`ROOT_HASH` as the first block's parent: the root only seeds the chain."""
    if not lora:
        return ROOT_HASH
    digest = hashlib.blake2b(b"lora\0" + lora.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


def block_hash(parent: int, tokens) -> int:
    """Hash of one block of tokens following the block whose hash is ``parent``."""
    data = parent.to_bytes(8, "little") + array("I", tokens).tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def block_hashes(tokens, block_size: int, parent: int = ROOT_HASH) -> list[int]:
    """Chained hashes of every full block of ``tokens``."""
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    data = array("I", tokens).tobytes()  # once, then sliced per block (same bytes as block_hash)
    step = 4 * block_size
    out = []
    for start in range(0, len(data) - step + 1, step):
        parent = int.from_bytes(hashlib.blake2b(parent.to_bytes(8, "little") + data[start : start + step],
                                                digest_size=8).digest(), "little") >> 1
        out.append(parent)
    return out


def stored_events(worker_id: str, block_size: int, parents: Mapping[int, int], first_event_id: int) -> list[KvEvent]:
    """A cache's contents (block hash -> parent hash) as ``stored`` events, one block each, parents
    before children, numbered from ``first_event_id`` (what a worker sends a late router as a dump)."""
    out: list[KvEvent] = []
    seen: set[int] = set()

    def emit(h: int) -> None:
        if h in seen or h not in parents:
            return
        parent = parents[h]
        if parent != ROOT_HASH:
            emit(parent)
        seen.add(h)
        out.append(KvEvent(worker_id, first_event_id + len(out), KvEventKind.STORED, [h],
                           None if parent == ROOT_HASH else parent, block_size))

    for h in list(parents):
        emit(h)
    return out
