"""Priority and sessions through real processes: a frontend with the router queue over two mock
workers that admit one request each (``--max-num-seqs 1``, ``--scheduling-policy priority``), over
real etcd and NATS. Bad priority fields are 400s that reach no worker; a session's turns stay on one
worker, and after that worker is killed its next turns go on, to the other one."""

from __future__ import annotations

import re
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.test_frontend_openai import FrontendStack
from tests.support.wait import eventually_sync

pytestmark = pytest.mark.e2e

SESSION = "X-Dynamo-Session-ID"


@pytest.fixture(scope="module")
def stack(servers):
    s = FrontendStack(servers)
    for i in range(2):
        s.worker("--token-latency-ms", "15", "--num-speculative-tokens", "0", "--max-num-seqs", "1",
                 "--scheduling-policy", "priority", name=f"mock{i}")
    s.frontend("--router-mode", "kv", "--router-queue-threshold", "1.0", "--log-level", "DEBUG")
    s.wait_healthy()
    yield s
    s.stop()


def worker_ids(stack) -> dict[str, object]:
    """instance id -> its mock process."""
    out = {}
    for proc in stack.procs:
        found = re.search(r"mock worker (\S+) ready", proc.logs()) if proc.name.startswith("mock") else None
        if found:
            out[found.group(1)] = proc
    return out


def chosen(stack, request_id: str) -> str:
    frontend = next(p for p in stack.procs if p.name == "frontend")
    return eventually_sync(lambda: (re.findall(rf"request {re.escape(request_id)}-\w+: chose (\S+)", frontend.logs())
                                    or [None])[-1], what=f"the routing of {request_id}")


def test_bad_priority_fields_are_400s_in_openais_format(stack):
    bad = [({"priority": "1"}, "priority"),
           ({"nvext": {"agent_hints": {"strict_priority": 999}}}, "nvext.agent_hints.strict_priority"),
           ({"nvext": {"agent_hints": {"speculative_prefill": "yes"}}}, "nvext.agent_hints.speculative_prefill")]
    with httpx.Client(base_url=stack.url, timeout=30) as http:
        for extra, field in bad:
            resp = http.post("/v1/completions", json={"model": "mock", "prompt": "hi", "max_tokens": 2, **extra},
                             headers={"X-Request-Id": "bad-priority"})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == field and err["type"] == "invalid_request_error"
        resp = http.post("/v1/completions", json={"model": "mock", "prompt": "hi"}, headers={SESSION: "a b"})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == SESSION
    frontend = next(p for p in stack.procs if p.name == "frontend")
    routed = [line for line in frontend.logs().splitlines() if "request bad-priority" in line and ": chose " in line]
    assert routed == []  # refused before routing: no worker saw them


def test_contention_through_the_router_queue_serves_everyone(stack):
    def one(i: int) -> int:
        body = {"model": "mock", "prompt": f"contended {i}", "max_tokens": 8, "priority": i % 3,
                "nvext": {"agent_hints": {"strict_priority": i % 2, "osl": 8}}}
        return httpx.post(stack.url + "/v1/completions", json=body, timeout=60).status_code

    with ThreadPoolExecutor(8) as pool:
        assert list(pool.map(one, range(16))) == [200] * 16
    text = httpx.get(stack.url + "/metrics", timeout=10).text
    held = re.findall(r'tandem_router_queue_wait_seconds_count\{strict_priority="(\d)"\} (\S+)', text)
    assert sum(float(n) for _, n in held) >= 16  # every request passed the queue ...
    worst = [float(v) for v in re.findall(r'tandem_router_queue_max_wait_seconds\{strict_priority="\d"\} (\S+)', text)]
    assert max(worst) >= 0.05  # ... and with more requests than slots, some waited there


def test_a_session_stays_on_its_worker_and_survives_its_death(stack):
    messages = [{"role": "system", "content": "You are a coding agent. " * 12}]
    with httpx.Client(base_url=stack.url, timeout=60) as http:
        def turn(k: int) -> str:
            messages.append({"role": "user", "content": f"step {k}: edit the file"})
            resp = http.post("/v1/chat/completions", json={"model": "mock", "messages": messages, "max_tokens": 4},
                             headers={SESSION: "agent-7", "X-Request-Id": f"sess-t{k}"})
            assert resp.status_code == 200, resp.text
            messages.append({"role": "assistant", "content": resp.json()["choices"][0]["message"]["content"]})
            return chosen(stack, f"sess-t{k}")

        homes = [turn(k) for k in range(4)]
        assert len(set(homes)) == 1, homes
        workers = worker_ids(stack)
        workers[homes[0]].kill()
        after = [turn(k) for k in range(4, 8)]
    survivor = next(w for w in workers if w != homes[0])
    assert after[-3:] == [survivor] * 3, after  # (the first turn may still try the dead one, then migrate)
