"""NATS killed with SIGKILL under 16 open streams and started again on its port 2 s later: every
stream ends whole (resumed or migrated with its tokens: the same text as without the blip), and
every new request after the reconnect is answered, none with a 503 ("no responders" while
subscriptions are being re-established is no verdict on a worker)."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from tests.e2e.test_frontend_openai import FrontendStack
from tests.support.servers import EtcdServer, NatsServer

pytestmark = pytest.mark.e2e

STREAMS = 16
TOKENS = 200  # 4 s at 20 ms a token: every stream spans the blip
BLIPS = 2


async def stream_text(http: httpx.AsyncClient, prompt: str, seen: list[int], index: int) -> tuple[str, str]:
    """(the streamed text, its finish reason or the error it ended with)."""
    body = {"model": "mock", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "stream": True}
    text, finish = [], ""
    async with http.stream("POST", "/v1/completions", json=body) as resp:
        if resp.status_code != 200:
            return "", f"HTTP {resp.status_code}: {(await resp.aread())[:200]!r}"
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return "".join(text), f"error: {chunk['error']}"
            for choice in chunk["choices"]:
                text.append(choice["text"])
                finish = choice["finish_reason"] or finish
            seen[index] += 1
    return "".join(text), finish


async def test_a_nats_blip_of_two_seconds_costs_no_request():
    etcd, nats_ = EtcdServer(), NatsServer()
    etcd.start()
    nats_.start()
    stack = FrontendStack((etcd, nats_))
    try:
        for i in range(2):
            stack.worker("--token-latency-ms", "20", "--num-speculative-tokens", "0", name=f"mock{i}")
        frontend = stack.frontend()
        stack.wait_healthy()
        prompts = [f"blip {i} alpha beta gamma delta" for i in range(STREAMS)]
        async with httpx.AsyncClient(base_url=stack.url, timeout=60) as http:
            # the text each stream must end with, blip or not
            answers = await asyncio.gather(*(http.post("/v1/completions", json={
                "model": "mock", "prompt": p, "max_tokens": TOKENS, "temperature": 0}) for p in prompts))
            want = {p: a.json()["choices"][0]["text"] for p, a in zip(prompts, answers)}
            for blip in range(BLIPS):
                seen = [0] * STREAMS
                streams = [asyncio.create_task(stream_text(http, p, seen, i)) for i, p in enumerate(prompts)]
                deadline = time.monotonic() + 30
                while min(seen) < 3:
                    assert time.monotonic() < deadline, seen
                    await asyncio.sleep(0.02)
                reconnects = frontend.logs().count("nats: reconnected")
                await asyncio.to_thread(nats_.stop, True)  # SIGKILL
                await asyncio.sleep(2.0)
                await asyncio.to_thread(nats_.start)  # the same port
                back = time.monotonic()
                # new requests from the moment NATS is back: none may fail once the frontend reconnected
                statuses, first_ok = [], None
                while time.monotonic() - back < 3.0:
                    resp = await http.post("/v1/completions", json={"model": "mock", "prompt": "after the blip",
                                                                    "max_tokens": 2}, timeout=30)
                    reconnected = frontend.logs().count("nats: reconnected") > reconnects
                    statuses.append((resp.status_code, reconnected))
                    if resp.status_code == 200 and first_ok is None:
                        first_ok = time.monotonic() - back
                results = await asyncio.gather(*streams)
                failed = [(p, finish) for p, (text, finish) in zip(prompts, results) if finish != "length"]
                wrong = [p for p, (text, finish) in zip(prompts, results) if finish == "length" and text != want[p]]
                after = [code for code, reconnected in statuses if reconnected and code != 200]
                print(f"blip {blip}: {STREAMS - len(failed)}/{STREAMS} streams whole, new requests answered "
                      f"{first_ok:.2f}s after NATS was back; statuses after the reconnect: "
                      f"{sorted({c for c, r in statuses if r})}")
                assert failed == [], failed
                assert wrong == []
                assert after == [], statuses
                assert first_ok is not None and first_ok < 1.0
    finally:
        stack.stop()
        etcd.cleanup()
        nats_.cleanup()
