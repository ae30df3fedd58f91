"""The frontend app in-process (uvicorn on a free port) over real etcd and NATS, with an in-process
mock worker on a runtime of its own: the in-flight limit (429 with Retry-After), and the router's
bookkeeping after every way a request can end (each selection released exactly once)."""

from __future__ import annotations

import asyncio
import contextlib

import httpx
import pytest

from frontend.app import Frontend
from frontend.config import FrontendConfig
from frontend.server import HttpServer
from runtime import Runtime
from runtime.messages import GenerateRequest, ModelCard
from tests.support.metrics import sample_value
from tests.support.wait import eventually
from workers.demo_model import demo_tokenizer_dir
from workers.mock import MockWorker

pytestmark = pytest.mark.integration

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "alpha beta gamma delta"}]}


@contextlib.asynccontextmanager
async def stack(rt, runtime_config, **config):
    async with Runtime.connect(runtime_config) as wrt:
        worker = MockWorker(wrt.instance_id, wrt.publish, token_latency=0.02)
        await worker.start()
        await wrt.register_model(ModelCard("mock", tokenizer_path=str(demo_tokenizer_dir())))
        await wrt.serve("target", "generate", worker.generate, GenerateRequest, role="target", model="mock")
        async with Frontend.start(rt, FrontendConfig(http_port=0, **config)) as frontend:
            server = await HttpServer(frontend.app).start()
            async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
                async def healthy() -> bool:
                    return (await http.get("/health")).status_code == 200

                await eventually(healthy, timeout=5, what="the frontend healthy")
                assert (await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 1})).status_code == 200
                yield frontend, worker, http
            await server.stop()
        await worker.stop()


async def read_some(http, body: dict, lines: int) -> None:
    async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        it = resp.aiter_lines()
        for _ in range(lines):
            await anext(it)


async def test_requests_over_the_inflight_limit_get_429_with_retry_after(rt, runtime_config):
    async with stack(rt, runtime_config, max_inflight=2) as (frontend, _worker, http):
        slow = [asyncio.create_task(http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 40})) for _ in range(2)]
        await eventually(lambda: frontend.inflight >= 2, interval=0.01, what="two requests in flight")
        over = await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})
        assert over.status_code == 429 and over.headers["retry-after"] == "1"
        assert over.json()["error"]["code"] == "overloaded"
        assert [r.status_code for r in await asyncio.gather(*slow)] == [200, 200]
        assert (await http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 2})).status_code == 200
        assert frontend.inflight == 0


async def test_every_ending_releases_its_router_selection_once(rt, runtime_config):
    async with stack(rt, runtime_config) as (frontend, worker, http):
        router, selected, released = frontend.router, [], []
        select, release = router.select, router.release

        async def counting_select(*args, **kwargs):
            selected.append(await select(*args, **kwargs))
            return selected[-1]

        def counting_release(selection):
            released.append(selection)
            release(selection)

        router.select, router.release = counting_select, counting_release
        endings = [
            http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5}),  # finishes
            http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 30, "stop": " gamma"}),  # stop string
            http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 5, "n": 3}),  # three choices
            http.post("/v1/completions", json={"model": "mock", "prompt": "x", "max_tokens": 5, "n": 2, "stream": True,
                                               "stop": "x"}),
            read_some(http, {**CHAT, "max_tokens": 200, "stream": True}, 3),  # client leaves mid-stream
            http.post("/v1/chat/completions", json={**CHAT, "max_tokens": 10**6}),  # rejected before routing
        ]
        await asyncio.gather(*endings)
        # the disconnect's cleanup runs after the client is gone
        await eventually(lambda: not frontend.router.in_flight and worker.running == 0, timeout=5,
                         what=lambda: f"all released (router: {frontend.router.in_flight}, worker: {worker.running})")
        assert frontend.router.in_flight == {}
        assert len(selected) == 1 + 1 + 3 + 2 + 1
        assert sorted(s.ticket for s in released) == sorted(s.ticket for s in selected)  # each once
        assert worker.running == 0 and worker.cancelled >= 1
        assert frontend.inflight == 0
        assert sample_value(frontend.metrics.render().decode(), "tandem_frontend_inflight_requests", model="mock") == 0
