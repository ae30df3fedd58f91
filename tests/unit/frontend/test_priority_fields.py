"""vLLM's ``priority``, Dynamo's ``nvext.agent_hints`` and the session header: validated, each bad
value a 400 naming its field; unknown ``nvext`` keys ignored and named (a 400 when strict)."""

from __future__ import annotations

import json

import pytest

from frontend.protocol import (ChatCompletionRequest, CompletionRequest, check_supported, engine_priority, parse,
                               session_header, unknown_fields)
from runtime import InvalidRequest

pytestmark = pytest.mark.unit

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
TEXT = {"model": "m", "prompt": "hi"}


def checked(schema, body: dict, strict: bool = False):
    req = parse(schema, json.dumps(body).encode())
    check_supported(req, strict)
    return req


def field_of(schema, body: dict, strict: bool = False) -> str:
    with pytest.raises(InvalidRequest) as info:
        checked(schema, body, strict)
    return info.value.field


@pytest.mark.parametrize("schema, base", [(ChatCompletionRequest, CHAT), (CompletionRequest, TEXT)])
def test_priority_in_either_polarity_becomes_vllms(schema, base):
    assert engine_priority(checked(schema, base)) == 0
    assert engine_priority(checked(schema, {**base, "priority": -4})) == -4
    assert engine_priority(checked(schema, {**base, "nvext": {"agent_hints": {"priority": 10}}})) == -10
    agree = {**base, "priority": -2, "nvext": {"agent_hints": {"priority": 2}}}
    assert engine_priority(checked(schema, agree)) == -2


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"priority": "1"}, "priority"),
        ({"priority": 1.5}, "priority"),
        ({"priority": True}, "priority"),
        ({"priority": 2**40}, "priority"),
        ({"nvext": {"agent_hints": {"priority": "high"}}}, "nvext.agent_hints.priority"),
        ({"nvext": {"agent_hints": {"strict_priority": -1}}}, "nvext.agent_hints.strict_priority"),
        ({"nvext": {"agent_hints": {"strict_priority": 256}}}, "nvext.agent_hints.strict_priority"),
        ({"nvext": {"agent_hints": {"osl": 0}}}, "nvext.agent_hints.osl"),
        ({"nvext": {"agent_hints": {"speculative_prefill": "yes"}}}, "nvext.agent_hints.speculative_prefill"),
        ({"nvext": {"agent_hints": {"speculative_prefill": 1}}}, "nvext.agent_hints.speculative_prefill"),
        ({"nvext": {"agent_hints": []}}, "nvext.agent_hints"),
        ({"nvext": "fast"}, "nvext"),
        ({"priority": 1, "nvext": {"agent_hints": {"priority": 1}}}, "nvext.agent_hints.priority"),
    ],
)
def test_bad_priority_fields_are_400s_naming_the_field(extra, field):
    assert field_of(ChatCompletionRequest, {**CHAT, **extra}) == field
    assert field_of(CompletionRequest, {**TEXT, **extra}) == field


def test_unknown_nvext_keys_are_ignored_and_named_or_refused_when_strict():
    body = {**CHAT, "nvext": {"greed_sampling": True, "agent_hints": {"latency_sensitivity": 1.2, "osl": 64}}}
    req = checked(ChatCompletionRequest, body)
    assert unknown_fields(req) == ["nvext.greed_sampling", "nvext.agent_hints.latency_sensitivity"]
    assert req.nvext.agent_hints.osl == 64
    assert field_of(ChatCompletionRequest, body, strict=True) == "nvext.greed_sampling"
    neutral = {**TEXT, "nvext": {"agent_hints": {"speculative_prefill": False, "strict_priority": 255}}}
    assert unknown_fields(checked(CompletionRequest, neutral, strict=True)) == []


def test_the_session_header():
    assert session_header({}) == ""
    assert session_header({"x-dynamo-session-id": "run-42:researcher"}) == "run-42:researcher"
    for bad in ("has space", "x" * 257, "é"):
        with pytest.raises(InvalidRequest) as info:
            session_header({"x-dynamo-session-id": bad})
        assert info.value.field == "X-Dynamo-Session-ID"
