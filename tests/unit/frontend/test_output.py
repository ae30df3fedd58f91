"""One choice's output: stop strings cut text, token counts and logprobs at the same place."""

from __future__ import annotations

import pytest

from frontend.output import ChoiceOutput
from runtime.messages import SpecUsage, TokenDelta, TopLogprob, Usage
from tests.support.toy_tokenizers import char_tokenizer

pytestmark = pytest.mark.unit

LETTERS = char_tokenizer("abcdefghijklmnopqrstuvwxyz")  # token i is the i-th letter


def delta(ids, finish=None, usage=None) -> TokenDelta:
    return TokenDelta(list(ids), [-0.5] * len(ids), [[TopLogprob(i, -0.5), TopLogprob(i + 1, -1.0)] for i in ids],
                      finish, usage)


def test_a_stop_string_ends_text_count_and_logprobs_at_its_token():
    out = ChoiceOutput(0, LETTERS, [], stops=["cd"], top_logprobs=1)
    first = out.add(delta([0, 1, 2]))  # "abc": "c" may start the stop string
    assert first.text == "ab" and first.finish_reason is None
    second = out.add(delta([3, 4, 5]))  # "d" completes "cd"; "e" and "f" are never reported
    assert second.text == "" and second.finish_reason == "stop"
    assert out.text == "ab" and out.completion_tokens == 4
    assert [e.token_id for e in out.logprobs] == [0, 1, 2, 3] and all(len(e.top) == 1 for e in out.logprobs)
    assert out.add(delta([6])).text == ""  # nothing after the finish


def test_held_back_text_is_released_at_the_end():
    out = ChoiceOutput(0, LETTERS, [], stops=["cz"])
    assert out.add(delta([0, 1, 2])).text == "ab"
    end = out.add(delta([3], finish="length", usage=Usage(5, 4, 2, SpecUsage(1, 4, 3))))
    assert end.text == "cd" and end.finish_reason == "length"
    assert out.cached_tokens == 2 and out.spec == SpecUsage(1, 4, 3)


def test_without_stops_or_logprobs_whole_deltas_are_decoded():
    out = ChoiceOutput(0, LETTERS, [], stop_token_ids=frozenset({25}))
    assert out.add(TokenDelta([7, 8])).text == "hi"
    piece = out.add(TokenDelta([25], finish_reason="stop"))  # the stop token's text is hidden
    assert piece.text == "" and piece.finish_reason == "stop" and out.completion_tokens == 3


def test_a_hidden_stop_token_has_no_logprob_entry():
    out = ChoiceOutput(0, LETTERS, [], stop_token_ids=frozenset({9}), top_logprobs=0)
    out.add(TokenDelta([1, 2], logprobs=[-0.1, -0.2], top_logprobs=[[], []]))
    piece = out.add(TokenDelta([3, 9], logprobs=[-0.3, -0.4], top_logprobs=[[], []], finish_reason="stop"))
    assert [e.token_id for e in out.logprobs] == [1, 2, 3] and [e.token_id for e in piece.logprobs] == [3]
    assert out.completion_tokens == 4  # still counted
