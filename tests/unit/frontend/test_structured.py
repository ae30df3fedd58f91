"""Structured outputs and forced tool calls in the frontend: which grammar a request sends (or the 400
naming the parameter), how tool calls are read back, and the response shapes, streamed and not."""

from __future__ import annotations

import json

import msgspec
import pytest

from frontend.metrics import FrontendMetrics
from frontend.models import ModelRegistry
from frontend.output import LogprobEntry, Piece
from frontend.protocol import ChatCompletionRequest, CompletionRequest, check_supported, parse
from frontend.responses import ResponseBuilder
from frontend.serving import CompletionService
from frontend.structured import ToolCalls, asks_for_grammar, structured_output
from frontend.tokenizer import Tokenizer
from runtime import InvalidRequest
from runtime.messages import ModelCard

pytestmark = pytest.mark.unit

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}  # no parameters


def request(extra: dict, chat: bool = True):
    body = {**CHAT, **extra} if chat else {"model": "m", "prompt": "x", **extra}
    req = parse(ChatCompletionRequest if chat else CompletionRequest, json.dumps(body).encode())
    check_supported(req)
    return req


def schema_of(grammar) -> dict:
    return json.loads(grammar.spec.json_schema)


def test_response_formats_become_json_schemas():
    g = structured_output(request({"response_format": {"type": "json_object"}}))
    assert schema_of(g) == {"type": "object"} and g.field == "response_format" and g.tools is None
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    g = structured_output(request({"response_format": {"type": "json_schema", "json_schema": {
        "name": "thing", "schema": schema, "strict": True}}}))
    assert schema_of(g) == schema
    assert structured_output(request({"response_format": {"type": "text"}})) is None
    assert structured_output(request({})) is None
    assert not asks_for_grammar(request({"response_format": {"type": "text"}})) and not asks_for_grammar(request({}))
    assert asks_for_grammar(request({"guided_regex": "a"}, chat=False)) and asks_for_grammar(request({"tools": [WEATHER]}))
    # completions take them too
    assert schema_of(structured_output(request({"response_format": {"type": "json_object"}}, chat=False))) == {"type": "object"}


def test_vllm_guided_extensions():
    assert schema_of(structured_output(request({"guided_json": '{"type": "string"}'}))) == {"type": "string"}
    assert schema_of(structured_output(request({"guided_json": {"type": "integer"}}))) == {"type": "integer"}
    assert structured_output(request({"guided_regex": "[a-z]+"})).spec.regex == "[a-z]+"
    assert structured_output(request({"guided_choice": ["yes", "no"]}, chat=False)).spec.choice == ["yes", "no"]


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema", "schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "wat"}}}},
     "response_format.json_schema.schema", "wat"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}},
     "response_format.json_schema.schema", "not"),
    ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
    ({"guided_json": "[1]"}, "guided_json", "object"),
    ({"guided_regex": "[a-"}, "guided_regex", "regex"),
    ({"guided_choice": ["a", ""]}, "guided_choice", "empty"),
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex", "combined"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER], "tool_choice": "required"}, "tool_choice",
     "combined"),
    ({"tool_choice": "required"}, "tool_choice", "needs 'tools'"),
    ({"response_format": {"type": "json_object"}, "tools": [WEATHER]}, "response_format", "tool_choice 'auto'"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name", "nope"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools[1].function.name", "two tools"),
    ({"tools": [CLOCK, {"type": "function", "function": {"name": "f", "parameters": {"type": "wat"}}}],
      "tool_choice": "required"}, "tools[1].function.parameters", "wat"),
])
def test_what_cannot_be_served_is_a_400_naming_the_parameter(extra, param, words):
    with pytest.raises(InvalidRequest) as info:
        structured_output(request(extra))
    assert info.value.field == param and words in str(info.value), str(info.value)


def test_tool_choice_none_ignores_the_tools():
    assert structured_output(request({"tools": [WEATHER], "tool_choice": "none"})) is None


def test_a_named_function_constrains_its_arguments():
    g = structured_output(request({"tools": [WEATHER, CLOCK],
                                   "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}))
    assert g.field == "tool_choice" and g.tools == ToolCalls("get_weather")
    assert schema_of(g) == WEATHER["function"]["parameters"]
    g = structured_output(request({"tools": [WEATHER, CLOCK],
                                   "tool_choice": {"type": "function", "function": {"name": "get_time"}}}))
    assert schema_of(g) == {"type": "object", "properties": {}, "additionalProperties": False}


def test_required_is_an_array_of_calls_to_any_tool():
    g = structured_output(request({"tools": [WEATHER, CLOCK], "tool_choice": "required"}))
    schema = schema_of(g)
    assert g.tools == ToolCalls() and schema["type"] == "array" and schema["minItems"] == 1 and "maxItems" not in schema
    names = [alt["properties"]["name"]["const"] for alt in schema["items"]["anyOf"]]
    assert names == ["get_weather", "get_time"]
    assert schema["items"]["anyOf"][0]["properties"]["arguments"] == WEATHER["function"]["parameters"]
    g = structured_output(request({"tools": [WEATHER], "tool_choice": "required", "parallel_tool_calls": False}))
    assert schema_of(g)["maxItems"] == 1


def test_tool_calls_parse():
    [call] = ToolCalls("f").parse('{"city": "Oslo"}')
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "f", "arguments": '{"city": "Oslo"}'}
    calls = ToolCalls().parse('[{"name": "f", "arguments": {"a": 1}}, {"name": "g", "arguments": {}}]')
    assert [c["function"] for c in calls] == [{"name": "f", "arguments": '{"a": 1}'}, {"name": "g", "arguments": "{}"}]
    assert len({c["id"] for c in calls}) == 2
    for text in ('{"city": "Os', "[]", '[{"arguments": {}}]', "3"):
        assert ToolCalls().parse(text) is None
    assert ToolCalls("f").parse("[1]") is None


# --------------------------------------------------------------------------- responses


def chunks(data: bytes) -> list[dict]:
    return [json.loads(line[6:]) for line in data.decode().split("\n\n") if line.startswith("data: {")]


class Choice:
    def __init__(self, text, finish_reason, index=0):
        self.index, self.text, self.finish_reason = index, text, finish_reason
        self.logprobs, self.completion_tokens, self.cached_tokens, self.spec = [], 3, 0, None


def test_non_streaming_tool_calls():
    b = ResponseBuilder(True, "m", str, False, ToolCalls("get_weather"))
    body = msgspec.json.decode(b.body([Choice('{"city": "Oslo"}', "stop"), Choice('{"ci', "length", 1)], 5))
    first, cut = body["choices"]
    assert first["finish_reason"] == "tool_calls" and first["message"]["content"] is None
    [call] = first["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Oslo"}'}
    # cut off by max_tokens: the named call with its arguments so far (as vLLM answers), finish_reason length
    assert cut["finish_reason"] == "length" and cut["message"]["content"] is None
    [call] = cut["message"]["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"ci'}


def test_cut_required_tool_calls_come_back_as_content():
    """tool_choice "required" cut off mid-array: no call can be told apart, so the text is the content."""
    b = ResponseBuilder(True, "m", str, False, ToolCalls())
    [cut] = msgspec.json.decode(b.body([Choice('[{"name": "f", "argu', "length")], 5))["choices"]
    assert cut["finish_reason"] == "length"
    assert cut["message"] == {"role": "assistant", "content": '[{"name": "f", "argu'}


def test_streamed_named_tool_call_cut_off_ends_with_length():
    b = ResponseBuilder(True, "m", str, False, ToolCalls("get_weather"))
    out = chunks(b.piece_chunk(0, Piece('{"city"'), False))
    out += chunks(b.piece_chunk(0, Piece(': "Os', finish_reason="length"), False))
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in out[:2]]
    assert calls[0]["function"]["name"] == "get_weather"
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Os'
    assert out[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}


def test_streamed_named_tool_call_sends_arguments_as_they_come():
    b = ResponseBuilder(True, "m", str, False, ToolCalls("get_weather"))
    out = chunks(b.role_chunk(0, False))
    assert out[0]["choices"][0]["delta"] == {"role": "assistant", "content": None}
    for text in ('{"city"', ': "Os', 'lo"}'):
        out += chunks(b.piece_chunk(0, Piece(text), False))
    out += chunks(b.piece_chunk(0, Piece("", finish_reason="stop"), False))
    calls = [c["choices"][0]["delta"]["tool_calls"][0] for c in out[1:4]]
    assert calls[0]["id"].startswith("call_") and calls[0]["function"]["name"] == "get_weather"
    assert all("id" not in c and "name" not in c["function"] for c in calls[1:])
    assert "".join(c["function"]["arguments"] for c in calls) == '{"city": "Oslo"}'
    assert out[-1]["choices"][0] == {"index": 0, "delta": {}, "logprobs": None, "finish_reason": "tool_calls"}


def test_streamed_required_tool_calls_come_whole_at_the_end():
    b = ResponseBuilder(True, "m", lambda t: f"<{t}>", True, ToolCalls())
    lp = [LogprobEntry(7, -0.5, [])]
    assert b.piece_chunk(0, Piece('[{"name": "get_time", ', lp), False) is None  # held back
    out = chunks(b.piece_chunk(0, Piece('"arguments": {}}]', lp, "stop"), False))
    delta = out[0]["choices"][0]["delta"]
    [call] = delta["tool_calls"]
    assert call["index"] == 0 and call["function"] == {"name": "get_time", "arguments": "{}"}
    assert len(out[0]["choices"][0]["logprobs"]["content"]) == 2  # the held-back logprobs go with it
    assert out[1]["choices"][0]["finish_reason"] == "tool_calls"
    # text that does not parse (max_tokens) goes out as content
    b = ResponseBuilder(True, "m", str, False, ToolCalls())
    b.piece_chunk(1, Piece('[{"na'), False)
    out = chunks(b.piece_chunk(1, Piece("me", finish_reason="length"), False))
    assert out[0]["choices"][0]["delta"] == {"content": '[{"name'} and out[1]["choices"][0]["finish_reason"] == "length"


# --------------------------------------------------------------------------- prepare


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    from workers.demo_model import demo_tokenizer_dir

    return Tokenizer.load(str(demo_tokenizer_dir()))


def service(tokenizer, structured: bool) -> CompletionService:
    registry = ModelRegistry(loader=lambda path, template, eos: tokenizer, preload=False)
    registry.update({"k": ModelCard("m", tokenizer_path="/tok", context_length=256, eos_token_ids=[2], instance_id="a",
                                    structured_outputs=structured)})
    return CompletionService(registry, None, FrontendMetrics(), max_n=4)


async def test_the_grammar_reaches_the_sampling_params_and_tools_the_template(tokenizer):
    job = await service(tokenizer, True).prepare(request({"response_format": {"type": "json_object"}}), "r")
    assert json.loads(job.samplings[0].structured.json_schema) == {"type": "object"}
    job = await service(tokenizer, True).prepare(request({"tools": [WEATHER], "tool_choice": "required"}), "r")
    assert job.builder.tools == ToolCalls() and job.samplings[0].structured.json_schema
    with pytest.raises(InvalidRequest) as info:
        await service(tokenizer, False).prepare(request({"guided_regex": "a+"}), "r")
    assert info.value.field == "guided_regex" and "do not support" in str(info.value)


@pytest.mark.parametrize(("extra", "param", "words"), [
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos", "response_format"),
    ({"guided_choice": ["a"], "min_tokens": 1}, "min_tokens", "guided_choice"),
    ({"tools": [WEATHER], "tool_choice": "required", "ignore_eos": True}, "ignore_eos", "tool_choice"),
])
async def test_a_grammar_must_end_the_output(tokenizer, extra, param, words):
    """A finished grammar allows only EOS: nothing may ban it or run past it."""
    with pytest.raises(InvalidRequest) as info:
        await service(tokenizer, True).prepare(request(extra), "r")
    assert info.value.field == param and words in str(info.value), str(info.value)


def test_tools_and_tool_turns_reach_the_chat_template(tokenizer):
    template = ("{% for t in tools or [] %}TOOL {{ t.function.name }}|{% endfor %}"
                "{% for m in messages %}{{ m.role }}: {{ m.content }}"
                "{% for c in m.tool_calls or [] %} CALL {{ c.function.name }}({{ c.function.arguments.city }}){% endfor %}"
                "{% if m.tool_call_id %} [{{ m.tool_call_id }}]{% endif %}|{% endfor %}")
    tok = Tokenizer(tokenizer.backend, template)
    req = request({"messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}], "tools": [WEATHER], "tool_choice": "required"})
    from frontend.protocol import message_dicts

    text = tok.render_chat(message_dicts(req), [t.model_dump(exclude_none=True) for t in req.tools])
    assert text == "TOOL get_weather|user: Weather?|assistant:  CALL get_weather(Oslo)|tool: sunny [call_1]|"


@pytest.mark.parametrize(("extra", "param"), [
    ({"guided_regex": "a{4000000}"}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {
        "type": "string", "pattern": "^x{4000000}$"}}}}, "response_format"),
])
async def test_a_repetition_count_the_matcher_cannot_follow_is_a_400_before_any_token(tokenizer, extra, param):
    """It compiles, and its first step allows a token; the lexer gives up on that token ("too many
    expressions"), which a worker would answer with an empty reply."""
    with pytest.raises(InvalidRequest) as info:
        await service(tokenizer, True).prepare(request(extra), "r")
    assert info.value.field == param and "cannot follow" in str(info.value), str(info.value)
    job = await service(tokenizer, True).prepare(request({"guided_regex": "a{1000}"}), "r")  # a fair count is fine
    assert job.samplings[0].structured.regex == "a{1000}"
