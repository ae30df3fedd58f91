"""Request parameters become the worker's SamplingParams (or a 400 naming the parameter)."""

from __future__ import annotations

import json

import pytest

from frontend.models import UnknownModel
from frontend.protocol import ChatCompletionRequest, CompletionRequest, check_supported, parse
from frontend.serving import CompletionService
from frontend.tokenizer import Tokenizer
from runtime import InvalidRequest
from runtime.messages import ModelCard

from tests.support.frontend import completion_service, demo_tokenizer

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return demo_tokenizer()


@pytest.fixture
def service(tokenizer) -> CompletionService:
    return completion_service(tokenizer, context_length=256, draft=ModelCard("d", role="draft"))


async def prepare(service, body: dict, chat: bool = True):
    req = parse(ChatCompletionRequest if chat else CompletionRequest, json.dumps(body).encode())
    check_supported(req)
    return await service.prepare(req, "rid")


CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hello there"}]}


async def test_parameters_reach_the_sampling_params(service, tokenizer):
    job = await prepare(service, {**CHAT, "temperature": 0.5, "top_p": 0.9, "top_k": 7, "seed": 11, "max_tokens": 9,
                                  "min_tokens": 2, "stop_token_ids": [5], "ignore_eos": True, "logprobs": True,
                                  "top_logprobs": 3, "stop": ["END"], "stream": True,
                                  "stream_options": {"include_usage": True}})
    [sp] = job.samplings
    assert (sp.temperature, sp.top_p, sp.top_k, sp.seed, sp.max_tokens, sp.min_tokens) == (0.5, 0.9, 7, 11, 9, 2)
    assert sp.stop_token_ids == [5] and sp.ignore_eos and sp.logprobs == 3
    assert job.stops == ("END",) and job.stream and job.include_usage
    assert job.stop_token_ids == frozenset({5})  # ignore_eos: EOS text is not hidden
    assert job.prompts[0] == tokenizer.encode_chat([{"role": "user", "content": "Hello there"}])


async def test_defaults(service):
    job = await prepare(service, CHAT)
    [sp] = job.samplings
    assert sp.temperature == 1.0 and sp.top_p == 1.0 and sp.top_k == 0 and sp.logprobs is None
    assert sp.max_tokens == 256 - len(job.prompts[0])  # the rest of the context
    assert job.stop_token_ids == frozenset({2})
    text = await prepare(service, {"model": "m", "prompt": "Once upon"}, chat=False)
    assert text.samplings[0].max_tokens == 16


async def test_n_and_several_prompts_make_one_choice_each_with_distinct_seeds(service):
    job = await prepare(service, {"model": "m", "prompt": ["a b", "c d"], "n": 2, "seed": 5}, chat=False)
    assert job.prompt_of == [0, 0, 1, 1]
    assert [sp.seed for sp in job.samplings] == [5, 6, 5, 6]
    with pytest.raises(InvalidRequest) as info:
        await prepare(service, {"model": "m", "prompt": ["a", "b", "c"], "n": 2}, chat=False)
    assert info.value.field == "n"


async def test_n_past_max_n_is_refused_before_waiting_for_the_model(service):
    """One bound on n (max_n), checked before the model is looked up or waited for."""
    for n in (5, 2000, 10**30):
        for body in ({**CHAT, "n": n}, {**CHAT, "model": "gone", "n": n}):
            with pytest.raises(InvalidRequest) as info:
                await prepare(service, body)
            assert info.value.field == "n" and "at most 4 choices" in str(info.value)


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({**CHAT, "max_tokens": 250}, "max_tokens"),
        ({**CHAT, "max_completion_tokens": 250}, "max_completion_tokens"),
        ({**CHAT, "max_tokens": 5, "min_tokens": 6}, "min_tokens"),
        ({**CHAT, "stop_token_ids": [10**6]}, "stop_token_ids"),
        ({**CHAT, "messages": [{"role": "user", "content": "word " * 300}]}, "messages"),
    ],
)
async def test_context_and_vocabulary_limits(service, body, param):
    with pytest.raises(InvalidRequest) as info:
        await prepare(service, body)
    assert info.value.field == param


@pytest.mark.parametrize("chat", [True, False])
async def test_logits_processors_reach_the_sampling_params(service, chat):
    body = {**(CHAT if chat else {"model": "m", "prompt": "Once upon"}), "presence_penalty": 0.5,
            "frequency_penalty": -1.5, "repetition_penalty": 1.3, "logit_bias": {"42": 10, "7": -100}, "min_p": 0.05}
    [sp] = (await prepare(service, body, chat)).samplings
    assert (sp.presence_penalty, sp.frequency_penalty, sp.repetition_penalty, sp.min_p) == (0.5, -1.5, 1.3, 0.05)
    assert sp.logit_bias == {42: 10.0, 7: -100.0}
    [plain] = (await prepare(service, CHAT if chat else {"model": "m", "prompt": "Once upon"}, chat)).samplings
    assert (plain.presence_penalty, plain.frequency_penalty, plain.repetition_penalty, plain.logit_bias, plain.min_p) \
        == (0.0, 0.0, 1.0, {}, 0.0)


@pytest.mark.parametrize("chat", [True, False])
@pytest.mark.parametrize(("extra", "param"), [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -3}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": -1.0}, "repetition_penalty"),
    ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"),
    ({"logit_bias": {"42": 101}}, "logit_bias"),
    ({"logit_bias": {"42": -100.5}}, "logit_bias"),
    ({"logit_bias": {"1000000": 1}}, "logit_bias"),  # outside the vocabulary
    ({"logit_bias": {"x": 1}}, "logit_bias"),
])
async def test_logits_processors_out_of_range_are_400s_naming_them(service, chat, extra, param):
    body = {**(CHAT if chat else {"model": "m", "prompt": "Once upon"}), **extra}
    with pytest.raises(InvalidRequest) as info:
        await prepare(service, body, chat)
    assert info.value.field == param and param in str(info.value)


async def test_token_prompts_are_checked_against_the_vocabulary(service):
    with pytest.raises(InvalidRequest) as info:
        await prepare(service, {"model": "m", "prompt": [1, 2, 999999]}, chat=False)
    assert info.value.field == "prompt"


async def test_unknown_and_draft_models_are_not_served(service):
    for name in ("nope", "d"):
        with pytest.raises(UnknownModel):
            await prepare(service, {**CHAT, "model": name})
