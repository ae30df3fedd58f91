"""The BGMV LoRA kernels against the torch path (CPU: Triton's interpreter on tiny shapes)."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"

from workers.engine.triton_lora import lora_bgmv  # noqa: E402

pytestmark = pytest.mark.unit
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n_in, n_out, rank", [(64, 96, 16), (40, 70, 24)])
def test_bgmv_adds_each_tokens_adapter_delta(n_in, n_out, rank):
    gen = torch.Generator().manual_seed(0)
    slots_n, tokens = 3, 7
    x = torch.randn(tokens, n_in, generator=gen).to(DEVICE)
    a = torch.randn(slots_n, rank, n_in, generator=gen).to(DEVICE)
    b = torch.randn(slots_n, n_out, rank, generator=gen).to(DEVICE)
    y = torch.randn(tokens, n_out, generator=gen).to(DEVICE)
    slots = torch.tensor([0, 2, -1, 2, 1, -1, 0], dtype=torch.int32, device=DEVICE)
    want = y.clone()
    for t, s in enumerate(slots.tolist()):
        if s >= 0:
            want[t] += b[s] @ (a[s] @ x[t])
    got = lora_bgmv(x, y.clone(), a, b, slots)
    assert torch.allclose(got, want, atol=1e-3, rtol=1e-4)
    assert torch.equal(got[2], y[2]) and torch.equal(got[5], y[5])  # no adapter: untouched


def test_engine_mixed_batch_with_the_kernels_equals_the_torch_path(tmp_path):
    """A tiny model serving the base and two adapters in one batch: the kernels (interpreted on
    CPU) give the torch path's greedy tokens."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    from runtime.messages import SamplingParams
    from tests.support.tiny_models import tiny_hf_model
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.lora import LoraManager
    from workers.engine.weights import load_model

    tiny_hf_model("llama", tmp_path / "base", vocab=64, layers=1)
    base = tf.AutoModelForCausalLM.from_pretrained(str(tmp_path / "base"))
    for i in range(2):
        torch.manual_seed(i)
        peft = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"],
                                               init_lora_weights=False))
        peft.save_pretrained(str(tmp_path / f"a{i}"))
        base = peft.unload()
    prompts = {"p0": ([3, 9, 4, 1, 7], None), "p1": ([3, 9, 4, 1, 7], "a0"), "p2": ([5, 2, 8], "a1")}
    params = SamplingParams(temperature=0, max_tokens=3, ignore_eos=True)
    results = []
    for kernel in ("torch", "triton"):
        model = load_model(tmp_path / "base", device=DEVICE)
        engine = Engine(model, EngineConfig(num_blocks=32, block_size=4), eos_token_ids=(),
                        lora=LoraManager(model, 2, 4, kernel=kernel))
        for i in range(2):
            engine.load_lora(f"a{i}", str(tmp_path / f"a{i}"))
        for rid, (p, name) in prompts.items():
            engine.add_request(rid, p, params, lora=name)
        out = {rid: [] for rid in prompts}
        while engine.has_work():
            for rid, delta in engine.step():
                out[rid].extend(delta.token_ids)
        results.append(out)
    assert results[0] == results[1]
    assert len({tuple(v) for v in results[0].values()}) > 1
