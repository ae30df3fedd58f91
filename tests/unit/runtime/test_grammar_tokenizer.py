"""The grammar's tokenizer info reads tokens as the detokenizer does, or refuses: on SmolLM2's real
tokenizer, as this checkout writes it and as transformers' GGUF conversions (4.57, 5.17) wrote it."""

from __future__ import annotations

import json

import pytest

from runtime.grammar_tokenizer import PROBE, TokenizerMismatch, grammar_tokenizer, llguidance_json
from tests.support.tokenizer_files import VERSIONS, converted_as

pytestmark = pytest.mark.unit

VOCAB = 49152


@pytest.fixture(scope="module")
def canonical():
    from workers.demo_model import demo_tokenizer_dir

    try:
        return demo_tokenizer_dir()
    except FileNotFoundError:  # a machine without the demo model's package (the GPU check)
        pytest.skip("SmolLM2's tokenizer is not installed")


@pytest.mark.parametrize("version", VERSIONS)
def test_every_recorded_conversion_reads_the_probe_as_the_detokenizer_does(canonical, version, tmp_path):
    path = converted_as(canonical, version, tmp_path) / "tokenizer.json"
    info = grammar_tokenizer(path, VOCAB, [2])
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(path)).encode(PROBE, add_special_tokens=False).ids
    assert info.decode_bytes(ids) == PROBE.encode()


def test_a_byte_level_sequence_decoder_becomes_plain_byte_level_for_llguidance_only(canonical, tmp_path):
    text = (converted_as(canonical, "5.17.0", tmp_path) / "tokenizer.json").read_text()
    seen = json.loads(llguidance_json(text))
    assert seen["decoder"] == {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True}
    original = json.loads(text)
    assert {k: v for k, v in seen.items() if k != "decoder"} == {k: v for k, v in original.items() if k != "decoder"}
    plain = (canonical / "tokenizer.json").read_text()
    assert llguidance_json(plain) is plain  # already what llguidance understands


def test_a_decoder_llguidance_misreads_is_refused_with_the_file_named(canonical, tmp_path):
    path = converted_as(canonical, "5.17.0", tmp_path) / "tokenizer.json"
    data = json.loads(path.read_text())
    # a step that changes nothing here but is not one the rewrite knows: llguidance sees the Sequence
    data["decoder"]["decoders"].append({"type": "Strip", "content": " ", "start": 0, "stop": 0})
    path.write_text(json.dumps(data))
    with pytest.raises(TokenizerMismatch, match="reads the tokens of") as caught:
        grammar_tokenizer(path, VOCAB, [2])
    assert str(path) in str(caught.value) and "\u0120" in caught.value.got  # Ġ: a space read as a letter
    assert caught.value.expected.startswith('x {"naïve"')


def test_the_frontend_builds_the_same_checked_info(canonical, tmp_path):
    from frontend.tokenizer import Tokenizer

    tok = Tokenizer.load(str(converted_as(canonical, "5.17.0", tmp_path)), eos_token_ids=[2])
    ids = tok.encode(PROBE, add_special_tokens=False)
    assert tok.grammar_info().decode_bytes(ids) == PROBE.encode()
