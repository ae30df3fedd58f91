"""The target worker's handler in-process: engine thread ↔ asyncio bridge, cancellation, errors."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from runtime.errors import InvalidRequest
from runtime.events import TOPIC_KV
from runtime.messages import GenerateRequest, KvEventKind, SamplingParams, TokenDelta
from tests.support.wait import eventually
from workers.engine.engine import Engine, EngineConfig
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
        await eventually(lambda: engine.blocks.num_free_blocks == 64 and not engine.seqs, timeout=2, interval=0.02,
                         what="the left request's blocks back")
        assert worker.cancelled == 1

        def kv_and_load() -> bool:
            kinds = [e.kind for topic, e in published if topic == TOPIC_KV]
            return KvEventKind.STORED in kinds and any(topic != TOPIC_KV for topic, _ in published)

        await eventually(kv_and_load, timeout=2, interval=0.02, what="KV events and load events published")
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


async def test_vllm_metric_names_and_its_spec_decode_promql(model):
    """vLLM's metric names and labels, and the PromQL from vLLM's docs evaluated on two scrapes."""
    from prometheus_client import CollectorRegistry, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from runtime.spec_stats import SpecCounters
    from workers.engine.engine import Engine

    async def publish(topic, event):
        pass

    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4))
    worker = TargetWorker(engine, "w1", publish, "tiny", load_interval=0.05)
    registry = CollectorRegistry()
    registry.register(TargetCollector(worker, "tiny"))

    def scrape() -> dict:
        out = {}
        for family in text_string_to_metric_families(generate_latest(registry).decode()):
            for sample in family.samples:
                out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return out

    await worker.start()
    try:
        params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        [d async for d in worker.generate(GenerateRequest(list(range(10, 20)), params), Ctx("r1"))]
        engine.counters["d1"] = SpecCounters()
        engine.counters["d1"].observe_draft(4, 2)
        first = scrape()
        engine.counters["d1"].observe_draft(4, 4)
        engine.counters["d1"].observe_draft(4, 0)
        engine.counters["d2"] = SpecCounters()
        engine.counters["d2"].observe_draft(2, 1)
        second = scrape()
    finally:
        await worker.stop()
    lab = (("engine", "0"), ("model_name", "tiny"))
    assert first[("vllm:generation_tokens_total", lab)] == 6 and first[("vllm:prompt_tokens_total", lab)] == 10
    assert first[("vllm:num_requests_running", lab)] == 0 and 0 <= first[("vllm:kv_cache_usage_perc", lab)] <= 1
    assert first[("vllm:time_to_first_token_seconds_count", lab)] == 1
    assert first[("vllm:inter_token_latency_seconds_count", lab)] == 5
    assert first[("vllm:e2e_request_latency_seconds_count", lab)] == 1

    def increase(name: str) -> float:
        return second[(name, lab)] - first[(name, lab)]

    # rate(accepted) / rate(draft tokens), and 1 + rate(accepted) / rate(drafts), over the window
    assert increase("vllm:spec_decode_num_accepted_tokens_total") / increase(
        "vllm:spec_decode_num_draft_tokens_total") == pytest.approx(5 / 10)
    assert 1 + increase("vllm:spec_decode_num_accepted_tokens_total") / increase(
        "vllm:spec_decode_num_drafts_total") == pytest.approx(1 + 5 / 3)
    assert second[("vllm:spec_decode_num_accepted_tokens_per_pos_total", (*lab, ("position", "0")))] == 3


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
    ({"kv_offload": {"host_gb": -1}}, "host_gb"),
    ({"kv_offload": {"disk_dir": "/somewhere"}}, "needs a host tier"),
    ({"kv_offload": {"host_gb": 1}, "enable_prefix_caching": False}, "prefix caching"),
    ({"gguf_quantized": True}, "needs a .gguf --model"),
    ({"spec": {"propose_min_wait": 3}}, "'propose_min_wait' must be at most 'propose_timeout'"),
    ({"spec": {"seam": "staged"}}, "seam"),
    ({"max_num_seqs": 0}, "--max-num-seqs"),
])
def test_target_config_rejects_bad_flags(tmp_path, monkeypatch, kwargs, message):
    from runtime.settings import build
    from workers.engine.target_config import TargetConfig
    from workers.target.__main__ import GROUP_FLAGS

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ValueError, match=message) as caught:
        build(TargetConfig, flags=GROUP_FLAGS, **{"model": str(tmp_path), "served_model_name": "m", **kwargs})
    assert "\n" not in str(caught.value)  # one line, as a worker prints it before it exits
