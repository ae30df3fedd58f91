"""A long random mixed workload for an engine: sampled and greedy requests of random lengths, half of
them sharing a prefix, some aborted while they run, one submitted per step."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

from runtime.messages import SamplingParams


def mixed_requests(engine, rng: random.Random, n: int, *, vocab: int, max_tokens: int, abort_p: float,
                   extra: Callable[[random.Random], dict[str, Any]] | None = None,
                   finished_are_live: bool = False) -> set[str]:
    """Submit ``n`` random requests ``q0``… to ``engine``, one step after each, aborting a random live
    one with probability ``abort_p``; then step until the engine has no work. ``max_tokens`` bounds
    each request's (exclusive), ``extra(rng)`` adds sampling options (drawn after the others), and
    with ``finished_are_live`` every finished request must be one not yet finished or aborted.
    Returns the requests neither finished nor aborted (none, once the engine is idle)."""
    shared = [rng.randrange(vocab) for _ in range(12)]
    live: set[str] = set()
    for i in range(n):
        prompt = (shared if rng.random() < 0.5 else []) + [rng.randrange(vocab) for _ in range(rng.randrange(1, 30))]
        params = SamplingParams(temperature=rng.choice([0.0, 1.0]), max_tokens=rng.randrange(0, max_tokens),
                                seed=rng.randrange(100), ignore_eos=rng.random() < 0.5,
                                **(extra(rng) if extra else {}))
        engine.add_request(f"q{i}", prompt, params)
        live.add(f"q{i}")
        if rng.random() < abort_p and live:
            engine.abort(rng.choice(sorted(live)))
        for rid, delta in engine.step():
            if delta.finish_reason:
                assert not finished_are_live or rid in live, f"{rid} finished again, or after its abort"
                live.discard(rid)
    while engine.has_work():
        for rid, delta in engine.step():
            if delta.finish_reason:
                live.discard(rid)
    return live
