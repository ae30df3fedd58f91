"""Model config parsing from Hugging Face config dicts (transformers 4.x and 5.x key styles)."""

import pytest

from workers.engine.config import ModelConfig
from workers.engine.engine import EngineConfig

pytestmark = pytest.mark.unit

BASE = {"vocab_size": 100, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2}


def test_llama3_rope_scaling_legacy_keys():
    cfg = ModelConfig.from_dict({**BASE, "model_type": "llama", "rope_theta": 500000.0, "rope_scaling": {
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}, "eos_token_id": [1, 2]})
    assert cfg.rope.rope_type == "llama3" and cfg.rope.theta == 500000.0 and cfg.rope.factor == 8.0
    assert cfg.head_dim == 16 and cfg.num_kv_heads == 2 and cfg.eos_token_ids == (1, 2)


def test_rope_parameters_key_and_families():
    cfg = ModelConfig.from_dict({**BASE, "model_type": "qwen2", "rope_parameters": {"rope_theta": 1e6, "rope_type": "default"},
                                 "sliding_window": 4096, "use_sliding_window": False})
    assert cfg.qkv_bias and not cfg.o_bias and not cfg.qk_norm and cfg.rope.theta == 1e6 and cfg.sliding_window is None
    q3 = ModelConfig.from_dict({**BASE, "model_type": "qwen3", "head_dim": 32})
    assert q3.qk_norm and q3.head_dim == 32 and not q3.qkv_bias
    mistral = ModelConfig.from_dict({**BASE, "model_type": "mistral", "sliding_window": 4096})
    assert mistral.sliding_window == 4096


@pytest.mark.parametrize("change, message", [
    ({"model_type": "gpt2"}, "model_type"),
    ({"model_type": "llama", "num_key_value_heads": 3}, "multiple"),
    ({"model_type": "llama", "hidden_act": "gelu"}, "hidden_act"),
    ({"model_type": "llama", "rope_scaling": {"rope_type": "longrope", "factor": 4.0}}, "rope type"),
])
def test_unsupported_configs_raise_value_error(change, message):
    with pytest.raises(ValueError, match=message):
        ModelConfig.from_dict({**BASE, **change})


@pytest.mark.parametrize("kwargs", [{"block_size": 12}, {"num_blocks": 0}, {"max_num_seqs": 0}, {"max_model_len": -1}])
def test_engine_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        EngineConfig(**kwargs)


def test_from_dir_merges_generation_config_eos_ids(tmp_path):
    import json

    (tmp_path / "config.json").write_text(json.dumps({**BASE, "model_type": "llama", "eos_token_id": 5}))
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 7]}))
    assert ModelConfig.from_dir(tmp_path).eos_token_ids == (5, 7)
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig.from_dir(tmp_path / "missing")
