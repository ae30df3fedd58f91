"""Incremental detokenization never emits half a character; stop strings never leak, whatever
the delta boundaries."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.detokenize import IncrementalDetokenizer, StopStrings
from tests.support.toy_tokenizers import byte_tokenizer

pytestmark = pytest.mark.unit

REPLACEMENT = "\ufffd"
BYTES = byte_tokenizer()  # token i is the byte i


def chunked(items: list, cuts: list[int]) -> list[list]:
    points = sorted({c % (len(items) + 1) for c in cuts} | {0, len(items)})
    return [items[a:b] for a, b in zip(points, points[1:])]


@settings(max_examples=300, deadline=None)
@given(st.text(min_size=1, max_size=40), st.lists(st.integers(0, 200), max_size=12))
def test_byte_tokens_never_yield_half_characters(text, cuts):
    detok = IncrementalDetokenizer(BYTES)
    pieces = [detok.add(chunk) for chunk in chunked(list(text.encode()), cuts)]
    pieces.append(detok.flush())
    if REPLACEMENT not in text:
        assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) == text


def test_a_multibyte_character_is_held_until_complete():
    detok = IncrementalDetokenizer(BYTES)
    emoji = list("🙂".encode())
    assert detok.add([ord("a")]) == "a"
    assert [detok.add([b]) for b in emoji] == ["", "", "", "🙂"]


def test_truly_invalid_bytes_come_out_at_the_end():
    detok = IncrementalDetokenizer(BYTES)
    assert detok.add([ord("x"), 0xF0, 0x9F]) == "x"
    assert detok.flush() == REPLACEMENT


@pytest.fixture(scope="module")
def tokenizer():
    from frontend.tokenizer import Tokenizer
    from workers.demo_model import demo_tokenizer_dir

    return Tokenizer.load(str(demo_tokenizer_dir()))


TEXTS = ["Hello, world!", "héllo 日本語 🙂 naïve café", "  two  spaces\nnew line\ttab", "🙂🙃🤖 emoji only", "1234.5678"]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("step", [1, 2, 3])
def test_real_tokenizer_deltas_concatenate_to_the_full_decode(tokenizer, text, step):
    prompt = tokenizer.encode("The answer is:")
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer.backend, prompt)
    pieces = [detok.add(ids[i:i + step]) for i in range(0, len(ids), step)] + [detok.flush()]
    assert all(REPLACEMENT not in p for p in pieces)
    assert "".join(pieces) == tokenizer.decode(ids)


def test_real_tokenizer_skips_special_tokens(tokenizer):
    detok = IncrementalDetokenizer(tokenizer.backend)
    eos = tokenizer.eos_token_ids[0]
    ids = tokenizer.encode("fine", add_special_tokens=False) + [eos]
    assert detok.add(ids) + detok.flush() == "fine"


def test_long_sequences_come_out_whole():
    detok = IncrementalDetokenizer(BYTES)
    text = "abcdefghij 🙂 " * 100
    out = "".join(detok.add([b]) for b in text.encode())
    assert out + detok.flush() == text


# --------------------------------------------------------------------------- stop strings


def first_stop(text: str, stops: list[str]) -> str:
    """Reference: the stop string that completes first wins (earliest end, then earliest start)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
    return text[: min(hits)[1]] if hits else text


@settings(max_examples=500, deadline=None)
@given(
    st.text(alphabet="abc ", max_size=30),
    st.lists(st.text(alphabet="abc ", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(0, 100), max_size=10),
)
def test_stop_strings_match_the_reference_for_any_chunking(text, stops, cuts):
    matcher = StopStrings(stops)
    out = "".join(matcher.feed("".join(chunk)) for chunk in chunked(list(text), cuts))
    out += matcher.flush()
    assert out == first_stop(text, stops)
    assert matcher.stopped == any(s in text for s in stops)


def test_a_stop_string_spanning_deltas_is_cut_and_its_prefix_held_back():
    matcher = StopStrings(["STOP"])
    assert matcher.feed("hello ST") == "hello "  # "ST" might start the stop string
    assert matcher.feed("O") == ""
    assert matcher.feed("P and more") == ""
    assert matcher.stopped


def test_a_held_back_prefix_is_released_when_it_was_not_a_stop():
    matcher = StopStrings(["STOP"])
    assert matcher.feed("a ST") == "a "
    assert matcher.feed("AR") == "STAR"
    assert matcher.feed("S") == "S"[:0]
    assert matcher.flush() == "S"


def test_empty_stop_strings_are_refused():
    with pytest.raises(ValueError):
        StopStrings(["ok", ""])
