"""Structured outputs and forced tool calls through the official ``openai`` SDK, on real processes:
the target worker serving the demo SmolLM2-135M, its EAGLE-3 draft worker, and the frontend, over
real etcd and NATS.

JSON-schema output validates against the schema with speculation on and off, and is the same
token for token at temperature 0 (the grammar masks every verified position; drafts it forbids are
rejected). A forced tool call parses, streamed and not. ``bench/structured_bench.py`` runs the same
check on 50 prompts.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel, Field

from tests.support.procs import ManagedProcess
from tests.support.servers import env_for, free_port

pytestmark = pytest.mark.e2e

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "city": {"type": "string", "maxLength": 24},
        "hobbies": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 3},
    },
    "required": ["name", "age", "city", "hobbies"],
    "additionalProperties": False,
}
NAMES = ["Ada", "Bjorn", "Chen", "Dalia"]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 32},
                                                    "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
CLOCK = {"type": "function", "function": {"name": "get_time", "description": "Current time in a timezone",
                                          "parameters": {"type": "object", "properties": {
                                              "timezone": {"type": "string", "maxLength": 32}},
                                              "required": ["timezone"], "additionalProperties": False}}}
NO_SPECULATION = {"speculative": {"num_draft_tokens": 0}}


class Stack:
    def __init__(self, servers):
        self.env = env_for(*servers, "s" + uuid.uuid4().hex[:10])
        self.procs: list[ManagedProcess] = []
        self.url = f"http://127.0.0.1:{free_port()}"

    def start(self, module: str, args: list[str], name: str) -> ManagedProcess:
        proc = ManagedProcess(module, ["--lease-ttl", "3", *args], self.env, name).start()
        self.procs.append(proc)
        return proc

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout=10)


@pytest.fixture(scope="module")
def stack(servers):
    from workers.demo_model import demo_head_dir, demo_model_dir

    model = str(demo_model_dir())
    s = Stack(servers)
    s.start("workers.target", ["--model", model, "--served-model-name", "smol", "--num-speculative-tokens", "3",
                               "--max-model-len", "1024", "--kv-cache-gb", "0.25"], "target")
    s.start("workers.draft", ["--method", "eagle3", "--eagle-model", str(demo_head_dir()), "--target-model", model],
            "draft")
    s.start("frontend", ["--http-port", s.url.rsplit(":", 1)[1]], "frontend").wait_for_log("frontend ready", 60)
    client = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    deadline = time.monotonic() + 120
    while True:  # until the draft worker speculates for the target
        try:
            r = client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "Count to five."}],
                                               max_tokens=8, temperature=0)
            if (r.usage.model_extra.get("spec_decode") or {}).get("num_drafts"):
                break
        except (openai.APIError, httpx.HTTPError):
            pass
        if time.monotonic() > deadline:
            raise TimeoutError("no speculation; logs:\n" + "\n".join(p.logs()[-2000:] for p in s.procs))
        time.sleep(0.5)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def person_request(name: str, **kw) -> dict:
    return dict(model="smol", temperature=0, max_tokens=160,
                messages=[{"role": "user", "content": f"Describe a person called {name} as JSON: name, age, city "
                                                      "and hobbies."}],
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                        "strict": True}}, **kw)


async def test_json_schema_output_validates_and_speculation_does_not_change_it(stack):
    aclient = openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=300)

    async def run(extra):
        return await asyncio.gather(*(aclient.chat.completions.create(**person_request(n), extra_body=extra)
                                      for n in NAMES))

    on, off = await run(None), await run(NO_SPECULATION)
    for a, b in zip(on, off):
        assert a.choices[0].finish_reason == "stop", a.choices[0].message.content
        jsonschema.validate(json.loads(a.choices[0].message.content), PERSON)
        assert a.choices[0].message.content == b.choices[0].message.content
        assert a.usage.completion_tokens == b.usage.completion_tokens
        assert "spec_decode" not in b.usage.model_extra
    spec = [a.usage.model_extra.get("spec_decode") or {} for a in on]
    assert sum(s.get("num_drafts", 0) for s in spec) > 0  # the constrained requests were speculated
    await aclient.close()


def test_sdk_parse_with_a_pydantic_model_and_json_object(client):
    class City(BaseModel):  # bounded fields: a 135M model may otherwise go on until max_tokens
        name: str = Field(max_length=24)
        country: str = Field(max_length=24)
        population: int = Field(ge=0, le=100_000_000)

    r = client.chat.completions.parse(model="smol", temperature=0, max_tokens=120, response_format=City,
                                      messages=[{"role": "user", "content": "Describe Paris as JSON."}])
    assert isinstance(r.choices[0].message.parsed, City)
    # any object: nothing bounds it, and this small model repeats itself until max_tokens
    r = client.chat.completions.create(model="smol", temperature=0, max_tokens=24,
                                       response_format={"type": "json_object"},
                                       messages=[{"role": "user", "content": "Describe a cat as a JSON object."}])
    content = r.choices[0].message.content
    assert content.startswith('{"') and (r.choices[0].finish_reason == "length" or isinstance(json.loads(content), dict))
    # vLLM's extensions, on the completions endpoint too
    r = client.completions.create(model="smol", prompt="Is the sky blue? Answer:", max_tokens=8, temperature=0,
                                  extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].text in ("yes", "no")


def tools_request(tool_choice, **kw) -> dict:
    return dict(model="smol", temperature=0, max_tokens=120, tools=[WEATHER, CLOCK], tool_choice=tool_choice,
                messages=[{"role": "user", "content": "What is the weather like in Oslo right now?"}], **kw)


def test_a_forced_tool_call_parses(client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    r = client.chat.completions.create(**tools_request(named))
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), WEATHER["function"]["parameters"])

    # streamed: the id and name first, the arguments in pieces
    parts = list(client.chat.completions.create(**tools_request(named), stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in parts if c.choices and c.choices[0].delta.tool_calls]
    assert deltas[0].id and deltas[0].function.name == "get_weather" and len(deltas) > 1
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert parts[-1].choices[0].finish_reason == "tool_calls"

    # "required": one or more calls to any of the tools
    r = client.chat.completions.create(**tools_request("required"))
    calls = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and calls
    by_name = {"get_weather": WEATHER, "get_time": CLOCK}
    for call in calls:
        jsonschema.validate(json.loads(call.function.arguments), by_name[call.function.name]["function"]["parameters"])
    streamed = list(client.chat.completions.create(**tools_request("required"), stream=True))
    got = [t for c in streamed if c.choices and c.choices[0].delta.tool_calls for t in c.choices[0].delta.tool_calls]
    assert [(t.function.name, t.function.arguments) for t in got] == [(c.function.name, c.function.arguments)
                                                                      for c in calls]

    # the conversation continues with the tool's answer
    r = client.chat.completions.create(model="smol", temperature=0, max_tokens=16, messages=[
        {"role": "user", "content": "What is the weather like in Oslo right now?"},
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump() for call in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": "12 degrees and sunny"}])
    assert r.choices[0].message.content


def test_a_named_tool_call_cut_by_max_tokens_is_still_a_tool_call(client):
    """Cut short, a named function's call comes back as that call with its arguments so far and
    finish_reason "length" (as vLLM answers), streamed and not, never as content."""
    named = {"type": "function", "function": {"name": "get_weather"}}
    whole = client.chat.completions.create(**tools_request(named)).choices[0].message.tool_calls[0].function.arguments
    r = client.chat.completions.create(**{**tools_request(named), "max_tokens": 5})
    [choice] = r.choices
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert call.function.arguments and whole.startswith(call.function.arguments) and call.function.arguments != whole
    parts = list(client.chat.completions.create(**{**tools_request(named), "max_tokens": 5}, stream=True))
    deltas = [c.choices[0].delta.tool_calls[0] for c in parts if c.choices and c.choices[0].delta.tool_calls]
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert parts[-1].choices[0].finish_reason == "length"


def test_what_is_not_supported_is_a_400_naming_it(client):
    for kwargs, param in (
        (dict(tools=[WEATHER]), "tool_choice"),  # "auto": SmolLM2's template defines no tool-call format
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {"not": {}}}}),
         "response_format.json_schema.schema"),
        (dict(response_format={"type": "json_object"}, extra_body={"ignore_eos": True}), "ignore_eos"),
        # compiles, but its matcher cannot follow it (today's workers answered 200 with an empty reply)
        (dict(response_format={"type": "json_schema", "json_schema": {"name": "x", "schema": {
            "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}}}),
         "response_format"),
        # compiles, and its first step allows a token, which the lexer then gives up on
        (dict(extra_body={"guided_regex": "a{4000000}"}), "guided_regex"),
    ):
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(model="smol", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                           **kwargs)
        assert info.value.status_code == 400 and info.value.body["param"] == param
