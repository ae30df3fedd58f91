"""The Responses API over the chat path: input items become messages, errors name the Responses
fields, and the answer (whole or as events) has the shapes the openai SDK parses."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types.responses import Response, ResponseStreamEvent
from pydantic import TypeAdapter

from frontend.output import ChoiceOutput
from frontend.responses_api import ResponsesBuilder, parse_responses
from runtime import InvalidRequest
from runtime.messages import TokenDelta, Usage
from tests.support.toy_tokenizers import char_tokenizer

pytestmark = pytest.mark.unit


def parsed(**body):
    return parse_responses(json.dumps({"model": "m", **body}).encode())


def reject(**body) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parsed(**body)
    return info.value


def test_input_becomes_chat_messages():
    _, chat = parsed(input="hi", instructions="Be brief.", max_output_tokens=7, temperature=0.2, top_p=0.5)
    assert [(m.role, m.content) for m in chat.messages] == [("system", "Be brief."), ("user", "hi")]
    assert (chat.max_completion_tokens, chat.temperature, chat.top_p, chat.stream) == (7, 0.2, 0.5, False)
    _, chat = parsed(input=[{"role": "user", "content": "a"},
                            {"type": "message", "role": "assistant",
                             "content": [{"type": "output_text", "text": "b", "annotations": []}]},
                            {"type": "message", "role": "developer",
                             "content": [{"type": "input_text", "text": "c"}, {"type": "input_text", "text": "d"}]}],
                     stream=True)
    assert [(m.role, m.content) for m in chat.messages] == [("user", "a"), ("assistant", "b"), ("developer", "c\nd")]
    assert chat.stream


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
        ({"input": "x", "temperature": 3}, "temperature"),
        ({"input": "x", "top_p": 0}, "top_p"),
        ({"input": "x", "store": True}, "store"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": "x", "tools": [{"type": "function", "name": "f"}]}, "tools"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p", "schema": {}}}}, "text"),
        ({"input": "x", "reasoning": {"effort": "high"}}, "reasoning"),
        ({"input": []}, "input"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role"),
        ({"input": [{"role": "user"}]}, "input[0].content"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]}, "input[0].content[0].type"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
        ({}, "input"),
    ],
)
def test_unsupported_and_invalid_fields_are_named_as_the_responses_api_names_them(body, param):
    assert reject(**body).field == param


def test_neutral_values_and_unknown_fields_pass():
    req, _ = parsed(input="x", store=False, tools=[], tool_choice="auto", text={"format": {"type": "text"}},
                    reasoning={"effort": None}, truncation="disabled", include=[], background=False,
                    stream_options={"include_obfuscation": False}, service_tier="auto")
    assert req.model_extra == {"service_tier": "auto"}
    from frontend.protocol import unknown_fields

    # a field named like a chat request's is unknown here, whatever it holds (was a 500)
    req, _ = parsed(input="x", messages=[None], stream_options={"include_usage": 3})
    assert unknown_fields(req) == ["messages"]


def finished_output(text_ids=(1, 2, 3), finish="length") -> ChoiceOutput:
    out = ChoiceOutput(0, char_tokenizer("abcdefghijklmnopqrstuvwxyz"), [])
    out.add(TokenDelta(list(text_ids), None, None, finish, Usage(5, len(text_ids), 2)))
    return out


def test_the_body_parses_as_the_sdk_s_response():
    req, _ = parsed(input="x", max_output_tokens=3, metadata={"k": "v"})
    b = ResponsesBuilder(req, "m")
    resp = Response.model_validate(json.loads(b.body([finished_output()], 5)))
    assert resp.output_text == "bcd" and resp.status == "incomplete" and resp.metadata == {"k": "v"}
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert (resp.usage.input_tokens, resp.usage.output_tokens, resp.usage.total_tokens) == (5, 3, 8)
    assert resp.usage.input_tokens_details.cached_tokens == 2
    done = Response.model_validate(json.loads(b.body([finished_output(finish="stop")], 5)))
    assert done.status == "completed" and done.incomplete_details is None


def test_the_event_stream_parses_as_the_sdk_s_events_in_order():
    from frontend.output import Piece

    req, _ = parsed(input="x", stream=True)
    b = ResponsesBuilder(req, "m")
    raw = b.role_chunk(0, True) + b.piece_chunk(0, Piece("ab"), True) + b.piece_chunk(0, Piece("c", [], "stop"), True)
    raw += b.usage_chunk([finished_output((0, 1, 2), "stop")], 5) + b.done()
    adapter = TypeAdapter(ResponseStreamEvent)
    events = []
    for block in raw.decode().strip().split("\n\n"):
        kind, data = block.split("\n")
        event = adapter.validate_python(json.loads(data.removeprefix("data: ")))
        assert kind == f"event: {event.type}"
        events.append(event)
    assert [e.type for e in events] == [
        "response.created", "response.in_progress", "response.output_item.added", "response.content_part.added",
        "response.output_text.delta", "response.output_text.delta", "response.output_text.done",
        "response.content_part.done", "response.output_item.done", "response.completed"]
    assert [e.sequence_number for e in events] == list(range(10))
    assert events[6].text == "abc" and events[-1].response.output_text == "abc"
    assert events[-1].response.usage.output_tokens == 3 and openai  # the SDK's types, not ours
