"""Next-turn prefill (``nvext.agent_hints.speculative_prefill``) through real processes: a frontend and
a target worker on a tiny random model with the demo model's tokenizer and chat template, over real
etcd and NATS; two such stacks, one sent the hint and one not, the same conversation to both.

With the hint, once the turn's background prefill is done, the next turn's prompt is a prefix-cache
hit up to the last whole block of the turn's context (prompt, reply, end of turn). Without it the
hit stops at the last whole block the turn itself computed (the engine caches generated tokens'
blocks too; the end-of-turn marker and the last token never ran): here 112 against 116 tokens.
The next turn's output is the same either way (greedy)."""

from __future__ import annotations

import re
import shutil
import uuid

import httpx
import pytest

from tests.support.procs import ManagedProcess
from tests.support.servers import env_for, free_port
from tests.support.tiny_models import tiny_hf_model
from tests.support.wait import eventually_sync

pytestmark = pytest.mark.e2e

BLOCK = 4
SYSTEM = {"role": "system", "content": "You are a support agent for a smart lamp. " * 6}
USER = {"role": "user", "content": "The lamp blinks twice and then turns off. What should I check first?"}
TOOL = {"role": "user", "content": "Tool output: firmware 2.1.4, hub offline since 09:12, signal -81 dBm."}
HINT = {"nvext": {"agent_hints": {"speculative_prefill": True}}}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from workers.demo_model import demo_model_dir

    path = tmp_path_factory.mktemp("next-turn")
    tiny_hf_model("llama", path, vocab=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir() / name, path / name)
    return path


@pytest.fixture(scope="module")
def stacks(servers, model_dir):
    """Two stacks of (target worker, frontend), each in a namespace of its own: base urls."""
    procs, urls = [], []
    try:
        for k in range(2):
            env = env_for(*servers, "n" + uuid.uuid4().hex[:10])
            port = free_port()
            procs.append(ManagedProcess("workers.target", [
                "--model", str(model_dir), "--served-model-name", "tiny", "--num-blocks", "512", "--block-size",
                str(BLOCK), "--max-model-len", "1024", "--threads", "1", "--lease-ttl", "3", "--num-speculative-tokens",
                "0", "--health-port", "0"], env, f"target{k}").start())
            procs.append(ManagedProcess("frontend", ["--http-port", str(port), "--lease-ttl", "3"], env,
                                        f"frontend{k}").start())
            urls.append(f"http://127.0.0.1:{port}")
        for proc in procs:
            proc.wait_for_log("target worker" if proc.name.startswith("target") else "frontend ready", 120)
        for url in urls:
            eventually_sync(lambda: "tiny" in httpx.get(url + "/health", timeout=5).json()["models"], timeout=60,
                            what="the model served", ignoring=(httpx.HTTPError,))
        yield urls
    finally:
        for proc in reversed(procs):
            proc.stop(timeout=10)


def chat(http: httpx.Client, messages: list[dict], **extra) -> dict:
    resp = http.post("/v1/chat/completions", json={"model": "tiny", "messages": messages, "max_tokens": 24,
                                                   "temperature": 0, "ignore_eos": True, **extra},
                     headers={"X-Dynamo-Session-ID": "lamp-1"})
    assert resp.status_code == 200, resp.text
    return resp.json()


def next_turn_counts(http: httpx.Client) -> dict[str, float]:
    text = http.get("/metrics").text
    return {k: float(v) for k, v in re.findall(r'tandem_frontend_next_turn_prefills_total\{outcome="(\w+)"\} (\S+)', text)}


def test_the_next_turn_hits_the_prefix_cache_with_the_hint_and_not_without(stacks):
    results = {}
    for url, hinted in zip(stacks, (True, False)):
        with httpx.Client(base_url=url, timeout=120) as http:
            first = chat(http, [SYSTEM, USER], **(HINT if hinted else {}))
            reply = first["choices"][0]["message"]
            context = http.post("/tokenize", json={"model": "tiny", "messages": [SYSTEM, USER, reply],
                                                   "add_generation_prompt": False}).json()["count"]
            if hinted:
                eventually_sync(lambda: next_turn_counts(http).get("prefilled") == 1, timeout=60,
                                what=lambda: f"the next-turn prefill, counts {next_turn_counts(http)}")
            else:
                assert next_turn_counts(http) == {"started": 0, "prefilled": 0, "dropped": 0}
            second = chat(http, [SYSTEM, USER, reply, TOOL])
            results[hinted] = (first["usage"], second["usage"], second["choices"][0]["message"]["content"],
                               reply["content"], context)
    with_hint, without = results[True], results[False]
    assert with_hint[3] == without[3] and with_hint[2] == without[2]  # the same replies, both turns (greedy)
    context = with_hint[4]
    assert context > with_hint[0]["prompt_tokens"] + 20  # the context holds the 24-token reply
    assert with_hint[1]["prompt_tokens_details"]["cached_tokens"] == context // BLOCK * BLOCK
    assert without[1]["prompt_tokens_details"]["cached_tokens"] < context // BLOCK * BLOCK
