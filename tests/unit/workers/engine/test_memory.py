"""KV cache sizing under --gpu-memory-utilization (the arithmetic; the CUDA check is in tests/gpu), and
the engine's vLLM phase timings and prefix-cache counters."""

import pytest

from runtime.messages import SamplingParams
from tests.support.tiny_models import tiny_hf_model
from workers.engine.engine import Engine, EngineConfig
from workers.engine.memory import GIB, DeviceMemory, NoMemoryForCache, kv_cache_bytes, step_activation_bytes
from workers.engine.model_runner import ModelRunner
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit


def test_the_cache_gets_the_share_less_what_the_worker_holds_and_its_steps_need():
    # vLLM's rule: 0.5 of 80 GiB, 10 GiB of weights, 2 GiB for activations and graphs: 28 GiB of KV
    memory = DeviceMemory(total=80 * GIB, free=70 * GIB, held=10 * GIB)
    assert kv_cache_bytes(memory, 0.5, 2 * GIB) == 28 * GIB
    assert kv_cache_bytes(memory, 1.0, 0) == 70 * GIB  # never more than is free
    assert kv_cache_bytes(memory, 0.9, 2 * GIB) == 60 * GIB  # 72 - 10 - 2 (68 free less the reserve is more)


def test_other_processes_on_the_device_bound_the_cache_by_what_is_free():
    # a draft worker beside the target took 50 GiB: 0.9 of 80 would be 60 GiB, but only 20 are free
    memory = DeviceMemory(total=80 * GIB, free=20 * GIB, held=10 * GIB)
    assert kv_cache_bytes(memory, 0.9, 2 * GIB) == 18 * GIB


@pytest.mark.parametrize("utilization,free,why", [(0.1, 70, "the weights and the rest this worker holds take 10.00"),
                                                   (0.9, 2, "only 2.00 GiB of the device is free")])
def test_nothing_left_for_the_cache_is_one_clear_error(utilization, free, why):
    memory = DeviceMemory(total=80 * GIB, free=free * GIB, held=10 * GIB)
    with pytest.raises(NoMemoryForCache) as exc:
        kv_cache_bytes(memory, utilization, 2 * GIB)
    assert f"--gpu-memory-utilization {utilization:g} leaves no memory for the KV cache" in str(exc.value)
    assert why in str(exc.value)


@pytest.mark.parametrize("utilization", [0, -0.1, 1.5])
def test_utilization_outside_0_1_is_refused(utilization):
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_cache_bytes(DeviceMemory(GIB, GIB, 0), utilization, 0)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        EngineConfig(gpu_memory_utilization=utilization)


def test_step_activations_grow_with_tokens_and_count_the_logits_in_float32():
    shape = dict(hidden_size=4096, intermediate_size=14336, q_size=4096, kv_size=1024, vocab_size=128256, itemsize=2)
    one = step_activation_bytes(1, 0, **shape)
    assert one == (3 * 4096 + 4096 + 2 * 1024 + 4096 + 3 * 14336) * 2
    assert step_activation_bytes(512, 0, **shape) == 512 * one
    # 64 rows of logits: the model's dtype, float32 and float32 sampling scratch
    assert step_activation_bytes(512, 64, **shape) - step_activation_bytes(512, 0, **shape) == 64 * 128256 * 10


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama", path, vocab=256)
    return load_model(path)


def test_on_the_cpu_the_utilization_leaves_the_kv_cache_gb_size(model, caplog):
    block = ModelRunner.bytes_per_block(model, 16)
    with caplog.at_level("DEBUG"):
        engine = Engine(model, EngineConfig(kv_cache_bytes=100 * block, gpu_memory_utilization=0.5), eos_token_ids=())
    assert engine.blocks.num_blocks == 100 and engine.kv_cache_bytes == 100 * block
    assert "--gpu-memory-utilization applies on CUDA" in caplog.text


def test_queue_and_prefill_times_and_prefix_cache_tokens_as_vllm_counts_them(model):
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=4), eos_token_ids=())
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    prompt = list(range(1, 22))  # 21 tokens: 5 full blocks of 4 may be cached (never the last token)
    engine.generate({"a": prompt}, params)
    engine.generate({"b": prompt}, params)
    sched = engine.scheduler
    assert sched.prefix_queries == 2 * 21
    assert sched.prefix_hits == 20  # the second request finds the first's 5 blocks
    for hist in (sched.queue_time, engine.prefill_time):
        [metric] = hist.collect()
        samples = {s.name: s.value for s in metric.samples if s.name in ("h_count", "h_sum")}
        assert samples["h_count"] == 2  # one observation per request, not per step
        assert samples["h_sum"] >= 0
