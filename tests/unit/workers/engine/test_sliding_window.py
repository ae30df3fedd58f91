"""Sliding-window attention in Llama-shaped families against transformers (float32, CPU): Mistral
(every layer slides) and Qwen2 with ``use_sliding_window`` (layers from ``max_window_layers`` on
slide), prompts and continuations well past the window, batched with chunked prefill. The engine
serves the whole context (no cap at the window)."""

import pytest
import torch

from runtime.messages import SamplingParams
from tests.support.tiny_models import hf_greedy
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

WINDOW = 8


def _save(family: str, path):
    import transformers as tf

    common = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, initializer_range=0.2,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None, sliding_window=WINDOW)
    torch.manual_seed(0)
    if family == "mistral":
        model = tf.MistralForCausalLM(tf.MistralConfig(**common))
    else:
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common, use_sliding_window=True, max_window_layers=1))
    model.eval().save_pretrained(path)
    return model


@pytest.mark.parametrize("family, windows", [("mistral", [WINDOW] * 3), ("qwen2", [None, WINDOW, WINDOW])])
def test_engine_greedy_equals_transformers_past_the_window(tmp_path, family, windows):
    hf = _save(family, tmp_path)
    model = load_model(tmp_path)
    assert [layer.self_attn.options.get("window") for layer in model.model.layers] == windows
    g = torch.Generator().manual_seed(3)
    prompts = {f"p{i}": torch.randint(0, 256, (n,), generator=g).tolist() for i, n in enumerate((3, 11, 20, 37, 45))}
    engine = Engine(model, EngineConfig(block_size=4, num_blocks=128, max_num_seqs=8, max_num_batched_tokens=16))
    assert engine.max_model_len == 512
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    assert engine.generate(prompts, params) == {rid: hf_greedy(hf, p, 32) for rid, p in prompts.items()}
