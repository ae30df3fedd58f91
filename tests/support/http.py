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
