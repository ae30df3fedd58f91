"""Chained block hashes of token sequences, shared by workers (which publish them) and the router
(which looks them up). Block i's hash covers block i-1's hash and block i's tokens, so equal hashes
mean equal prefixes. Only full blocks are hashed.
"""

from __future__ import annotations

import hashlib
from array import array

ROOT_HASH = 0  # parent of the first block


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
