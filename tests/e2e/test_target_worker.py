"""The real target worker process on a tiny random model: same tokens as the engine in-process,
model card, KV events, prefix hits, typed errors, and cancellation that frees the blocks."""

from __future__ import annotations

import asyncio
import signal

import httpx
import pytest

from runtime.errors import InvalidRequest
from runtime.events import TOPIC_KV, TOPIC_KV_DUMP, TOPIC_LOAD
from runtime.kv_hash import block_hashes
from runtime.messages import (
    GenerateRequest,
    KvDumpRequest,
    KvEvent,
    KvEventKind,
    LoadEvent,
    SamplingParams,
    TokenDelta,
)
from runtime.request_plane import collect
from tests.support.tiny_models import tiny_hf_model
from tests.support.wait import eventually
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.e2e

BLOCKS, BLOCK = 96, 4
PROMPTS = [[(7 * i + 3 * j) % 256 for j in range(10 + 5 * i)] for i in range(4)]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-target")
    tiny_hf_model("qwen2", path)
    return path


def _tokens(deltas: list[TokenDelta]) -> list[int]:
    return [t for d in deltas for t in d.token_ids]


async def test_target_process_serves_generate_like_the_engine(rt, spawn, model_dir, child_env):
    kv_events: list[KvEvent] = []
    await rt.subscribe(TOPIC_KV, KvEvent, kv_events.append)
    loads: list[LoadEvent] = []
    await rt.subscribe(TOPIC_LOAD, LoadEvent, loads.append)
    proc = spawn("workers.target", "--model", str(model_dir), "--served-model-name", "tiny", "--num-blocks", str(BLOCKS),
          "--block-size", str(BLOCK), "--max-model-len", "384", "--threads", "1",
          "--lease-ttl", "3", "--health-port", "0", env={**child_env, "TANDEM_LOAD_INTERVAL": "0.2"})
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=90)
    assert inst.model == "tiny" and inst.role == "target"
    cards = await rt.models()
    await cards.wait_for(lambda c: any(card.instance_id == inst.instance_id for card in c.values()), 5)
    card = next(c for c in cards.values() if c.instance_id == inst.instance_id)
    assert (card.name, card.role, card.kv_block_size, card.context_length) == ("tiny", "target", BLOCK, 384)
    assert card.tokenizer_path == str(model_dir)

    engine = Engine(load_model(model_dir), EngineConfig(num_blocks=BLOCKS, block_size=BLOCK))
    expected = engine.generate({str(i): p for i, p in enumerate(PROMPTS)}, GREEDY)

    streams = [await client.call(inst.instance_id, GenerateRequest(p, GREEDY, model="tiny"), TokenDelta) for p in PROMPTS]
    results = await asyncio.gather(*(collect(s) for s in streams))
    for i, deltas in enumerate(results):
        assert _tokens(deltas) == expected[str(i)]
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 20
    # the same prompt again hits the prefix cache
    again = await collect(await client.call(inst.instance_id, GenerateRequest(PROMPTS[3], GREEDY), TokenDelta))
    assert _tokens(again) == expected["3"]
    assert again[-1].usage.cached_tokens == (len(PROMPTS[3]) - 1) // BLOCK * BLOCK
    stored = {h for e in kv_events if e.kind == KvEventKind.STORED for h in e.block_hashes}
    assert set(block_hashes(PROMPTS[3], BLOCK)) <= stored
    assert kv_events[0].kind == KvEventKind.CLEARED and all(e.worker_id == inst.instance_id for e in kv_events)
    # a router that lost track asks for a dump: the whole cache comes back as stored events
    kv_events.clear()
    await rt.publish(TOPIC_KV_DUMP, KvDumpRequest("test"))
    await eventually(lambda: all(set(block_hashes(p, BLOCK)) <= {h for e in kv_events for h in e.block_hashes}
                                 for p in PROMPTS), timeout=5, interval=0.1, what="the dump's stored events")
    assert all(e.kind == KvEventKind.STORED and len(e.block_hashes) == 1 for e in kv_events)

    with pytest.raises(InvalidRequest) as err:
        await collect(await client.call(inst.instance_id, GenerateRequest(PROMPTS[0], SamplingParams(top_p=1.5)), TokenDelta))
    assert err.value.field == "top_p"
    with pytest.raises(InvalidRequest) as err:
        await collect(await client.call(inst.instance_id, GenerateRequest([1] * 400, SamplingParams()), TokenDelta))
    assert err.value.field == "prompt"

    # cancellation: leave a long request early; its blocks come back
    long = GenerateRequest(PROMPTS[2], SamplingParams(temperature=0, max_tokens=300, ignore_eos=True))
    stream = await client.call(inst.instance_id, long, TokenDelta)
    async with stream:
        first = await stream.__anext__()
        assert first.token_ids
    loads.clear()
    await eventually(lambda: loads and loads[-1].running == 0 and loads[-1].free_blocks == BLOCKS, timeout=10,
                     interval=0.1, what=lambda: f"a load report with every block free (last: {loads[-1:]})")
    assert loads and loads[-1].running == 0 and loads[-1].free_blocks == loads[-1].total_blocks == BLOCKS
    await asyncio.to_thread(proc.wait_for_log, "cancelled by the client", 5)
    async with httpx.AsyncClient() as http:
        metrics = (await http.get(f"http://{inst.http_address}/metrics")).text
    assert f'tandem_target_kv_blocks_free{{model="tiny"}} {float(BLOCKS)}' in metrics
    assert 'tandem_target_generated_tokens_total{model="tiny"}' in metrics
    assert 'tandem_target_requests_finished_total{model="tiny",reason="cancelled"} 1.0' in metrics
    assert 'tandem_target_requests_finished_total{model="tiny",reason="length"} 5.0' in metrics


async def test_default_model_is_the_demo_smollm2(rt, spawn):
    from workers.demo_model import demo_model_dir

    proc = spawn("workers.target", "--num-blocks", "64", "--max-model-len", "512", "--threads", "1", "--lease-ttl", "3")
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=90)
    cards = await rt.models()
    await cards.wait_for(lambda c: any(card.instance_id == inst.instance_id for card in c.values()), 5)
    card = next(c for c in cards.values() if c.instance_id == inst.instance_id)
    assert card.name == inst.model == demo_model_dir().name
    assert card.tokenizer_path == str(demo_model_dir()) and card.eos_token_ids == [2]
    assert "im_start" in card.chat_template and card.context_length == 512
    prompt = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 2, 198, 1, 4093, 198, 22503, 2, 198, 1, 520]
    deltas = await collect(await client.call(inst.instance_id, GenerateRequest(prompt, SamplingParams(
        temperature=0, max_tokens=4, logprobs=2)), TokenDelta))
    assert len(_tokens(deltas)) == 4 or deltas[-1].finish_reason == "stop"
    assert all(d.logprobs is not None and len(d.top_logprobs) == len(d.token_ids) for d in deltas)
    # SIGTERM while a request streams: deregistered at once, the stream still completes, exit 0
    stream = await client.call(inst.instance_id, GenerateRequest(prompt, SamplingParams(
        temperature=0, max_tokens=40, ignore_eos=True)), TokenDelta)
    first = await stream.__anext__()
    proc.signal(signal.SIGTERM)
    rest = [d async for d in stream]
    assert len(_tokens([first] + rest)) == 40 and rest[-1].finish_reason == "length"
    assert await asyncio.to_thread(proc.wait, 20) == 0
    assert "draining" in proc.logs()
