"""The frontend through the official ``openai`` SDK (sync, async, streaming): a real
``python -m frontend`` and ``python -m workers.mock`` over real etcd and NATS.

The mock worker echoes the prompt's non-special tokens (cycled) at temperature 0, which makes
outputs predictable: the completion of ``alpha beta gamma delta epsilon`` is that text again.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import signal
import time
import uuid

import httpx
import openai
import pytest
from tokenizers import Tokenizer

from tests.support.procs import ManagedProcess
from tests.support.servers import env_for, free_port

pytestmark = pytest.mark.e2e

WORDS = "alpha beta gamma delta epsilon"


class FrontendStack:
    """Workers and one frontend process in a namespace of their own (module-scoped fixtures)."""

    def __init__(self, servers):
        self.env = env_for(*servers, "f" + uuid.uuid4().hex[:10])
        self.procs: list[ManagedProcess] = []
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"

    def worker(self, *args: str, name: str = "mock") -> ManagedProcess:
        proc = ManagedProcess("workers.mock", ["--lease-ttl", "3", "--stats-interval", "0.2", *args], self.env, name).start()
        self.procs.append(proc)
        return proc

    def frontend(self, *args: str) -> ManagedProcess:
        proc = ManagedProcess("frontend", ["--http-port", str(self.port), "--lease-ttl", "3", *args], self.env, "frontend").start()
        self.procs.append(proc)
        proc.wait_for_log("frontend ready", timeout=60)
        return proc

    def wait_healthy(self, model: str = "mock", timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                r = httpx.get(self.url + "/health", timeout=2)
                if r.status_code == 200 and model in r.json()["models"]:
                    # The first request waits for the tokenizer; take that wait here.
                    httpx.post(self.url + "/v1/completions", json={"model": model, "prompt": "hi", "max_tokens": 1}, timeout=60)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"frontend not healthy for {model}; logs:\n" + "\n".join(p.logs()[-2000:] for p in self.procs))

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop(timeout=10)


RESTART_WAIT_S = 8  # this module's frontend: how long a request for a model that just lost its workers waits


@pytest.fixture(scope="module")
def stack(servers):
    s = FrontendStack(servers)
    s.worker("--token-latency-ms", "1", "--num-speculative-tokens", "4", "--acceptance-rate", "0.7")
    s.frontend("--restart-wait", str(RESTART_WAIT_S))
    s.wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from workers.demo_model import demo_tokenizer_dir

    return Tokenizer.from_file(str(demo_tokenizer_dir() / "tokenizer.json"))


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)


@pytest.fixture
def aclient(stack) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def chat(client, content="Hello there, how are you?", **kw):
    return client.chat.completions.create(model="mock", messages=[{"role": "user", "content": content}], **kw)


# --------------------------------------------------------------------------- endpoints


def test_models_health_live_openapi(stack, client):
    [model] = [m for m in client.models.list().data if m.id == "mock"]
    assert model.object == "model" and model.owned_by == "tandem"
    assert httpx.get(stack.url + "/health").json() == {"status": "healthy", "models": ["mock"]}
    assert httpx.get(stack.url + "/live").status_code == 200
    spec = httpx.get(stack.url + "/openapi.json").json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/health", "/live", "/metrics"):
        assert path in spec["paths"]
    ref = spec["paths"]["/v1/chat/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    body = spec["components"]["schemas"][ref.rsplit("/", 1)[1]]
    assert "messages" in body["properties"] and "messages" in body["required"]

    def refs(node):
        if isinstance(node, dict):
            yield from ([node["$ref"]] if "$ref" in node else [])
            for value in node.values():
                yield from refs(value)
        elif isinstance(node, list):
            for value in node:
                yield from refs(value)

    for target in refs(spec):  # every reference resolves inside the document
        assert target.startswith("#/components/schemas/") and target.rsplit("/", 1)[1] in spec["components"]["schemas"]


def test_chat_non_streaming_with_usage_and_spec_decode(client):
    resp = chat(client, max_tokens=12, temperature=0)
    [choice] = resp.choices
    assert resp.object == "chat.completion" and choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    assert resp.usage.completion_tokens == 12 and resp.usage.prompt_tokens > 0
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + 12
    assert 0 <= resp.usage.prompt_tokens_details.cached_tokens <= resp.usage.prompt_tokens
    spec = resp.usage.model_extra["spec_decode"]
    assert spec["num_drafts"] >= 1 and spec["draft_tokens"] == 4 * spec["num_drafts"]
    assert spec["acceptance_rate"] == pytest.approx(spec["accepted_tokens"] / spec["draft_tokens"])
    assert spec["mean_accepted_length"] == pytest.approx(1 + spec["accepted_tokens"] / spec["num_drafts"])
    assert chat(client, max_tokens=12, temperature=0).choices[0].message.content == choice.message.content


def test_speculation_per_request(client):
    """Tandem's ``speculative`` extension reaches the worker: its node budget, or none at all."""
    spec = chat(client, max_tokens=12, extra_body={"speculative": {"num_draft_tokens": 2}}).usage.model_extra["spec_decode"]
    assert spec["num_drafts"] >= 1 and spec["draft_tokens"] == 2 * spec["num_drafts"]
    off = chat(client, max_tokens=12, extra_body={"speculative": {"num_draft_tokens": 0}})
    assert "spec_decode" not in off.usage.model_extra


def test_cached_tokens_are_reported_on_a_repeated_prompt(client):
    content = "A long prompt for the prefix cache: " + WORDS * 6
    chat(client, content, max_tokens=2)
    assert chat(client, content, max_tokens=2).usage.prompt_tokens_details.cached_tokens >= 16


def test_chat_streaming_matches_non_streaming_and_ends_with_usage(client):
    expected = chat(client, max_tokens=20, temperature=0).choices[0].message.content
    chunks = list(chat(client, max_tokens=20, temperature=0, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 20
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats (GuideLLM sends it): usage in every chunk, growing."""
    chunks = list(chat(client, max_tokens=12, temperature=0, stream=True,
                       stream_options={"include_usage": True, "continuous_usage_stats": True}))
    assert all(c.usage is not None for c in chunks)
    completions = [c.usage.completion_tokens for c in chunks]
    assert completions == sorted(completions) and completions[-1] == 12 and chunks[-1].choices == []
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    assert all(c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens for c in chunks)


def test_a_model_by_id(stack, client):
    model = client.models.retrieve("mock")
    assert model.id == "mock" and model.object == "model" and model.owned_by == "tandem"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("no-such-model")
    assert err.value.body["code"] == "model_not_found"


def test_streaming_without_include_usage_sends_no_usage_chunk(client):
    chunks = list(chat(client, max_tokens=5, stream=True))
    assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)


def test_completion_streaming_and_max_completion_tokens(client):
    chunks = list(client.completions.create(model="mock", prompt=WORDS, max_tokens=5, temperature=0, stream=True))
    assert "".join(c.choices[0].text for c in chunks).startswith(WORDS)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert chat(client, max_completion_tokens=3).usage.completion_tokens == 3


async def test_async_client_concurrent_and_streaming(aclient):
    results = await asyncio.gather(*(
        aclient.completions.create(model="mock", prompt=WORDS, max_tokens=10, temperature=0) for _ in range(8)))
    assert {r.choices[0].text for r in results} == {WORDS + WORDS}
    stream = await aclient.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=6, stream=True, stream_options={"include_usage": True})
    chunks = [c async for c in stream]
    assert chunks[-1].usage.completion_tokens == 6


# --------------------------------------------------------------------------- parameters


def test_stop_strings_including_one_spanning_tokens(client):
    def text(stop, **kw):
        r = client.completions.create(model="mock", prompt=WORDS, max_tokens=10, temperature=0, stop=stop, **kw)
        return r.choices[0].text, r.choices[0].finish_reason

    assert text(" gamma") == ("alpha beta", "stop")
    r = client.completions.create(model="mock", prompt=WORDS, max_tokens=10, temperature=0, stop=" gamma", logprobs=0)
    assert r.usage.completion_tokens == 3 and r.choices[0].logprobs.tokens == ["alpha", " beta", " gamma"]
    assert text(["ta gam", "zzz"]) == ("alpha be", "stop")  # spans the tokens " beta" and " gamma"
    assert text("nowhere") == (WORDS + WORDS, "length")
    streamed = client.completions.create(model="mock", prompt=WORDS, max_tokens=10, temperature=0, stop="ta gam", stream=True)
    assert "".join(c.choices[0].text for c in streamed) == "alpha be"


def test_stop_token_ids_and_min_tokens(client, tok):
    gamma = tok.encode(" gamma", add_special_tokens=False).ids[0]
    body = dict(model="mock", prompt=WORDS, max_tokens=12, temperature=0)
    r = client.completions.create(**body, extra_body={"stop_token_ids": [gamma]})
    assert (r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens) == ("alpha beta", "stop", 3)
    r = client.completions.create(**body, extra_body={"stop_token_ids": [gamma], "min_tokens": 5})
    assert r.usage.completion_tokens == 8 and r.choices[0].text == WORDS + "alpha beta"


def test_token_id_prompts_and_several_prompts(client, tok):
    ids = tok.encode(WORDS, add_special_tokens=False).ids
    r = client.completions.create(model="mock", prompt=[ids, ids[:2]], max_tokens=2, temperature=0)
    assert [c.index for c in r.choices] == [0, 1]
    assert [c.text for c in r.choices] == ["alpha beta", "alpha beta"]
    assert r.usage.prompt_tokens == len(ids) + 2


def test_n_seed_temperature_top_p_top_k(client):
    def run(seed):
        r = chat(client, n=3, temperature=1.0, top_p=0.9, seed=seed, max_tokens=16, extra_body={"top_k": 20})
        assert [c.index for c in r.choices] == [0, 1, 2] and r.usage.completion_tokens == 48
        return [c.message.content for c in r.choices]

    first = run(7)
    assert run(7) == first  # seeded: reproducible
    assert len(set(first)) > 1  # each choice gets its own seed
    assert run(8) != first


def test_n_streaming_interleaves_choices(client):
    chunks = list(chat(client, n=2, max_tokens=8, stream=True, stream_options={"include_usage": True}))
    roles = [c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role]
    finished = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert sorted(roles) == [0, 1] and finished == [0, 1] and chunks[-1].usage.completion_tokens == 16


def test_logprobs_chat_and_completions(client):
    r = chat(client, max_tokens=5, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    assert len(content) == 5 and all(len(c.top_logprobs) == 2 and c.logprob <= 0 for c in content)
    assert "".join(c.token for c in content) == r.choices[0].message.content
    r = client.completions.create(model="mock", prompt=WORDS, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert lp.tokens == ["alpha", " beta", " gamma", " delta"] and len(lp.token_logprobs) == 4
    # three alternatives a token, the chosen one among them at its own logprob (greedy: the likeliest)
    assert all(len(t) == 3 for t in lp.top_logprobs) and lp.text_offset == [0, 5, 10, 16]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert top[token] == pytest.approx(logprob) and logprob == pytest.approx(max(top.values()))
    streamed = list(chat(client, max_tokens=4, logprobs=True, stream=True))
    assert sum(len(c.choices[0].logprobs.content) for c in streamed if c.choices and c.choices[0].logprobs) == 4


def test_accepted_harmless_parameters(client):
    r = chat(client, max_tokens=2, user="someone", presence_penalty=0, frequency_penalty=0, logit_bias={},
             response_format={"type": "text"}, extra_body={"ignore_eos": True})
    assert r.usage.completion_tokens == 2


def test_logits_processors_are_accepted(client):
    """Penalties, logit_bias and min_p reach the worker (the mock validates them and ignores them)."""
    extra = {"repetition_penalty": 1.2, "min_p": 0.1}
    r = chat(client, max_tokens=3, presence_penalty=0.5, frequency_penalty=-1.0, logit_bias={"42": 10, "7": -100},
             extra_body=extra)
    assert r.usage.completion_tokens == 3
    r = client.completions.create(model="mock", prompt=WORDS, max_tokens=3, presence_penalty=2, logit_bias={"5": 1},
                                  extra_body=extra)
    assert r.usage.completion_tokens == 3


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        # tools without tool_choice mean "auto": no parser for the model's own tool-call format
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        # the mock worker cannot follow a grammar (its model card says so)
        ({"extra_body": {"guided_regex": "[0-9]+"}}, "guided_regex"),
        ({"logit_bias": {"42": 101}}, "logit_bias"),
        ({"logit_bias": {"forty-two": 1}}, "logit_bias"),
        ({"logit_bias": {"10000000": 1}}, "logit_bias"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"response_format": {"type": "json_object"}}, "response_format"),
        ({"extra_body": {"min_p": 1.5}}, "min_p"),
        ({"extra_body": {"prompt_logprobs": 1}}, "prompt_logprobs"),  # unknown fields are ignored: conformance
        ({"temperature": 5}, "temperature"),
        ({"max_tokens": 100000}, "max_tokens"),
        ({"extra_body": {"speculative": {"eagle_topk": 0}}}, "speculative.eagle_topk"),
        ({"extra_body": {"speculative": {"num_draft_tokens": 8, "depth": 2}}}, "speculative.depth"),
    ],
)
def test_unsupported_or_invalid_parameters_are_400s_naming_them(client, kwargs, param):
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, **kwargs)
    assert info.value.status_code == 400 and info.value.body["param"] == param


def test_completion_echo_with_logprobs_is_rejected_and_unknown_models_are_404(client):
    with pytest.raises(openai.BadRequestError) as info:
        client.completions.create(model="mock", prompt="x", echo=True, logprobs=1)
    assert info.value.body["param"] == "echo"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}])
    assert info.value.body["code"] == "model_not_found"


def test_metrics_count_requests_tokens_latency_and_acceptance(stack, client):
    chat(client, max_tokens=4)
    text = httpx.get(stack.url + "/metrics").text
    assert 'tandem_frontend_requests_total{endpoint="chat",model="mock",status="200"}' in text
    assert 'tandem_frontend_requests_total{endpoint="chat",model="",status="404"}' in text
    for name in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "request_duration_seconds_count",
                 "prompt_tokens_total", "completion_tokens_total", "spec_decode_num_draft_tokens_total",
                 "spec_decode_num_accepted_tokens_total", "inflight_requests", "input_sequence_tokens_count",
                 "output_sequence_tokens_bucket"):
        assert f"tandem_frontend_{name}" in text, name
    accepted = [line for line in text.splitlines() if line.startswith("tandem_frontend_spec_decode_num_draft_tokens_total")]
    assert float(accepted[0].split()[-1]) > 0


def test_models_appear_and_disappear_with_their_workers(stack, client):
    other = stack.worker("--model-name", "other", "--token-latency-ms", "0", "--num-speculative-tokens", "0", name="other")
    deadline = time.monotonic() + 30
    while "other" not in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline, other.logs()[-2000:]
        time.sleep(0.1)
    r = client.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert r.usage.completion_tokens == 3 and "spec_decode" not in (r.usage.model_extra or {})
    other.signal(signal.SIGTERM)
    other.wait(20)
    deadline = time.monotonic() + 10
    while "other" in {m.id for m in client.models.list().data}:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # just gone: the request waits --restart-wait for its workers to come back, then 503 with
    # Retry-After (they may be re-registering), not 404
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as err:
        client.with_options(max_retries=0).chat.completions.create(
            model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    assert err.value.status_code == 503 and err.value.response.headers["retry-after"]
    assert time.monotonic() - started >= RESTART_WAIT_S - 0.5
    # a worker that comes back while a request waits serves it
    pending = concurrent.futures.ThreadPoolExecutor(1).submit(
        client.with_options(max_retries=0, timeout=60).chat.completions.create,
        model="other", messages=[{"role": "user", "content": "hi"}], max_tokens=3)
    time.sleep(0.5)
    back = stack.worker("--model-name", "other", "--token-latency-ms", "0", "--num-speculative-tokens", "0",
                        name="other-again")
    assert pending.result(timeout=60).usage.completion_tokens == 3, back.logs()[-2000:]
    back.signal(signal.SIGTERM)
    back.wait(20)
