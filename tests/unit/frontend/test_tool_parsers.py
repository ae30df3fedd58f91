"""tool_choice "auto": tool calls read back from each model family's own format, whole and streamed."""

from __future__ import annotations

import json

import pytest

from frontend.output import Piece
from frontend.protocol import ChatCompletionRequest
from frontend.responses import ResponseBuilder
from frontend.structured import ToolCalls, structured_output
from frontend.tool_parsers import PARSERS, parser_for_template
from runtime import InvalidRequest

pytestmark = pytest.mark.unit

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}

HERMES = 'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CASES = {
    "hermes": (HERMES + '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
               "Let me check.", ["Paris", "Oslo"]),
    "mistral": ('[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris"}}]', None, ["Paris"]),
    "llama3_json": ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
                    '{"name": "get_weather", "parameters": {"city": "Rome"}}', None, ["Paris", "Rome"]),
}


@pytest.mark.parametrize("family", sorted(CASES))
def test_each_family_parses_its_calls(family):
    text, content, cities = CASES[family]
    tools = ToolCalls(auto=True, parser=PARSERS[family])
    got_content, calls = tools.split(text)
    assert got_content == content
    assert [c["function"]["name"] for c in calls] == ["get_weather"] * len(cities)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == cities
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert tools.split("It is sunny in Paris today.") == ("It is sunny in Paris today.", None)


def test_a_mistral_array_without_its_dropped_control_token_is_still_a_call():
    _, calls = ToolCalls(auto=True, parser=PARSERS["mistral"]).split('[{"name": "get_weather", "arguments": {}}]')
    assert calls[0]["function"] == {"name": "get_weather", "arguments": "{}"}


def test_cut_off_calls_are_content():
    tools = ToolCalls(auto=True, parser=PARSERS["hermes"])
    assert tools.split('<tool_call>\n{"name": "get_weather", "argu') == ('<tool_call>\n{"name": "get_weather", "argu', None)


def test_the_family_comes_from_the_chat_template():
    assert parser_for_template("{% if tools %}<tool_call>{{ tool }}</tool_call>{% endif %}").name == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}").name == "mistral"
    assert parser_for_template("{{- '<|python_tag|>' }}").name == "llama3_json"
    assert parser_for_template("{{ messages }}") is None
    with pytest.raises(InvalidRequest) as err:
        ToolCalls(auto=True).for_template("{{ messages }}")
    assert err.value.field == "tool_choice" and "'required'" in str(err.value)


def test_tools_without_tool_choice_mean_auto():
    for extra in ({}, {"tool_choice": "auto"}):
        grammar = structured_output(ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": [WEATHER], **extra}))
        assert grammar.spec is None and grammar.tools.auto and grammar.field == "tool_choice"


def _stream(builder: ResponseBuilder, pieces: list[Piece]) -> list[dict]:
    chunks = []
    for piece in pieces:
        raw = builder.piece_chunk(0, piece, False)
        if raw:
            chunks += [json.loads(line[6:]) for line in raw.decode().split("\n\n") if line.startswith("data: ")]
    return chunks


def test_streamed_auto_sends_content_then_the_calls():
    tools = ToolCalls(auto=True, parser=PARSERS["hermes"])
    builder = ResponseBuilder(True, "m", str, False, tools)
    text = HERMES
    cuts = [0, 5, 13, 15, 20, 40, len(text)]  # a cut inside "<tool_call>" too
    pieces = [Piece(text[a:b]) for a, b in zip(cuts, cuts[1:])] + [Piece("", finish_reason="stop")]
    chunks = _stream(builder, pieces)
    content = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert content == "Let me check."  # nothing of the call leaked as content
    calls = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", [])]
    assert [json.loads(t["function"]["arguments"]) for t in calls] == [{"city": "Paris"}]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls"


def test_streamed_auto_without_a_call_is_plain_content():
    builder = ResponseBuilder(True, "m", str, False, ToolCalls(auto=True, parser=PARSERS["hermes"]))
    chunks = _stream(builder, [Piece("It is sunny <"), Piece("3"), Piece("", finish_reason="stop")])
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == "It is sunny <3"
    assert chunks[-1]["choices"][0]["finish_reason"] == "stop"
