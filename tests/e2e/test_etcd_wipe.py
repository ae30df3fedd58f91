"""Discovery outages do not take live workers out of routing: etcd killed, its data wiped and started
again empty, under load, with every worker alive and reachable over NATS the whole time. The frontend
answers every request with a 200 while the workers register again."""

from __future__ import annotations

import asyncio
from collections import Counter

import httpx
import pytest

from tests.support.http import completion_load
from tests.support.procs import ManagedProcess
from tests.support.servers import EtcdServer, env_for, free_port
from tests.support.wait import eventually

pytestmark = pytest.mark.e2e


async def test_an_etcd_wipe_under_load_answers_every_request(nats_server, namespace):
    etcd = EtcdServer()
    etcd.start()
    env = env_for(etcd, nats_server, namespace)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    # A long lease: a worker refreshes (and finds its lease gone) every 8 s, so the frontend's re-read
    # of the emptied etcd (within ~3 s of its return) nearly always comes first and has entries to hold.
    procs = [ManagedProcess("workers.mock", ["--lease-ttl", "24", "--token-latency-ms", "2",
                                             "--num-speculative-tokens", "0"], env, f"mock{i}").start()
             for i in range(2)]
    frontend = ManagedProcess("frontend", ["--http-port", str(port), "--lease-ttl", "3"], env, "frontend").start()
    procs.append(frontend)
    try:
        frontend.wait_for_log("frontend ready", timeout=60)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            async def both_registered() -> bool:
                models = (await client.get("/v1/models")).json()["data"]
                return bool(models) and models[0]["instances"] == 2

            await eventually(both_registered, timeout=60, interval=0.1, what="both workers registered")
            assert (await client.post("/v1/completions", json={"model": "mock", "prompt": "hi",
                                                               "max_tokens": 2})).status_code == 200
        statuses: Counter = Counter()
        stop = asyncio.Event()
        load = [asyncio.create_task(completion_load(url, statuses, stop, "across an etcd wipe")) for _ in range(4)]
        await eventually(lambda: statuses[200] >= 20, timeout=30, what="the load being served")
        before = sum(statuses.values())
        await asyncio.to_thread(etcd.stop, True)
        etcd.wipe()
        await asyncio.sleep(1.5)  # etcd is gone: the last snapshot keeps serving
        await asyncio.to_thread(etcd.start)
        # The workers notice that their lease is gone at their next refresh (every 8 s) and register
        # again; the frontend reads the empty prefix well before that.
        await eventually(lambda: all("registering again" in proc.logs() for proc in procs[:2]), timeout=30,
                         interval=0.2, what="the workers registering again")
        await asyncio.sleep(1)  # the load goes on a while with the workers registered again
        stop.set()
        await asyncio.gather(*load)
        assert sum(statuses.values()) - before > 50, statuses
        assert set(statuses) == {200}, f"non-200 answers across the etcd wipe: {dict(statuses)}"
        # The frontend noticed (its watch retries every ≤ 2 s; the workers may have registered again first)
        await eventually(lambda: "etcd came back without its data" in frontend.logs(), timeout=15, interval=0.2,
                         what="the frontend re-reading etcd after the wipe")
    finally:
        for proc in reversed(procs):
            proc.stop(timeout=10)
        etcd.cleanup()
