"""The target worker's handler in-process: engine thread ↔ asyncio bridge, cancellation, errors."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import pytest

from runtime.errors import InvalidRequest
from runtime.events import TOPIC_KV
from runtime.messages import GenerateRequest, KvEventKind, SamplingParams, TokenDelta
from tests.unit.workers.engine.helpers import tiny_hf_model
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model
from workers.target.metrics import TargetCollector
from workers.target.worker import TargetWorker, merge_deltas

pytestmark = pytest.mark.unit


@dataclass
class Ctx:
    request_id: str


@pytest.fixture(autouse=True)
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)  # see tests/unit/workers/engine/conftest.py
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    tiny_hf_model("llama", path)
    return load_model(path)


async def test_generate_streams_engine_tokens_and_cancel_frees_blocks(model):
    published = []

    async def publish(topic, event):
        published.append((topic, event))

    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4))
    worker = TargetWorker(engine, "w1", publish, "tiny", load_interval=0.05)
    await worker.start()
    try:
        prompt = list(range(10, 30))
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        expected = Engine(model, EngineConfig(num_blocks=64, block_size=4)).generate({"a": prompt}, params)["a"]
        deltas = [d async for d in worker.generate(GenerateRequest(prompt, params), Ctx("r1"))]
        assert [t for d in deltas for t in d.token_ids] == expected
        assert deltas[-1].finish_reason == "length" and deltas[-1].usage.completion_tokens == 12

        with pytest.raises(InvalidRequest) as err:
            [d async for d in worker.generate(GenerateRequest(prompt, params, model="other"), Ctx("r2"))]
        assert err.value.field == "model"

        long = worker.generate(GenerateRequest(prompt, SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)),
                               Ctx("r3"))
        long_tokens = (await long.__anext__()).token_ids
        await long.aclose()
        for _ in range(100):
            if engine.blocks.num_free_blocks == 64 and not engine.seqs:
                break
            await asyncio.sleep(0.02)
        assert engine.blocks.num_free_blocks == 64 and not engine.seqs and worker.cancelled == 1
        await asyncio.sleep(0.1)
        kinds = [e.kind for topic, e in published if topic == TOPIC_KV]
        assert kinds[0] == KvEventKind.CLEARED and KvEventKind.STORED in kinds
        assert any(topic != TOPIC_KV for topic, _ in published)  # load events
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for m in TargetCollector(worker, "tiny").collect() for s in m.samples}
        assert samples[("tandem_target_generated_tokens_total", (("model", "tiny"),))] == 12 + len(long_tokens)
        assert samples[("tandem_target_requests_finished_total", (("model", "tiny"), ("reason", "cancelled")))] == 1
        assert samples[("tandem_target_kv_blocks_free", (("model", "tiny"),))] == 64
    finally:
        await worker.stop()


def test_merge_deltas_keeps_order_and_the_last_finish():
    merged = merge_deltas([TokenDelta([1], [-0.1]), TokenDelta([2, 3], [-0.2, -0.3], finish_reason="stop")])
    assert merged.token_ids == [1, 2, 3] and merged.logprobs == [-0.1, -0.2, -0.3] and merged.finish_reason == "stop"


@pytest.mark.parametrize("kwargs, message", [
    ({"model": "/nonexistent"}, "does not exist"),
    ({"served_model_name": ""}, "name"),
    ({"dtype": "int8"}, "dtype"),
    ({"attention": "flash"}, "attention"),
    ({"attention": "triton", "device": "cpu"}, "cuda"),
    ({"threads": 0}, "threads"),
])
def test_target_config_rejects_bad_flags(tmp_path, monkeypatch, kwargs, message):
    from workers.target.__main__ import TargetConfig

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=message):
        TargetConfig(**{"model": str(tmp_path), "served_model_name": "m", **kwargs})
