"""The one request validation (frontend, target engine, mock worker): every bad value is an
InvalidRequest naming its field, in the caller's own spelling where it passes one; good requests pass."""

from __future__ import annotations

import pytest

from runtime.errors import InvalidRequest
from runtime.messages import SamplingParams, StructuredOutput
from runtime.validation import validate_request

pytestmark = pytest.mark.unit

VOCAB, CONTEXT = 100, 64
GRAMMAR = StructuredOutput(regex="[0-9]+")


def check(token_ids=(1, 2, 3), output_ids=(), vocab_size=VOCAB, structured_outputs=True, names=None, **params):
    validate_request(list(token_ids), SamplingParams(**params), list(output_ids), vocab_size=vocab_size,
                     max_model_len=CONTEXT, structured_outputs=structured_outputs, names=names)


def field_of(**kwargs) -> str:
    with pytest.raises(InvalidRequest) as info:
        check(**kwargs)
    assert str(info.value)
    return info.value.field


def test_good_requests_pass():
    check()
    check(token_ids=[0, VOCAB - 1], max_tokens=CONTEXT - 2, min_tokens=3, temperature=0, top_p=1, top_k=5, seed=-3,
          logprobs=20, stop_token_ids=[VOCAB - 1], presence_penalty=-2, frequency_penalty=2, repetition_penalty=0.5,
          logit_bias={0: -100, VOCAB - 1: 100.0}, min_p=1.0)
    check(structured=GRAMMAR, max_tokens=8)
    check(token_ids=[1] * 30, output_ids=[2] * 30, max_tokens=4)  # exactly the context
    check(token_ids=[10**6], vocab_size=None, logit_bias={10**6: 1})  # no model: ids are not checked


@pytest.mark.parametrize(("kwargs", "field"), [
    (dict(token_ids=[]), "prompt"),
    (dict(token_ids=[1, VOCAB]), "prompt"),
    (dict(token_ids=[-1, 2]), "prompt"),
    (dict(output_ids=[VOCAB]), "output_ids"),
    (dict(stop_token_ids=[VOCAB]), "stop_token_ids"),
    (dict(token_ids=[1] * CONTEXT, max_tokens=0), "prompt"),
    (dict(token_ids=[1] * 40, output_ids=[1] * 24, max_tokens=0), "prompt"),
    (dict(max_tokens=-1), "max_tokens"),
    (dict(token_ids=[1] * 40, max_tokens=25), "max_tokens"),
    (dict(min_tokens=-1), "min_tokens"),
    (dict(min_tokens=17, max_tokens=16), "min_tokens"),
    (dict(temperature=-0.1), "temperature"),
    (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=float("inf")), "temperature"),
    (dict(top_p=0.0), "top_p"),
    (dict(top_p=1.5), "top_p"),
    (dict(top_p=float("nan")), "top_p"),
    (dict(top_k=-1), "top_k"),
    (dict(logprobs=-1), "logprobs"),
    (dict(logprobs=21), "logprobs"),
    (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(presence_penalty=float("nan")), "presence_penalty"),
    (dict(frequency_penalty=-2.01), "frequency_penalty"),
    (dict(repetition_penalty=0.0), "repetition_penalty"),
    (dict(repetition_penalty=-1.0), "repetition_penalty"),
    (dict(repetition_penalty=float("inf")), "repetition_penalty"),
    (dict(logit_bias={VOCAB: 1.0}), "logit_bias"),
    (dict(logit_bias={-1: 1.0}), "logit_bias"),
    (dict(logit_bias={5: 100.5}), "logit_bias"),
    (dict(logit_bias={5: float("nan")}), "logit_bias"),
    (dict(min_p=-0.1), "min_p"),
    (dict(min_p=1.1), "min_p"),
    (dict(structured=GRAMMAR, structured_outputs=False), "response_format"),
    (dict(structured=GRAMMAR, ignore_eos=True), "ignore_eos"),
    (dict(structured=GRAMMAR, min_tokens=1), "min_tokens"),
])
def test_bad_values_name_their_field(kwargs, field):
    assert field_of(**kwargs) == field


def test_callers_spell_the_fields_their_own_way():
    names = {"prompt": "messages", "max_tokens": "max_completion_tokens", "structured": "guided_regex"}
    assert field_of(token_ids=[], names=names) == "messages"
    assert field_of(token_ids=[1] * 60, max_tokens=10, names=names) == "max_completion_tokens"
    assert field_of(structured=GRAMMAR, structured_outputs=False, names=names) == "guided_regex"
    with pytest.raises(InvalidRequest, match="'ignore_eos' cannot be combined with 'guided_regex'"):
        check(structured=GRAMMAR, ignore_eos=True, names=names)
    with pytest.raises(InvalidRequest, match=r"min_tokens \(9\) exceeds max_completion_tokens \(8\)"):
        check(min_tokens=9, max_tokens=8, names=names)


def test_messages_say_what_is_wrong():
    with pytest.raises(InvalidRequest, match=r"token id 100 in 'prompt' is outside the vocabulary \(size 100\)"):
        check(token_ids=[3, 100, 200])
    with pytest.raises(InvalidRequest, match="the prompt and the output so far have 64 tokens; the model's context "
                                             "length is 64"):
        check(token_ids=[1] * 32, output_ids=[1] * 32, max_tokens=0)
    with pytest.raises(InvalidRequest, match=r"logit_bias of token 5 must be in \[-100, 100\], got -101"):
        check(logit_bias={5: -101})
