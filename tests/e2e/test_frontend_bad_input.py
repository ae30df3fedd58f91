"""Bad input gets the right 4xx and an OpenAI-format JSON error, and the server stays up;
fuzzed request bodies never get a 5xx. Real frontend and mock worker processes, real etcd/NATS."""

from __future__ import annotations

import json

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.e2e.test_frontend_openai import FrontendStack

pytestmark = pytest.mark.e2e

CHAT = {"model": "mock", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
TEXT = {"model": "mock", "prompt": "hi", "max_tokens": 4}


@pytest.fixture(scope="module")
def stack(servers):
    s = FrontendStack(servers)
    s.worker("--token-latency-ms", "0", "--num-speculative-tokens", "0")
    s.frontend("--max-body-bytes", str(256 * 1024))
    s.wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        yield client


def assert_error(resp: httpx.Response, status: int, param: str | None = "any") -> dict:
    assert resp.status_code == status, resp.text
    assert resp.headers["content-type"].startswith("application/json")
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    if param != "any":
        assert error["param"] == param, error
    return error


def post(http, path: str, body) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    return http.post(path, content=content, headers={"content-type": "application/json"})


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b'{"model": "mock",}', b"not json", b"[1, 2]", b"null", b'"string"', b"[" * 5000 + b"]" * 5000,
     b'{"model": "mock", "messages": [{"role": "user", "content": "\xff\xfe bad utf-8"}]}',
     b'{"model": "mock", "messages": [{"role": "user", "content": "\\ud800"}]}'],
)
def test_malformed_bodies_are_400(http, raw):
    for path in ("/v1/chat/completions", "/v1/completions"):
        assert_error(post(http, path, raw), 400, None)


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"model": 5}, "model"),
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"content": "x"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": ["x"]}]}, "messages[0].content"),
        ({"max_tokens": "10"}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 50}, "n"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_k": -5}, "top_k"),
        ({"seed": "x"}, "seed"),
        ({"stop": {"a": 1}}, "stop"),
        ({"stream": 1}, "stream"),
        ({"logprobs": 3}, "logprobs"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "x" * 20000}]}, "messages"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"parallel_tool_calls": "no"}, "parallel_tool_calls"),
        ({"stop_token_ids": [10**9]}, "stop_token_ids"),
        ({"min_tokens": 10}, "min_tokens"),
        ({"prompt_logprobs": 2}, "prompt_logprobs"),
        ({"prompt": "x"}, "prompt"),
    ],
)
def test_chat_field_errors_name_the_field(http, patch, param):
    assert_error(post(http, "/v1/chat/completions", {**CHAT, **patch}), 400, param)


def test_one_limit_on_n_with_one_message(http):
    """However far past the frontend's --max-n (16 here), n gets the same 400 naming it, on both endpoints."""
    messages = set()
    for path, body in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        for n in (17, 1024, 1025, 100000, 10**30):
            messages.add(assert_error(post(http, path, {**body, "n": n}), 400, "n")["message"])
    assert messages == {"at most 16 choices per request ('n' times the number of prompts; the frontend's --max-n)"}
    assert post(http, "/v1/chat/completions", {**CHAT, "n": 16}).status_code == 200


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"presence_penalty": 2.01}, "presence_penalty"),
        ({"presence_penalty": "0.5"}, "presence_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"min_p": 1.01}, "min_p"),
        ({"min_p": -1}, "min_p"),
        ({"logit_bias": {"12": 100.5}}, "logit_bias"),
        ({"logit_bias": {"12": "up"}}, "logit_bias"),
        ({"logit_bias": {"twelve": 1}}, "logit_bias"),
        ({"logit_bias": {"-12": 1}}, "logit_bias"),
        ({"logit_bias": {"99999999": 1}}, "logit_bias"),  # outside the vocabulary
        ({"logit_bias": [12, 1]}, "logit_bias"),
    ],
)
def test_logits_processor_errors_name_the_field(http, patch, param):
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        assert_error(post(http, path, {**base, **patch}), 400, param)


def test_logits_processors_in_range_are_served(http):
    patch = {"presence_penalty": -2, "frequency_penalty": 2, "repetition_penalty": 1.5, "min_p": 1,
             "logit_bias": {"12": -100, "13": 100}}
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        resp = post(http, path, {**base, **patch})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4, resp.text


@pytest.mark.parametrize(
    ("body", "param"),
    [({"prompt": "x"}, "model"), ({"model": "mock"}, "prompt"), ({"model": "mock", "messages": []}, "messages")],
)
def test_missing_fields(http, body, param):
    path = "/v1/chat/completions" if param == "messages" or "prompt" in body else "/v1/completions"
    assert_error(post(http, path, body), 400, param)


def test_unknown_model_is_404(http):
    err = assert_error(post(http, "/v1/completions", {**TEXT, "model": "ghost"}), 404, "model")
    assert err["code"] == "model_not_found"


def test_huge_bodies_are_413_with_and_without_content_length(http):
    big = {**TEXT, "prompt": "x" * (300 * 1024)}
    assert_error(post(http, "/v1/completions", big), 413)

    def chunks():
        for _ in range(40):
            yield b" " * 8192
        yield json.dumps(TEXT).encode()

    resp = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(resp, 413)


def test_wrong_methods_and_paths_get_json_errors(http):
    assert_error(http.get("/v1/chat/completions"), 405)
    assert_error(http.get("/v1/nothing"), 404)


def test_server_stays_up_after_bad_input(http):
    assert http.get("/live").status_code == 200
    resp = post(http, "/v1/chat/completions", CHAT)
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


JSON_VALUES = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**66), 2**66) | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)
FIELDS = ["model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k", "n",
          "stop", "seed", "stream", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice", "logit_bias",
          "user", "min_tokens", "ignore_eos", "stop_token_ids", "echo", "presence_penalty", "response_format",
          "frequency_penalty", "repetition_penalty", "min_p", "chat_template_kwargs", "add_generation_prompt",
          "continue_final_message", "add_special_tokens", "prompt_logprobs", "suffix", "best_of"]
MESSAGE = st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "tool", "x"])},
                                optional={"content": JSON_VALUES | st.text(max_size=20), "name": JSON_VALUES})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    base=st.sampled_from([CHAT, TEXT]),
    patch=st.dictionaries(st.sampled_from(FIELDS), JSON_VALUES, max_size=4),
    messages=st.none() | st.lists(MESSAGE, max_size=3),
    path=st.sampled_from(["/v1/chat/completions", "/v1/completions"]),
)
def test_fuzzed_requests_never_get_a_5xx(http, base, patch, messages, path):
    body = {**base, **patch}
    if messages is not None:
        body["messages"] = messages
    resp = post(http, path, body)
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert_error(resp, resp.status_code)
    elif body.get("stream") is True:
        assert resp.text.rstrip().endswith("data: [DONE]")
    else:
        assert resp.json()["object"] in ("chat.completion", "text_completion")


RESPONSES_FIELDS = ["model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "user",
                    "metadata", "store", "tools", "tool_choice", "text", "reasoning", "truncation", "include",
                    "previous_response_id", "stream_options", "top_logprobs"]
TOKENIZE_FIELDS = ["model", "prompt", "messages", "tokens", "add_special_tokens", "add_generation_prompt",
                   "continue_final_message", "chat_template_kwargs", "tools", "return_token_strs"]
INPUT_ITEM = st.fixed_dictionaries({}, optional={"type": st.sampled_from(["message", "function_call", "x"]) | JSON_VALUES,
                                                 "role": st.sampled_from(["user", "assistant", "developer", "x"]),
                                                 "content": JSON_VALUES | st.lists(st.fixed_dictionaries(
                                                     {"type": st.sampled_from(["input_text", "output_text", "x"])},
                                                     optional={"text": JSON_VALUES}), max_size=2)})


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    path=st.sampled_from(["/v1/responses", "/tokenize", "/detokenize"]),
    patch=st.dictionaries(st.sampled_from(RESPONSES_FIELDS + TOKENIZE_FIELDS), JSON_VALUES, max_size=4),
    items=st.none() | st.lists(INPUT_ITEM, max_size=3) | st.lists(MESSAGE, max_size=2),
)
def test_fuzzed_responses_and_tokenize_requests_never_get_a_5xx(http, path, patch, items):
    base = {"/v1/responses": {"model": "mock", "input": "hi", "max_output_tokens": 4},
            "/tokenize": {"model": "mock", "prompt": "hi"}, "/detokenize": {"model": "mock", "tokens": [1, 2]}}[path]
    body = {**base, **patch}
    if items is not None:
        body["input" if path == "/v1/responses" else "messages"] = items
    resp = post(http, path, body)
    assert resp.status_code < 500, resp.text
    if resp.status_code >= 400:
        assert_error(resp, resp.status_code)
    elif path == "/v1/responses" and body.get("stream") is True:
        assert "event: response.completed" in resp.text
    elif path == "/v1/responses":
        assert resp.json()["object"] == "response"


def _status_count(http: httpx.Client, status: int) -> float:
    text = http.get("/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("tandem_frontend_requests_total{") and f'status="{status}"' in line)


def test_a_client_that_leaves_mid_upload_is_counted_499_and_logged_in_one_line(stack, http):
    """Content-Length 1000, 10 bytes, close: the client's doing — not a 500, not a traceback."""
    import socket
    import time

    before_499, before_500 = _status_count(http, 499), _status_count(http, 500)
    frontend = stack.procs[-1]
    log_start = len(frontend.logs())
    with socket.create_connection(("127.0.0.1", stack.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
    deadline = time.monotonic() + 10
    while _status_count(http, 499) == before_499:
        assert time.monotonic() < deadline, frontend.logs()[log_start:]
        time.sleep(0.05)
    assert _status_count(http, 499) == before_499 + 1 and _status_count(http, 500) == before_500
    new_logs = frontend.logs()[log_start:]
    assert "Traceback" not in new_logs and "ERROR" not in new_logs
    assert "client disconnected" in new_logs


def test_oversized_counts_are_rejected_before_any_tokenization(http):
    """Bounded counts are checked on the raw body: a 200 KB body of one-letter prompts is a quick 400."""
    import time

    cases = [("/v1/completions", {**TEXT, "prompt": ["a"] * 50_000}, "prompt"),
             ("/v1/completions", {**TEXT, "prompt": ["a"] * 20}, "n"),  # n × prompts over --max-n, before tokenizing
             ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": ""}] * 5000}, "messages"),
             ("/v1/chat/completions", {**CHAT, "stop": ["x"] * 40}, "stop"),
             ("/v1/completions", {**TEXT, "stop_token_ids": list(range(2000))}, "stop_token_ids")]
    for path, body, param in cases:
        started = time.monotonic()
        resp = http.post(path, json=body)
        assert time.monotonic() - started < 1.0, (param, time.monotonic() - started)
        assert_error(resp, 400, param)
