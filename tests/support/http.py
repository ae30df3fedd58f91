"""HTTP helpers for end-to-end tests."""

from __future__ import annotations

import asyncio
import time

import httpx


async def wait_http_ok(url: str, timeout: float = 60.0, interval: float = 0.2) -> None:
    """Poll ``url`` until it answers 200; TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                if (await client.get(url, timeout=2)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(interval)
    raise TimeoutError(url)


async def wait_for_model(base_url: str, model: str, timeout: float = 60.0, interval: float = 0.2) -> None:
    """Poll a frontend's ``/health`` until it lists ``model`` (a frontend is ready before any worker
    serves: readiness means it takes traffic); TimeoutError after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    async with httpx.AsyncClient() as client:
        while time.monotonic() < deadline:
            try:
                r = await client.get(f"{base_url}/health", timeout=2)
                if r.status_code == 200 and model in r.json().get("models", []):
                    return
            except (httpx.TransportError, ValueError):
                pass
            await asyncio.sleep(interval)
    raise TimeoutError(f"{base_url}/health never listed {model!r}")
