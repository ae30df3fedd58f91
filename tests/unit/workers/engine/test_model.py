"""Our decoder against transformers' implementation on the same weights (float32, CPU)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from runtime.messages import SamplingParams
from tests.support.tiny_models import hf_greedy, tiny_hf_model, write_llama_gguf
from workers.engine.attention import AttentionMetadata, allocate_kv_cache
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def _cache(model, num_blocks=32, block_size=4):
    cfg = model.cfg
    return allocate_kv_cache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")


@pytest.mark.parametrize("family, tied", [("llama", False), ("llama3", True), ("qwen2", False), ("qwen3", True),
                                          ("mistral", False)])
def test_logits_hidden_states_and_greedy_match_transformers(tmp_path, family, tied):
    hf = tiny_hf_model(family, tmp_path, tied=tied)
    model = load_model(tmp_path)
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = hf(prompt[None], output_hidden_states=True)
        table = [5, 2, 9, 0, 7, 1, 3, 4, 8, 6]  # scattered blocks
        meta = AttentionMetadata.build([40], [40], [table], 4)
        out = model(prompt, torch.arange(40), meta, _cache(model), hidden_layers=range(3))
    assert (out.logits - ref.logits[0]).abs().max() < 1e-4
    for k in range(3):
        assert (out.hidden[k] - ref.hidden_states[k][0]).abs().max() < 1e-4
    engine = Engine(model, EngineConfig(num_blocks=64, block_size=16))
    ours = engine.generate({"a": prompt.tolist()}, GREEDY)["a"]
    assert ours == hf_greedy(hf, prompt.tolist(), 64)
    assert len(set(ours)) > 5  # a random model that does not just repeat one token


def test_prefill_chunks_and_multi_token_verify_equal_one_pass(tmp_path):
    """Prefix 17 tokens, then a 5-token verify chunk, in one batch with another sequence's decode."""
    tiny_hf_model("qwen3", tmp_path)
    model = load_model(tmp_path)
    a = torch.randint(0, 256, (22,), generator=torch.Generator().manual_seed(2))
    b = torch.randint(0, 256, (9,), generator=torch.Generator().manual_seed(3))
    kv = _cache(model)
    ta, tb = [0, 1, 2, 3, 4, 5], [10, 11, 12]
    with torch.inference_mode():
        whole = model(a, torch.arange(22), AttentionMetadata.build([22], [22], [ta], 4), _cache(model)).logits
        model(a[:17], torch.arange(17), AttentionMetadata.build([17], [17], [ta], 4), kv)
        model(b[:8], torch.arange(8), AttentionMetadata.build([8], [8], [tb], 4), kv)
        ids = torch.cat([a[17:], b[8:]])
        pos = torch.cat([torch.arange(17, 22), torch.arange(8, 9)])
        meta = AttentionMetadata.build([5, 1], [22, 9], [ta, tb], 4)
        mixed = model(ids, pos, meta, kv).logits
        whole_b = model(b, torch.arange(9), AttentionMetadata.build([9], [9], [tb], 4), _cache(model)).logits
    assert (mixed[:5] - whole[17:]).abs().max() < 1e-4
    assert (mixed[5] - whole_b[8]).abs().max() < 1e-4


def test_missing_or_misshaped_weights_raise(tmp_path):
    tiny_hf_model("llama", tmp_path)
    state = load_file(tmp_path / "model.safetensors")
    del state["model.layers.1.mlp.up_proj.weight"]
    save_file(state, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match="lacks"):
        load_model(tmp_path)
    with pytest.raises(ValueError, match="does not exist"):
        load_model(tmp_path / "nope")


def test_gguf_checkpoint_loads_through_transformers(tmp_path):
    hf = tiny_hf_model("llama", tmp_path)
    write_llama_gguf(hf, tmp_path / "tiny.gguf")
    model = load_model(tmp_path / "tiny.gguf")
    prompt = torch.arange(20) * 11
    with torch.inference_mode():
        ref = hf(prompt[None]).logits[0]
        out = model(prompt, torch.arange(20), AttentionMetadata.build([20], [20], [list(range(5))], 4), _cache(model)).logits
    assert (out - ref).abs().max() < 1e-4


@pytest.fixture(scope="module")
def smollm2():
    from workers.demo_model import demo_model_dir

    return demo_model_dir(), load_model(demo_model_dir(), max_positions=2048)


SMOL_PROMPT = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712,
               8182, 2, 198, 1, 4093, 198, 23513, 1634, 260, 3547, 282, 4649, 47, 2, 198, 1, 520, 9531, 198]


def test_smollm2_matches_transformers(smollm2):
    from transformers import AutoModelForCausalLM

    path, model = smollm2
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompt = SMOL_PROMPT
    with torch.inference_mode():
        ref = hf(torch.tensor([prompt])).logits[0]
        out = model(torch.tensor(prompt), torch.arange(len(prompt)),
                    AttentionMetadata.build([len(prompt)], [len(prompt)], [[3, 0, 1]], 16), _cache(model, 4, 16)).logits
    assert (out - ref).abs().max() < 1e-3
    engine = Engine(model, EngineConfig(num_blocks=32, block_size=16, max_model_len=512))
    assert engine.generate({"a": prompt}, GREEDY)["a"] == hf_greedy(hf, prompt, 64)


def test_smollm2_16_concurrent_greedy_requests_equal_each_alone(smollm2):
    """Batch invariance on real weights: prefill chunks mixed with decodes, 16 sequences at once."""
    _, model = smollm2
    tails = [[28, 253], [9690, 198, 2683], [4093, 198], [23513, 1634, 260], [3547, 282], [520, 9531], [19712],
             [8182, 2, 198], [1, 4093], [11173, 3365], [359, 253, 5356], [47], [4649, 47, 2], [7018, 411], [407],
             [5646, 11173]]
    prompts = {f"r{i}": SMOL_PROMPT[: 12 + i] + tail for i, tail in enumerate(tails)}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    alone = {rid: Engine(model, EngineConfig(num_blocks=16, max_model_len=256)).generate({rid: p}, params)[rid]
             for rid, p in prompts.items()}
    engine = Engine(model, EngineConfig(num_blocks=128, max_model_len=256, max_num_batched_tokens=64))
    assert engine.generate(prompts, params) == alone
