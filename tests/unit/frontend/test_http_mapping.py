"""Errors map to the right status in OpenAI's format; usage reports speculation as vLLM defines it;
the frontend's configuration refuses bad values."""

from __future__ import annotations

import json

import pytest

from frontend.config import FrontendConfig
from frontend.errors import BodyTooLarge, to_http
from frontend.models import UnknownModel
from frontend.output import ChoiceOutput
from frontend.responses import usage
from frontend.tokenizer import TokenizerLoadError
from runtime import (
    InstanceGone,
    InvalidRequest,
    NoInstances,
    Overloaded,
    PayloadTooLarge,
    RemoteError,
    ShuttingDown,
)
from runtime.messages import SpecUsage, TokenDelta, Usage
from tests.support.toy_tokenizers import char_tokenizer

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("exc", "status", "param", "retry"),
    [
        (InvalidRequest("bad", "top_p"), 400, "top_p", False),
        (UnknownModel("x"), 404, "model", False),
        (BodyTooLarge(1024), 413, None, False),
        (PayloadTooLarge(10, 5), 413, None, False),
        (Overloaded("busy"), 429, None, True),
        (NoInstances("target", "generate", "m"), 503, None, True),
        (InstanceGone("i", "dead"), 503, None, True),
        (ShuttingDown(), 503, None, True),
        (TokenizerLoadError("no files"), 500, None, False),
        (RemoteError("ValueError", "boom"), 500, None, False),
        (ZeroDivisionError(), 500, None, False),
    ],
)
def test_errors_map_to_status_and_openai_format(exc, status, param, retry):
    err = to_http(exc, retry_after=2)
    body = json.loads(err.response().body)
    assert err.status == status
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["param"] == param and body["error"]["message"]
    assert (err.headers.get("Retry-After") == "2") is retry


def _choice(spec: SpecUsage | None, completion: int, cached: int = 0) -> ChoiceOutput:
    out = ChoiceOutput(0, char_tokenizer("abcdefghijklmnopqrstuvwxyz"), [])
    out.add(TokenDelta(list(range(completion)), finish_reason="length", usage=Usage(3, completion, cached, spec)))
    return out


def test_usage_spec_decode_follows_vllm_definitions():
    u = usage(10, [_choice(SpecUsage(num_drafts=4, num_draft_tokens=16, num_accepted_tokens=10), 14, cached=8)])
    assert u["prompt_tokens"] == 10 and u["completion_tokens"] == 14 and u["total_tokens"] == 24
    assert u["prompt_tokens_details"] == {"cached_tokens": 8}
    assert u["spec_decode"] == {"num_drafts": 4, "draft_tokens": 16, "accepted_tokens": 10, "accepted_per_pos": [],
                                "acceptance_rate": 10 / 16, "mean_accepted_length": 1 + 10 / 4}


def test_usage_spec_decode_without_drafts_leaves_the_rates_out():
    u = usage(10, [_choice(SpecUsage(), 1)])
    assert u["spec_decode"] == {"num_drafts": 0, "draft_tokens": 0, "accepted_tokens": 0, "accepted_per_pos": []}


def test_usage_spec_decode_sums_choices_before_dividing():
    u = usage(10, [_choice(SpecUsage(4, 16, 10, [4, 3, 2, 1]), 14), _choice(SpecUsage(), 1),
                   _choice(SpecUsage(2, 8, 2, [2]), 5)])
    assert u["spec_decode"] == {"num_drafts": 6, "draft_tokens": 24, "accepted_tokens": 12,
                                "accepted_per_pos": [6, 3, 2, 1],
                                "acceptance_rate": 12 / 24, "mean_accepted_length": 1 + 12 / 6}


def test_usage_without_speculation_has_no_spec_block_and_sums_choices():
    u = usage(5, [_choice(None, 3), _choice(None, 4)])
    assert "spec_decode" not in u and u["completion_tokens"] == 7 and u["total_tokens"] == 12


def test_stop_token_text_is_hidden_but_counted():
    out = ChoiceOutput(0, char_tokenizer("`abcdefghi"), [], stop_token_ids=frozenset({9}))
    piece = out.add(TokenDelta([1, 2, 9], finish_reason="stop"))
    assert piece.text == "ab" and piece.finish_reason == "stop" and out.completion_tokens == 3


@pytest.mark.parametrize(
    "kwargs",
    [{"http_port": 70000}, {"router_mode": "fastest"}, {"max_body_bytes": 10}, {"max_n": 0},
     {"max_migrations": -1}, {"host": ""}, {"tokenizer_timeout_s": 0}],
)
def test_config_rejects_bad_values(kwargs):
    with pytest.raises(ValueError):
        FrontendConfig(**kwargs)


def test_usage_says_why_steps_did_not_speculate():
    u = usage(10, [_choice(SpecUsage(2, 8, 3, [2, 1], plain_steps={"paused": 5, "draft_late": 1}), 12),
                   _choice(SpecUsage(plain_steps={"no_draft": 4, "paused": 1}), 4)])
    assert u["spec_decode"]["plain_steps"] == {"paused": 6, "draft_late": 1, "no_draft": 4}
    assert "plain_steps" not in usage(10, [_choice(SpecUsage(1, 4, 4), 5)])["spec_decode"]
