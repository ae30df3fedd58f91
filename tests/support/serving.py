"""Test helpers that serve prompts: through a target's step loop in process, and the tiny target with
an EAGLE-3 head that the real-process tests start workers from."""

from __future__ import annotations

import asyncio
from pathlib import Path


async def serve_through(loop, prompts: dict[str, list[int]], params, timeout: float = 30.0) -> dict[str, list[int]]:
    """Submit every prompt to a started ``StepLoop`` at once; each request's tokens, by id."""

    async def one(rid: str) -> list[int]:
        queue, tokens = loop.submit(rid, prompts[rid], params), []
        while True:
            delta = await asyncio.wait_for(queue.get(), timeout)
            assert not isinstance(delta, BaseException), delta
            tokens.extend(delta.token_ids)
            if delta.finish_reason:
                return tokens

    return dict(zip(prompts, await asyncio.gather(*(one(rid) for rid in prompts))))


def tiny_target_with_eagle3(tmp_path_factory, name: str) -> tuple[Path, Path]:
    """A 4-layer random Llama (seed 7, the spec tests' vocabulary) and a random EAGLE-3 head for it."""
    from tests.support.eagle_heads import write_eagle3
    from tests.support.tiny_models import SPEC_VOCAB, tiny_hf_model

    target = tmp_path_factory.mktemp(f"{name}-target")
    tiny_hf_model("llama", target, seed=7, vocab=SPEC_VOCAB, layers=4, max_positions=1024)
    head = tmp_path_factory.mktemp(f"{name}-head")
    write_eagle3(head, seed=3)
    return target, head
