"""--gpu-memory-utilization on CUDA: the KV cache fills the share of the device that the weights,
activations and graphs leave, and serving a full batch stays within the share. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from runtime.messages import SamplingParams
from tests.support.tiny_models import tiny_hf_model
from workers.engine.engine import Engine, EngineConfig
from workers.engine.memory import GIB, NoMemoryForCache
from workers.engine.weights import load_model

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

SHARE = 3 * GIB  # small: the GPU check runs other tests beside this one on the same device


def test_the_kv_cache_fills_the_share_and_a_full_batch_stays_within_it(tmp_path):
    tiny_hf_model("llama", tmp_path, layers=2, vocab=256)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info()
    if free < 2 * SHARE:
        pytest.skip(f"only {free / GIB:.1f} GiB free on the device")
    utilization = SHARE / total
    model = load_model(tmp_path, device="cuda", dtype=torch.bfloat16, fused=True)
    torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_reserved()  # the weights (and the allocator's rounding)
    engine = Engine(model, EngineConfig(block_size=16, max_num_seqs=8, gpu_memory_utilization=utilization),
                    eos_token_ids=())
    assert engine.runner.graphs is not None and engine.runner.graphs.graphs  # graphs captured, inside the share
    # nearly all of the share: the tiny model's weights, activations and graphs take a few MiB
    assert SHARE - held - 256 * (1 << 20) <= engine.kv_cache_bytes <= SHARE - held
    prompts = {f"r{i}": list(range(1 + i, 200 + i)) for i in range(8)}
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    peak = torch.cuda.max_memory_reserved()
    assert peak <= utilization * total, f"peak {peak / GIB:.3f} GiB > share {SHARE / GIB:.3f} GiB"
    del engine
    torch.cuda.empty_cache()


def test_a_share_smaller_than_the_weights_is_one_clear_error(tmp_path):
    tiny_hf_model("llama", tmp_path, layers=2, vocab=256)
    model = load_model(tmp_path, device="cuda", dtype=torch.bfloat16, fused=True)
    total = torch.cuda.mem_get_info()[1]
    tiny = max(torch.cuda.memory_reserved() // 2, 1) / total
    with pytest.raises(NoMemoryForCache, match="leaves no memory for the KV cache"):
        Engine(model, EngineConfig(max_num_seqs=8, gpu_memory_utilization=tiny), eos_token_ids=())
