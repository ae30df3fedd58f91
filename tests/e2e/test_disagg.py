"""Prefill/decode disaggregation with real processes and real NIXL transfers, on the demo model.

One prefill worker and two decode workers serve two frontends: one disaggregates every prompt
(``--disagg-min-tokens 1``), the other none (every prompt prefills on its decode worker, as in an
aggregated deployment). Greedy text must be equal between them, without speculation and with the
demo's EAGLE-3 head on the decode side. Then the faults: the prefill worker SIGKILLed and a decode
worker SIGKILLed while requests flow lose nothing and change no output.
"""

from __future__ import annotations

import asyncio
import logging

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from deploy.binaries import free_port
from tests.support.http import wait_for_model
from tests.support.procs import ManagedProcess
from tests.support.servers import env_for
from tests.support.flags import speculative
from workers.demo_model import DEMO_HEAD, DEMO_NAME, demo_model_dir

pytestmark = pytest.mark.e2e

WORDS = ("the lamp blinks twice when the hub loses its network so check the router first then hold the "
         "button for ten seconds until the light turns amber and pair it again from the app").split()
PROMPTS = [" ".join(WORDS[(7 * i) % len(WORDS):] + WORDS[: (7 * i) % len(WORDS)]) * (1 + i % 4) + f" Step {i}:"
           for i in range(8)]  # 33 to 130 tokens, every one different from its first block
MAX_TOKENS = 20


async def complete(url: str, prompt: str, max_tokens: int = MAX_TOKENS) -> str:
    async with httpx.AsyncClient(timeout=120) as http:
        resp = await http.post(f"{url}/v1/completions", json={"model": DEMO_NAME, "prompt": prompt,
                                                               "max_tokens": max_tokens, "temperature": 0})
    assert resp.status_code == 200, resp.text
    return resp.json()["choices"][0]["text"]


async def metrics(address: str, prefix: str) -> dict[tuple, float]:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"http://{address}/metrics")).text
    return {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
            for s in f.samples if s.name.startswith(prefix)}


def total(found: dict[tuple, float], name: str, **labels) -> float:
    return sum(v for k, v in found.items() if k[0] == name and all((n, x) in k[1:] for n, x in labels.items()))


def test_tandem_up_with_a_prefill_worker_disaggregates_long_prompts():
    """``tandem up --prefill-workers 1``: a prefill worker and a decode worker of the demo model; a long
    prompt is prefilled remotely and a short one on the decode worker (the default --disagg-min-tokens)."""
    from tests.support.launcher import Launcher

    up = Launcher("--prefill-workers", "1", "--draft-method", "none")
    try:
        up.wait_ready(timeout=300)
        logs = up.logs()
        assert "started prefill-0" in logs and "started target-0" in logs
        long_prompt = " ".join(PROMPTS) * 2  # about 500 tokens
        with httpx.Client(timeout=300) as http:
            for prompt in (long_prompt, "Hello!"):
                resp = http.post(f"{up.url}/v1/completions", json={"model": DEMO_NAME, "prompt": prompt,
                                                                   "max_tokens": 8, "temperature": 0})
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["completion_tokens"] == 8
            text = http.get(f"{up.url}/metrics").text
        found = {(s.name, *sorted(s.labels.items())): s.value for f in text_string_to_metric_families(text)
                 for s in f.samples if s.name.startswith("tandem_frontend_prefills")}
        assert total(found, "tandem_frontend_prefills_total", where="remote", reason="ok") == 1
        assert total(found, "tandem_frontend_prefills_total", where="local", reason="short") == 1
    finally:
        up.cleanup()


@pytest.fixture(scope="module")
def stack(servers):
    """etcd, NATS, a prefill worker, two decode workers and two frontends, in their own namespace."""
    etcd, nats_ = servers
    env = env_for(etcd, nats_, "disagg")
    procs: dict[str, ManagedProcess] = {}
    ports: dict[str, int] = {}

    def spawn(name: str, module: str, *args: str) -> ManagedProcess:
        ports[name] = free_port()
        port_flag = "--http-port" if module == "frontend" else "--health-port"
        procs[name] = ManagedProcess(module, [*args, port_flag, str(ports[name])], env, name).start()
        return procs[name]

    model = str(demo_model_dir())
    worker = ("workers.target", "--model", model, "--served-model-name", DEMO_NAME, "--threads", "1", "--num-blocks", "256", "--lease-ttl", "3",
              "--num-speculative-tokens", "3", *speculative(load_aware=False, propose_min_wait=0.3))
    spawn("prefill", *worker, "--role", "prefill")
    for i in (0, 1):
        spawn(f"decode-{i}", *worker, "--role", "decode")
    for name, min_tokens in (("disagg", "1"), ("agg", "100000")):
        spawn(name, "frontend", "--disagg-min-tokens", min_tokens, "--lease-ttl", "3")
    yield {"procs": procs, "spawn": spawn, "model": model,
           "url": lambda name: f"http://127.0.0.1:{ports[name]}", "addr": lambda name: f"127.0.0.1:{ports[name]}"}
    for proc in procs.values():
        proc.stop(timeout=10)
        logging.getLogger("tests").info("--- %s log ---\n%s", proc.name, proc.logs()[-3000:])


async def wait_ready(stack) -> None:
    for name in ("disagg", "agg"):
        await wait_for_model(stack["url"](name), DEMO_NAME, timeout=240)
    for name in ("prefill", "decode-0", "decode-1"):
        await asyncio.to_thread(stack["procs"][name].wait_for_log, "ready (", 240)


async def both(stack, prompts: list[str]) -> tuple[list[str], list[str]]:
    """Greedy texts through the disaggregating frontend (concurrently), then the aggregated one."""
    disagg = await asyncio.gather(*(complete(stack["url"]("disagg"), p) for p in prompts))
    agg = [await complete(stack["url"]("agg"), p) for p in prompts]
    return list(disagg), agg


async def decode_metrics(stack, prefix: str, name: str, **labels) -> float:
    return sum([total(await metrics(stack["addr"](d), prefix), name, **labels) for d in ("decode-0", "decode-1")
                if stack["procs"][d].alive()])


async def test_greedy_output_is_equal_disaggregated_and_aggregated(stack):
    await wait_ready(stack)
    disagg, agg = await both(stack, PROMPTS)
    assert disagg == agg
    front = await metrics(stack["addr"]("disagg"), "tandem_frontend_prefills")
    assert total(front, "tandem_frontend_prefills_total", where="remote", reason="ok") == len(PROMPTS)
    assert await decode_metrics(stack, "tandem_target_kv", "tandem_target_kv_transfer_bytes_total") > 0
    assert await decode_metrics(stack, "tandem_target_kv", "tandem_target_kv_remote_prefills_total") == len(PROMPTS)


async def spec_counts(stack) -> tuple[float, float]:
    """(drafts, accepted tokens) verified so far by the live decode workers."""
    drafts = await decode_metrics(stack, "vllm:spec_decode", "vllm:spec_decode_num_drafts_total")
    accepted = await decode_metrics(stack, "vllm:spec_decode", "vllm:spec_decode_num_accepted_tokens_total")
    return drafts, accepted


async def test_with_the_eagle3_draft_on_the_decode_side_output_and_acceptance_match(stack):
    await wait_ready(stack)
    stack["spawn"]("draft", "workers.draft", "--method", "eagle3", "--eagle-model", str(DEMO_HEAD), "--target-model",
                   stack["model"], "--served-model-name", DEMO_NAME, "--lease-ttl", "3")
    await asyncio.to_thread(stack["procs"]["draft"].wait_for_log, "draft worker", 240)
    deadline = asyncio.get_running_loop().time() + 120
    while (await spec_counts(stack))[0] == 0:  # both decode workers found the draft
        assert asyncio.get_running_loop().time() < deadline, "the decode workers never speculated"
        await asyncio.gather(*(complete(stack["url"]("agg"), p, 4) for p in PROMPTS[:4]))
    prompts = [p + " Then:" for p in PROMPTS]  # not cached anywhere yet
    start = await spec_counts(stack)
    disagg = list(await asyncio.gather(*(complete(stack["url"]("disagg"), p) for p in prompts)))
    mid = await spec_counts(stack)
    agg = list(await asyncio.gather(*(complete(stack["url"]("agg"), p) for p in prompts)))  # the same concurrency
    end = await spec_counts(stack)
    assert disagg == agg
    drafts_d, drafts_a = mid[0] - start[0], end[0] - mid[0]
    assert drafts_d > 0 and drafts_a > 0
    tau_d, tau_a = 1 + (mid[1] - start[1]) / drafts_d, 1 + (end[1] - mid[1]) / drafts_a
    logging.getLogger("tests").info("acceptance length: disaggregated %.3f, aggregated %.3f", tau_d, tau_a)
    assert abs(tau_d - tau_a) <= 0.1 * tau_a  # the bench measures it closely (bench/disagg_bench.py)


async def load(url: str, prompts: list[str], expected: dict[str, str], results: list, stop: asyncio.Event,
               max_tokens: int) -> None:
    i = 0
    while not stop.is_set():
        p = prompts[i % len(prompts)]
        try:
            results.append(await complete(url, p, max_tokens) == expected[p])
        except AssertionError as exc:  # a non-200: counted as lost
            logging.getLogger("tests").error("request failed: %s", exc)
            results.append(None)
        i += 1


async def run_through(stack, kill: str, max_tokens: int, warm: int) -> list:
    """Three clients loop over fresh prompts on the disaggregating frontend; ``kill`` is SIGKILLed once
    ``warm`` requests are done; 12 more complete. Returns each request's outcome (True: equal text)."""
    prompts = [p + f" Case {kill}:" for p in PROMPTS]
    expected = {p: await complete(stack["url"]("agg"), p, max_tokens) for p in prompts}
    for p in prompts:  # the aggregated run cached them on a decode worker: vary the text past its blocks
        expected[p + " Again."] = await complete(stack["url"]("agg"), p + " Again.", max_tokens)
    fresh = [p + " Again." for p in prompts]
    results: list = []
    stop = asyncio.Event()
    clients = [asyncio.create_task(load(stack["url"]("disagg"), fresh[k::3], expected, results, stop, max_tokens))
               for k in range(3)]
    while len(results) < warm:
        await asyncio.sleep(0.05)
    stack["procs"][kill].kill()
    killed_at = len(results)
    while len(results) < killed_at + 12:
        await asyncio.sleep(0.1)
    stop.set()
    await asyncio.gather(*clients)
    return results


async def test_a_decode_worker_killed_after_handovers_loses_nothing(stack):
    await wait_ready(stack)
    results = await run_through(stack, "decode-0", max_tokens=40, warm=3)
    assert None not in results and all(results), results
    front = await metrics(stack["addr"]("disagg"), "tandem_frontend_migrations")
    assert total(front, "tandem_frontend_migrations_total") >= 1


async def test_the_prefill_worker_killed_under_load_loses_nothing(stack):
    await wait_ready_after_kill(stack)
    results = await run_through(stack, "prefill", max_tokens=12, warm=4)
    assert None not in results and all(results), results
    front = await metrics(stack["addr"]("disagg"), "tandem_frontend_prefills")
    assert total(front, "tandem_frontend_prefills_total", where="remote", reason="ok") > 0


async def wait_ready_after_kill(stack) -> None:
    for name in ("disagg", "agg"):
        await wait_for_model(stack["url"](name), DEMO_NAME, timeout=60)
