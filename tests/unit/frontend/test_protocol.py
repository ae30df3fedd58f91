"""Request validation: every rejection names its parameter; nothing is silently ignored."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from frontend.protocol import (ChatCompletionRequest, CompletionRequest, check_supported, logit_bias, message_dicts, parse,
                               prompts_of)
from runtime import InvalidRequest

pytestmark = pytest.mark.unit

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}


def reject(schema, body, extra=None, strict=False) -> InvalidRequest:
    raw = body if isinstance(body, bytes) else json.dumps({**body, **(extra or {})}).encode()
    with pytest.raises(InvalidRequest) as info:
        check_supported(parse(schema, raw), strict)
    return info.value


def test_valid_requests_parse():
    req = parse(ChatCompletionRequest, json.dumps({**CHAT, "temperature": 0, "stop": "x", "n": 2, "user": "u"}).encode())
    check_supported(req)
    assert req.temperature == 0.0 and req.n == 2 and message_dicts(req) == [{"role": "user", "content": "hi"}]
    text = parse(CompletionRequest, json.dumps({**TEXT, "prompt": [[1, 2], [3]]}).encode())
    check_supported(text)
    assert prompts_of(text) == [[1, 2], [3]]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": 3}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"n": True}, "n"),
        ({"stream": "yes"}, "stream"),
        ({"stop": [1]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"seed": 2**70}, "seed"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"tools": [{"type": "function"}]}, "tools[0].function"),
        ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name"),
        ({"tool_choice": "sometimes"}, "tool_choice"),
        ({"parallel_tool_calls": "yes"}, "parallel_tool_calls"),
        ({"logit_bias": {"x": 5}}, "logit_bias"),
        ({"logit_bias": {"-1": 5}}, "logit_bias"),
        ({"logit_bias": {"1.5": 5}}, "logit_bias"),
        ({"logit_bias": {"1": "a lot"}}, "logit_bias"),
        ({"logit_bias": [1, 5]}, "logit_bias"),
        ({"presence_penalty": "high"}, "presence_penalty"),
        ({"repetition_penalty": True}, "repetition_penalty"),
        ({"min_p": "0.1"}, "min_p"),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
        ({"guided_choice": []}, "guided_choice"),
        ({"echo": True}, "echo"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt_logprobs": 1}, "prompt_logprobs"),
        ({"continue_final_message": True}, "continue_final_message"),  # with add_generation_prompt (default true)
        ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools"),
        ({"chat_template_kwargs": "thinking"}, "chat_template_kwargs"),
        ({"add_generation_prompt": "no"}, "add_generation_prompt"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user"}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, "messages[0].content[0].type"),
        ({"messages": [{"role": "assistant", "content": "x", "tool_calls": []}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "messages[0].tool_call_id"),
        ({"model": ""}, "model"),
    ],
)
def test_chat_rejections_name_the_parameter(extra, param):
    assert reject(ChatCompletionRequest, CHAT, extra).field == param


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"logprobs": 50}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"tools": []}, "tools"),
        ({"tool_choice": "none"}, "tool_choice"),
        ({"prompt_logprobs": 0}, "prompt_logprobs"),
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"echo": "yes"}, "echo"),
    ],
)
def test_completion_rejections_name_the_parameter(extra, param):
    assert reject(CompletionRequest, TEXT, extra).field == param


def test_unknown_fields_are_kept_aside_and_named_or_rejected_when_strict():
    from frontend.protocol import unknown_fields

    body = {**CHAT, "mystery": 1, "stream": True, "stream_options": {"include_usage": True, "x": 1},
            "messages": [{"role": "assistant", "content": "a", "refusal": None}, {"role": "user", "content": "b"}]}
    req = parse(ChatCompletionRequest, json.dumps(body).encode())
    check_supported(req)
    assert unknown_fields(req) == ["mystery", "messages[0].refusal", "stream_options.x"]
    assert reject(ChatCompletionRequest, body, strict=True).field == "mystery"
    assert reject(CompletionRequest, {**TEXT, "vendor": {"a": 1}}, strict=True).field == "vendor"
    assert unknown_fields(parse(CompletionRequest, json.dumps(TEXT).encode())) == []


def test_chat_template_fields_parse():
    body = {**CHAT, "add_generation_prompt": False, "continue_final_message": True, "add_special_tokens": True,
            "chat_template_kwargs": {"enable_thinking": False}, "prompt_logprobs": None}
    req = parse(ChatCompletionRequest, json.dumps(body).encode())
    check_supported(req)
    assert (req.add_generation_prompt, req.continue_final_message, req.add_special_tokens) == (False, True, True)
    assert req.chat_template_kwargs == {"enable_thinking": False}


def test_missing_fields_and_bad_json():
    assert reject(CompletionRequest, {"prompt": "x"}).field == "model"
    assert "required" in str(reject(CompletionRequest, {"prompt": "x"}))
    assert reject(ChatCompletionRequest, {"model": "m"}).field == "messages"
    assert "not valid JSON" in str(reject(ChatCompletionRequest, b'{"model": '))
    assert "not valid JSON" in str(reject(ChatCompletionRequest, b'{"model": "\xff\xfe"}'))
    assert "JSON object" in str(reject(ChatCompletionRequest, b"[1, 2]"))


def test_neutral_values_of_unsupported_parameters_are_accepted():
    body = {**CHAT, "tools": [], "tool_choice": "none", "response_format": {"type": "text"}, "echo": False,
            "modalities": ["text"], "store": False}
    check_supported(parse(ChatCompletionRequest, json.dumps(body).encode()))


@pytest.mark.parametrize("schema,base", [(ChatCompletionRequest, CHAT), (CompletionRequest, TEXT)])
def test_logits_processors_parse_with_token_ids_as_keys(schema, base):
    """Their ranges are runtime.validation's to check (tests/unit/frontend/test_prepare.py)."""
    body = {**base, "presence_penalty": 0.5, "frequency_penalty": -1, "repetition_penalty": 1.2, "min_p": 0.1,
            "logit_bias": {"42": 10, "7": -100.0}}
    req = parse(schema, json.dumps(body).encode())
    check_supported(req)
    assert logit_bias(req) == {42: 10.0, 7: -100.0}
    assert (req.presence_penalty, req.frequency_penalty, req.repetition_penalty, req.min_p) == (0.5, -1, 1.2, 0.1)


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "temperature", "top_p", "top_k", "n", "stop", "seed", "stream",
          "stream_options", "logprobs", "top_logprobs", "tools", "logit_bias", "user", "min_tokens", "echo", "best_of"]


@settings(max_examples=400, deadline=None)
@given(st.dictionaries(st.sampled_from(FIELDS) | st.text(max_size=6), JSON_VALUES, max_size=6), st.booleans())
def test_fuzzed_bodies_either_parse_or_raise_invalid_request(body, chat):
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        check_supported(parse(model, json.dumps(body).encode()))
    except InvalidRequest as exc:
        assert str(exc)


def test_valid_json_nested_past_the_limit_names_its_field():
    """A schema nested too deeply is valid JSON: the 400 says which field nests, not 'not valid JSON'."""
    import json as _json

    from frontend.protocol import MAX_JSON_DEPTH, ChatCompletionRequest, parse
    from runtime.errors import InvalidRequest

    schema = {"type": "object"}
    for _ in range(MAX_JSON_DEPTH // 2):
        schema = {"type": "object", "properties": {"x": schema}}
    body = _json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}],
                        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}})
    with pytest.raises(InvalidRequest) as err:
        parse(ChatCompletionRequest, body.encode())
    assert err.value.field == "response_format" and "nested too deeply" in str(err.value)
    with pytest.raises(InvalidRequest) as err:
        parse(ChatCompletionRequest, b'{"model": "m", "messages": [')
    assert "not valid JSON" in str(err.value) and not err.value.field


def test_a_token_id_0_is_not_an_empty_prompt():
    req = parse(CompletionRequest, json.dumps({**TEXT, "prompt": [0, 5]}).encode())
    check_supported(req)
    assert prompts_of(req) == [[0, 5]]
    assert reject(CompletionRequest, TEXT, {"prompt": [[0], []]}).field == "prompt"
    assert reject(CompletionRequest, TEXT, {"prompt": [True, 1]}).field == "prompt"  # a bool is no token id
    assert "array of token ids" in str(reject(CompletionRequest, TEXT, {"prompt": [1.0]}))


def test_bulky_fields_are_refused_from_the_raw_body_naming_them():
    """Too many tools (OpenAI allows 128) and grammars over the size limit are a 400 before the body
    is validated (building a 3.9 MB schema or 10,000 tools cost 0.1-0.7 s on the event loop)."""
    from frontend.protocol import MAX_GRAMMAR_CHARS, MAX_TOOLS

    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(MAX_GRAMMAR_CHARS // 20)}}
    for extra, param in (
        ({"tools": [tool] * (MAX_TOOLS + 1)}, "tools"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": big}}},
         "response_format.json_schema.schema"),
        ({"guided_json": big}, "guided_json"),
    ):
        error = reject(ChatCompletionRequest, CHAT, extra)
        assert error.field == param and ("at most" in str(error)), str(error)
    indented = json.dumps({**CHAT, "guided_json": {"type": "object"}}, indent=MAX_GRAMMAR_CHARS).encode()
    check_supported(parse(ChatCompletionRequest, indented))  # whitespace as sent does not count


def test_a_token_id_prompt_validated_in_a_thread_leaves_the_event_loop_free():
    """500,000 token ids: validating the body holds the GIL only in short steps, so a thread helps
    (as a union of four list types it was one 0.2 s step, and every stream waited for it)."""
    import random

    from frontend.protocol import parse_request
    from tests.support.loop import loop_lag_of

    body = json.dumps({**TEXT, "prompt": [random.randrange(50_000) for _ in range(500_000)]}).encode()
    req, took, worst = loop_lag_of(parse_request, CompletionRequest, body, tick=0.002)
    assert len(req.prompt) == 500_000
    assert worst < max(0.08, took / 3), (took, worst)


@pytest.mark.parametrize("raw", [
    b"[1, 2, 3, 40000, 0, 7, 123456, 9, 10, 11, 12, 13, 14, 15]",
    b"[ 1 ,2 ,\n3,4,5,6,7,8,9,10,11,12,13,14 ]",
    b"[-1, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]",
])
def test_token_id_prompts_decoded_in_chunks_equal_the_validator_s(raw, monkeypatch):
    from frontend import protocol

    body = b'{"model": "m", "max_tokens": 3, "prompt": ' + raw + b"}"
    whole = parse(CompletionRequest, body)  # a short prompt: the validator alone
    monkeypatch.setattr(protocol, "TOKEN_CHUNK_BYTES", 8)  # every prompt long, chunks of a few ids
    chunked = parse(CompletionRequest, body)
    assert chunked.prompt == whole.prompt == json.loads(raw) and chunked == whole
    assert chunked.model_fields_set == whole.model_fields_set


@pytest.mark.parametrize(("raw", "words"), [
    (b"[1, 2, 3.0, 4, 5, 6, 7, 8, 9, 10]", "array of token ids"),  # a float: the validator says so
    (b"[1, 2,, 3, 4, 5, 6, 7, 8, 9, 10]", "not valid JSON"),
    (b"[1, 2, 3, 4, 5, 6, 7, 8, 9, 10,]", "not valid JSON"),
    (b"[1, 2, 3, 4, 5, 6, 7, 8, 9, 1-0]", "not valid JSON"),
])
def test_token_id_prompts_that_do_not_decode_get_the_validator_s_error(raw, words, monkeypatch):
    from frontend import protocol

    monkeypatch.setattr(protocol, "TOKEN_CHUNK_BYTES", 8)
    with pytest.raises(InvalidRequest) as info:
        parse(CompletionRequest, b'{"model": "m", "prompt": ' + raw + b"}")
    assert words in str(info.value), str(info.value)
    big = parse(CompletionRequest, b'{"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, ' + str(2**70).encode() + b"]}")
    assert big.prompt[-1] == 2**70  # past 64 bits: the validator's path (the vocabulary check rejects it later)
    with pytest.raises(InvalidRequest) as info:
        parse(CompletionRequest, b'{"model": "m", "prompt": [1, 2, 3, 4, 5, 6, 7, 8, 9, 10], "max_tokens": "3"}')
    assert info.value.field == "max_tokens"  # the rest of the body is still validated
