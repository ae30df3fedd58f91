"""The demo tokenizer's files come from the GGUF alone: the same bytes whatever transformers is
installed (none at all here), the pipeline SmolLM2 ships, and the ids every reader agrees on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from runtime.grammar_tokenizer import PROBE

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    from workers.demo_model import demo_tokenizer_dir

    try:
        return demo_tokenizer_dir()
    except FileNotFoundError:  # a machine without the demo model's package (the GPU check)
        pytest.skip("SmolLM2's tokenizer is not installed")


def test_the_files_are_written_without_transformers(demo_dir, tmp_path):
    code = ("import sys; sys.modules['transformers'] = None\n"  # any import of it fails
            "from workers.demo_model import gguf_path\n"
            "from workers.gguf_tokenizer import write_tokenizer_files\n"
            f"write_tokenizer_files(gguf_path(), {str(tmp_path)!r})\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, env=env, timeout=120)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (tmp_path / name).read_bytes() == (demo_dir / name).read_bytes(), name


def test_the_pipeline_is_gpt2_byte_level_as_smollm2_ships_it(demo_dir):
    data = json.loads((demo_dir / "tokenizer.json").read_text())
    assert data["normalizer"] is None
    assert data["pre_tokenizer"] == {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert data["decoder"] == {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    assert not data["model"]["byte_fallback"] and data["model"]["unk_token"] is None
    assert len(data["model"]["vocab"]) == 49152 and [t["content"] for t in data["added_tokens"][:3]] == \
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def test_transformers_reads_the_ids_the_gguf_names(demo_dir):
    from frontend.tokenizer import Tokenizer

    tok = Tokenizer.load(str(demo_dir))
    assert tok.eos_token_ids == (2,) and [tok.backend.token_to_id(tok.special_tokens[k]) for k in ("bos_token", "pad_token")] == [1, 2]
    ids = tok.encode(PROBE)  # special tokens allowed: still no BOS, as the GGUF says
    assert ids == tok.encode(PROBE, add_special_tokens=False) and 1 not in ids
    assert tok.decode(ids) == PROBE
    assert tok.encode_chat([{"role": "user", "content": "hi"}])[:1] == [1]  # <|im_start|> from the template
    assert tok.render_chat([{"role": "user", "content": "hi"}]).endswith("<|im_start|>user\nhi<|im_end|>\n"
                                                                          "<|im_start|>assistant\n")
