"""A target that streams to several draft workers at once (``draft_streams``), with real processes: a
tiny target worker and oracle draft workers, under 16 concurrent greedy streams.

- Every sequence is placed on one of the target's draft streams, and both drafts hold some.
- One draft is killed (SIGKILL) mid-stream, under continuous load: no request fails, every output
  equals the target alone, the dead draft's sequences move to the other, and every stream speculates
  again soon after (logged; the issue's bound is 1 s, asserted here at 5 s for a loaded CI host).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from tests.e2e.test_spec_decode import PROMPTS, expected, target_dir, until_speculating  # noqa: F401
from tests.support.flags import speculative
from tests.support.wait import eventually

pytestmark = pytest.mark.e2e

log = logging.getLogger("tests.draft_pool")

GREEDY = SamplingParams(temperature=0, max_tokens=300, ignore_eos=True)
STREAMS = 16


async def per_draft(address: str, name: str) -> dict[str, float]:
    """A target metric labelled by draft worker: {draft id: value}."""
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://{address}/metrics", timeout=5)).text
    return {s.labels["draft"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name and "draft" in s.labels}


async def scalar(address: str, name: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://{address}/metrics", timeout=5)).text
    return next(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def test_a_dead_drafts_sequences_move_to_the_other_without_a_gap(rt, spawn, target_dir, tmp_path):  # noqa: F811
    want = expected(target_dir, GREEDY)
    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps([p + want[str(i)] for i, p in enumerate(PROMPTS)]))
    spawn("workers.target", "--model", str(target_dir), "--served-model-name", "tiny", "--block-size", "8",
          "--num-blocks", "1024", "--max-model-len", "1024", "--threads", "1", "--num-speculative-tokens", "3",
          *speculative(adaptive=False, load_aware=False, propose_min_wait=0.5, draft_streams=2),
          "--lease-ttl", "3", "--health-port", "0", name="target")
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=90)
    drafts = await rt.client("draft", "speculate")
    oracle = json.dumps({"oracle_file": str(refs), "oracle_error_rate": 0.25, "oracle_vocab_size": 256})
    procs = {name: spawn("workers.draft", "--method", "oracle", "--speculative-config", oracle, "--lease-ttl", "3",
                         "--health-port", "0", name=name) for name in ("draft-a", "draft-b")}
    records = await drafts.wait_for_instances(2, timeout=90)
    await until_speculating(client, inst)
    await eventually(lambda: _both(inst.http_address), timeout=30, interval=0.2, what="streams to both drafts")

    arrivals: dict[int, list[tuple[float, int]]] = {i: [] for i in range(STREAMS)}  # (time, tokens) per delta
    problems: list[str] = []
    served = [0]
    stop = asyncio.Event()

    async def one(i: int) -> None:  # requests back to back until stopped, each checked
        n = 0
        while not stop.is_set():
            prompt = (i + n) % len(PROMPTS)
            n += 1
            try:
                stream = await client.call(inst.instance_id, GenerateRequest(PROMPTS[prompt], GREEDY), TokenDelta)
                got: list[int] = []
                async with stream:
                    async for delta in stream:
                        arrivals[i].append((time.monotonic(), len(delta.token_ids)))
                        got.extend(delta.token_ids)
                served[0] += 1
                if got != want[str(prompt)]:
                    problems.append(f"stream {i}: output differs from the target alone")
            except Exception as exc:
                problems.append(f"stream {i}: failed: {exc!r}")

    load = asyncio.gather(*(one(i) for i in range(STREAMS)))
    try:
        # both drafts holding sequences of this load
        held = await eventually(lambda: _holding(inst.http_address), timeout=60, interval=0.05,
                                what="both drafts holding sequences")
        by_id = {r.instance_id: r for r in records}
        victim_id = max(held, key=held.get)
        victim = next(p for p in procs.values() if p.pid == by_id[victim_id].pid)
        log.info("sequences per draft %s; killing %s (%s)", held, victim.name, victim_id)
        killed = time.monotonic()
        victim.kill()
        await asyncio.sleep(3.0)
        before = served[0]
        await eventually(lambda: served[0] >= before + STREAMS, timeout=60, what="a round of requests after the kill")
    finally:
        stop.set()
        await asyncio.wait_for(load, 120)
    assert not problems, problems[:5]

    # every stream speculates again after the kill (a delta of several tokens)
    gaps = []
    for i, seen in arrivals.items():
        first = next((t for t, n in seen if t > killed and n > 1), None)
        assert first is not None, f"stream {i} never speculated again after the kill"
        gaps.append(first - killed)
    log.info("after the kill every stream speculated again within %.3f s (median %.3f s)", max(gaps),
             sorted(gaps)[len(gaps) // 2])
    moved = await scalar(inst.http_address, "tandem_target_draft_sequences_moved_total")
    assert moved >= 1, "no sequence moved off the dead draft"
    verified = await per_draft(inst.http_address, "tandem_target_draft_verified_proposals_total")
    assert set(verified) == set(by_id), verified  # both drafts proposed for this target
    assert max(gaps) < 5.0, f"a stream took {max(gaps):.2f} s to speculate again"


async def _both(address: str) -> bool:
    return await scalar(address, "tandem_target_draft_streams") == 2


async def _holding(address: str) -> dict[str, float] | None:
    held = await per_draft(address, "tandem_target_draft_sequences")
    live = {d: n for d, n in held.items() if n > 0}
    return live if len(live) == 2 and sum(live.values()) >= STREAMS // 2 else None
