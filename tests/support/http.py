"""HTTP helpers for end-to-end tests."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections import Counter

import httpx

from tests.support.wait import eventually


async def wait_http_ok(url: str, timeout: float = 60.0, interval: float = 0.2) -> None:
    """Poll ``url`` until it answers 200; :class:`~tests.support.wait.NotReached` after ``timeout`` seconds."""
    async with httpx.AsyncClient() as client:
        async def ok() -> bool:
            return (await client.get(url, timeout=2)).status_code == 200

        await eventually(ok, timeout=timeout, interval=interval, ignoring=(httpx.TransportError,),
                         what=f"{url} answering 200")


async def wait_for_model(base_url: str, model: str, timeout: float = 60.0, interval: float = 0.2) -> None:
    """Poll a frontend's ``/health`` until it lists ``model`` (a frontend is ready before any worker
    serves: readiness means it takes traffic); :class:`~tests.support.wait.NotReached` after ``timeout``
    seconds."""
    async with httpx.AsyncClient() as client:
        async def listed() -> bool:
            r = await client.get(f"{base_url}/health", timeout=2)
            return r.status_code == 200 and model in r.json().get("models", [])

        await eventually(listed, timeout=timeout, interval=interval, ignoring=(httpx.TransportError, ValueError),
                         what=f"{base_url}/health listing {model!r}")


async def completion_load(url: str, statuses: Counter, stop: asyncio.Event, prompt: str = "load",
                          max_tokens: int = 4) -> None:
    """Send ``/v1/completions`` requests one after another until ``stop``, counting each answer's
    status (or the transport error's name) in ``statuses``."""
    body = {"model": "mock", "prompt": prompt, "max_tokens": max_tokens}
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            try:
                statuses[(await client.post("/v1/completions", json=body)).status_code] += 1
            except httpx.HTTPError as exc:
                statuses[type(exc).__name__] += 1
            await asyncio.sleep(0.01)


def raw_completion(port: int, body: dict) -> socket.socket:
    """A raw socket with a small receive buffer that has POSTed ``body`` to ``/v1/completions``; the
    caller reads the answer slowly, or never (a stalled client)."""
    data = json.dumps(body).encode()
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\nContent-Length: "
                 + str(len(data)).encode() + b"\r\n\r\n" + data)
    return sock


async def good_stream(url: str, gaps: list[float], stop: asyncio.Event, max_tokens: int = 200) -> int:
    """A well-behaved streaming client: completions of ``max_tokens`` one after another until ``stop``,
    each gap between two streamed lines appended to ``gaps``; returns the streams it finished."""
    body = {"model": "mock", "prompt": "a well-behaved client", "max_tokens": max_tokens, "stream": True}
    streams = 0
    async with httpx.AsyncClient(base_url=url, timeout=30) as client:
        while not stop.is_set():
            async with client.stream("POST", "/v1/completions", json=body) as resp:
                last = None
                async for _ in resp.aiter_lines():
                    now = time.perf_counter()
                    if last is not None:
                        gaps.append(now - last)
                    last = now
            streams += 1
    return streams


def streamed_completion(url: str, model: str, prompt: str | list[int], max_tokens: int, timeout: float = 180) -> dict:
    """A greedy streamed ``/v1/completions`` of exactly ``max_tokens`` (eos ignored): its text and
    usage; any error frame fails the test."""
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    text, usage = [], None
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=timeout) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += [c.get("text", "") for c in chunk.get("choices", [])]
            usage = chunk.get("usage") or usage
    return {"text": "".join(text), "usage": usage}
