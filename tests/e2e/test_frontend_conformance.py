"""What clients send, as they send it: the openai SDK (chat, completions, responses, streaming with
usage), LangChain's ChatOpenAI and vLLM's benchmark client (``vllm bench serve``), vendor extras
included; vLLM's own endpoints (/tokenize, /detokenize, /version, /ping) and the Dynamo metric names.

A real ``python -m frontend`` and ``python -m workers.mock`` over real etcd and NATS. The mock
echoes the prompt's non-special tokens (cycled) at temperature 0, so the text is predictable. A
second frontend, ``--strict-fields``, watches a namespace where no worker runs.
"""

from __future__ import annotations

import json
import time
import uuid

import httpx
import openai
import pytest

from tests.e2e.test_frontend_openai import WORDS, FrontendStack
from tests.support.procs import ManagedProcess
from tests.support.servers import env_for, free_port

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(servers):
    s = FrontendStack(servers)
    s.worker("--token-latency-ms", "0", "--num-speculative-tokens", "0")
    s.frontend()
    s.wait_healthy()
    yield s
    s.stop()


@pytest.fixture(scope="module")
def strict(servers):
    """A --strict-fields frontend in a namespace of its own, with no worker."""
    port = free_port()
    env = env_for(*servers, "s" + uuid.uuid4().hex[:10])
    proc = ManagedProcess("frontend", ["--http-port", str(port), "--lease-ttl", "3", "--strict-fields"], env,
                          "strict-frontend").start()
    proc.wait_for_log("frontend ready", timeout=60)
    yield f"http://127.0.0.1:{port}"
    proc.stop(timeout=10)


@pytest.fixture(scope="module")
def http(stack):
    with httpx.Client(base_url=stack.url, timeout=30) as client:
        yield client


@pytest.fixture(scope="module")
def client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def sse(resp: httpx.Response) -> list[dict]:
    """The JSON data of an SSE body, up to ``[DONE]`` (checked present)."""
    datas = [line[6:] for line in resp.text.splitlines() if line.startswith("data: ")]
    assert datas[-1] == "[DONE]", resp.text[-300:]
    return [json.loads(d) for d in datas[:-1]]


def user(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


# --------------------------------------------------------------------------- the openai SDK


def test_sdk_chat_and_completions_streaming_with_include_usage(client):
    chunks = list(client.chat.completions.create(model="mock", messages=user(WORDS), max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6 and text.strip()
    assert all(c.usage is None for c in chunks[:-1])
    chunks = list(client.completions.create(model="mock", prompt=WORDS, max_tokens=5, stream=True,
                                            stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens == 5 and "".join(c.choices[0].text for c in chunks if c.choices).strip()


def test_sdk_responses_create(client):
    resp = client.responses.create(model="mock", input=WORDS, instructions="Repeat.", max_output_tokens=5,
                                   temperature=0)
    assert resp.object == "response" and resp.model == "mock" and resp.id.startswith("resp")
    [item] = resp.output
    assert item.type == "message" and item.role == "assistant" and item.content[0].type == "output_text"
    assert resp.output_text.strip() and resp.output_text == item.content[0].text
    assert resp.usage.output_tokens == 5 and resp.usage.input_tokens > 0
    assert resp.usage.total_tokens == resp.usage.input_tokens + 5
    # cut at max_output_tokens: incomplete, as OpenAI says it
    assert resp.status == "incomplete" and resp.incomplete_details.reason == "max_output_tokens"
    done = client.responses.create(model="mock", input=WORDS, max_output_tokens=50, temperature=0,
                                   extra_body={"stop": ["delta"]})  # vLLM's extras ride along, ignored
    assert done.status in ("completed", "incomplete") and done.output_text
    items = client.responses.create(model="mock", max_output_tokens=3, input=[
        {"role": "user", "content": "alpha beta"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "alpha", "annotations": []}]},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "gamma"}]}])
    assert items.usage.output_tokens == 3 and items.usage.input_tokens > resp.usage.input_tokens - 20


def test_sdk_responses_streaming(client):
    with client.responses.stream(model="mock", input=WORDS, max_output_tokens=6, temperature=0) as stream:
        events = list(stream)
        final = stream.get_final_response()
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"} and "".join(deltas) == final.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.usage.output_tokens == 6 and final.output_text.strip()
    raw = list(client.responses.create(model="mock", input=WORDS, max_output_tokens=4, stream=True))
    assert raw[-1].type == "response.completed" and raw[-1].response.usage.output_tokens == 4


def test_responses_unsupported_fields_are_400s_naming_them(http):
    base = {"model": "mock", "input": "hi"}
    for patch, param in (({"tools": [{"type": "web_search"}]}, "tools"), ({"previous_response_id": "resp_1"},
                         "previous_response_id"), ({"store": True}, "store"), ({"max_output_tokens": 0}, "max_output_tokens"),
                         ({"max_output_tokens": 10**6}, "max_output_tokens"), ({"temperature": 9}, "temperature"),
                         ({"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, "input[0].type"),
                         ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
                          "input[0].content[0].type"), ({"input": []}, "input"), ({"input": 5}, "input"),
                         ({"text": {"format": {"type": "json_object"}}}, "text")):
        resp = http.post("/v1/responses", json={**base, **patch})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, (patch, resp.text)


# --------------------------------------------------------------------------- LangChain's ChatOpenAI


def test_langchain_chat_openai_payloads(http):
    # ChatOpenAI(model=..., temperature=0.7).invoke(...)
    body = {"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": WORDS}],
            "model": "mock", "stream": False, "n": 1, "temperature": 0.7, "max_tokens": 5}
    resp = http.post("/v1/chat/completions", json=body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["choices"][0]["message"]["content"] and out["usage"]["completion_tokens"] == 5
    # .stream(...) with stream_usage=True; parallel_tool_calls and an empty tool list as bind_tools(...) may send
    streamed = http.post("/v1/chat/completions", json={**body, "stream": True, "stream_options": {"include_usage": True},
                                                       "parallel_tool_calls": False, "tools": [], "tool_choice": "none"})
    assert streamed.status_code == 200, streamed.text
    chunks = sse(streamed)
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    # an assistant turn sent back as the SDK dumps it (refusal, annotations, audio: unknown here, ignored)
    history = body["messages"] + [{"role": "assistant", "content": "alpha", "refusal": None, "annotations": [],
                                   "audio": None, "function_call": None, "tool_calls": None},
                                  {"role": "user", "content": "again"}]
    resp = http.post("/v1/chat/completions", json={**body, "messages": history, "service_tier": "auto",
                                                   "metadata": {"run": "1"}})
    assert resp.status_code == 200, resp.text


# --------------------------------------------------------------------------- vLLM's benchmark client


def test_vllm_bench_serve_payloads(http):
    # vllm bench serve --backend openai: completions, streamed, ignore_eos
    body = {"model": "mock", "prompt": WORDS, "temperature": 0.0, "repetition_penalty": 1.0, "max_tokens": 24,
            "logprobs": None, "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}
    chunks = sse(http.post("/v1/completions", json=body))
    assert chunks[-1]["usage"]["completion_tokens"] == 24 and chunks[-1]["usage"]["prompt_tokens"] > 0
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]).strip()
    # --backend openai-chat: text parts, max_completion_tokens
    chat = {"model": "mock", "messages": [{"role": "user", "content": [{"type": "text", "text": WORDS}]}],
            "temperature": 0.0, "max_completion_tokens": 12, "stream": True,
            "stream_options": {"include_usage": True}, "ignore_eos": True}
    chunks = sse(http.post("/v1/chat/completions", json=chat))
    assert chunks[-1]["usage"]["completion_tokens"] == 12
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]).strip()
    # older clients send best_of and vendor extras through --extra-body
    resp = http.post("/v1/completions", json={**body, "stream": False, "stream_options": None, "best_of": 1,
                                              "max_tokens": 8, "some_engine_knob": 3})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 8, resp.text


def test_stop_strings_are_honoured(http):
    resp = http.post("/v1/completions", json={"model": "mock", "prompt": WORDS, "max_tokens": 30, "stop": [" gamma"],
                                              "temperature": 0})
    choice = resp.json()["choices"][0]
    assert choice["finish_reason"] == "stop" and "gamma" not in choice["text"] and choice["text"].strip()


# --------------------------------------------------------------------------- request fields


def test_chat_template_fields(http):
    def tokens(**kw) -> list[int]:
        resp = http.post("/tokenize", json={"model": "mock", "messages": user("hi"), **kw})
        assert resp.status_code == 200, resp.text
        return resp.json()["tokens"]

    opened, closed = tokens(), tokens(add_generation_prompt=False)
    assert len(opened) > len(closed) and opened[:len(closed)] == closed
    cont = tokens(messages=user("hi") + [{"role": "assistant", "content": "alpha"}], add_generation_prompt=False,
                  continue_final_message=True)
    assert cont[len(closed):] and http.post("/detokenize", json={"tokens": cont}).json()["prompt"].endswith("alpha")
    for extra in ({"chat_template_kwargs": {"enable_thinking": False}}, {"add_generation_prompt": True},
                  {"messages": user("hi") + [{"role": "assistant", "content": "alpha"}],
                   "add_generation_prompt": False, "continue_final_message": True}):
        resp = http.post("/v1/chat/completions", json={"model": "mock", "messages": user("hi"), "max_tokens": 3, **extra})
        assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 3, resp.text
    for extra, param in (({"prompt_logprobs": 1}, "prompt_logprobs"), ({"continue_final_message": True},
                         "continue_final_message"), ({"chat_template_kwargs": {"tools": []}}, "chat_template_kwargs.tools")):
        resp = http.post("/v1/chat/completions", json={"model": "mock", "messages": user("hi"), **extra})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text


def test_echo_prepends_the_prompt(client, http):
    r = client.completions.create(model="mock", prompt=WORDS, max_tokens=3, echo=True, temperature=0)
    plain = client.completions.create(model="mock", prompt=WORDS, max_tokens=3, temperature=0)
    assert r.choices[0].text == WORDS + plain.choices[0].text and r.usage.completion_tokens == 3
    streamed = sse(http.post("/v1/completions", json={"model": "mock", "prompt": WORDS, "max_tokens": 3, "echo": True,
                                                      "stream": True, "temperature": 0}))
    assert streamed[0]["choices"][0]["text"].startswith(WORDS)
    assert "".join(c["choices"][0]["text"] for c in streamed) == r.choices[0].text
    resp = http.post("/v1/completions", json={"model": "mock", "prompt": "x", "echo": True, "logprobs": 1})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "echo"
    resp = http.post("/v1/completions", json={"model": "mock", "prompt": "x", "prompt_logprobs": 0})
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "prompt_logprobs"


def test_unknown_fields_are_ignored_logged_and_counted_or_400_when_strict(stack, http, strict):
    body = {"model": "mock", "messages": user("hi"), "max_tokens": 2, "frobnicate": True,
            "stream": True, "stream_options": {"include_usage": True, "obfuscate": False}}
    chunks = sse(http.post("/v1/chat/completions", json=body))
    assert chunks[-1]["usage"]["completion_tokens"] == 2
    text = http.get("/metrics").text
    assert 'tandem_frontend_ignored_fields_total{field="frobnicate"}' in text
    assert 'tandem_frontend_ignored_fields_total{field="stream_options.obfuscate"}' in text
    assert "ignored fields this server does not know: frobnicate, stream_options.obfuscate" in stack.procs[-1].logs()
    with httpx.Client(base_url=strict, timeout=30) as s:
        for path, payload, param in (("/v1/chat/completions", body, "frobnicate"),
                                     ("/v1/completions", {"model": "mock", "prompt": "x", "vendor": 1}, "vendor"),
                                     ("/v1/responses", {"model": "mock", "input": "x", "vendor": 1}, "vendor"),
                                     ("/v1/chat/completions", {"model": "mock", "messages": [
                                         {"role": "user", "content": "x", "refusal": None}]}, "messages[0].refusal")):
            resp = s.post(path, json=payload)
            assert resp.status_code == 400, resp.text
            assert resp.json()["error"] == {"message": f"Unsupported parameter: '{param}'", "type": "invalid_request_error",
                                            "param": param, "code": None}


# --------------------------------------------------------------------------- vLLM's endpoints


def test_tokenize_detokenize_version(http):
    resp = http.post("/tokenize", json={"model": "mock", "prompt": WORDS})
    out = resp.json()
    assert resp.status_code == 200 and out["count"] == len(out["tokens"]) > 0 and out["max_model_len"] == 2048
    assert http.post("/detokenize", json={"model": "mock", "tokens": out["tokens"]}).json() == {"prompt": WORDS}
    strs = http.post("/tokenize", json={"prompt": WORDS, "return_token_strs": True}).json()  # the one model served
    assert strs["tokens"] == out["tokens"] and "".join(strs["token_strs"]).replace("Ġ", " ") == WORDS
    # the same prompt a completion request sends: usage counts the same tokens
    usage = http.post("/v1/completions", json={"model": "mock", "prompt": WORDS, "max_tokens": 1}).json()["usage"]
    assert usage["prompt_tokens"] == out["count"]
    chat = http.post("/tokenize", json={"model": "mock", "messages": user(WORDS)}).json()
    usage = http.post("/v1/chat/completions", json={"model": "mock", "messages": user(WORDS), "max_tokens": 1}).json()
    assert usage["usage"]["prompt_tokens"] == chat["count"]
    for path, payload, param in (("/tokenize", {"model": "mock"}, "messages"),
                                 ("/tokenize", {"model": "mock", "prompt": 5}, "prompt"),
                                 ("/tokenize", {"model": "mock", "prompt": "x", "messages": user("x")}, "prompt"),
                                 ("/detokenize", {"model": "mock", "tokens": [1, 10**9]}, "tokens[1]"),
                                 ("/detokenize", {"model": "mock", "tokens": "1 2"}, "tokens")):
        resp = http.post(path, json=payload)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text
    assert http.post("/tokenize", json={"model": "nope", "prompt": "x"}).status_code == 404
    assert http.get("/version").json()["version"]


def test_ping_is_200_only_with_a_served_model(http, strict):
    assert http.get("/ping").status_code == 200 and http.post("/ping").status_code == 200
    assert httpx.get(strict + "/ping").status_code == 503 and httpx.post(strict + "/ping").status_code == 503
    assert httpx.get(strict + "/health").status_code == 200  # /health: the frontend itself takes traffic


# --------------------------------------------------------------------------- metrics


def test_dynamo_metric_names_beside_tandem_ones(http, client):
    client.responses.create(model="mock", input="hi", max_output_tokens=2)
    list(client.chat.completions.create(model="mock", messages=user("hi"), max_tokens=2, stream=True))
    deadline = time.monotonic() + 5
    while True:  # a stream's counters are written when its last byte went out
        text = http.get("/metrics").text
        if 'dynamo_frontend_inflight_requests{model="mock"} 0.0' in text or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert ('dynamo_frontend_requests_total{endpoint="responses",model="mock",request_type="unary",'
            'status="success"}') in text
    assert ('dynamo_frontend_requests_total{endpoint="chat_completions",model="mock",request_type="stream",'
            'status="success"}') in text
    assert 'tandem_frontend_requests_total{endpoint="responses",model="mock",status="200"}' in text

    def value(name: str) -> float:
        [line] = [ln for ln in text.splitlines() if ln.startswith(name + '{model="mock"}')]
        return float(line.split()[-1])

    for stem in ("time_to_first_token_seconds_count", "inter_token_latency_seconds_count", "request_duration_seconds_count",
                 "input_sequence_tokens_count", "output_sequence_tokens_sum", "inflight_requests", "queued_requests"):
        assert value("dynamo_frontend_" + stem) == value("tandem_frontend_" + stem), stem
    assert value("dynamo_frontend_output_tokens_total") == value("tandem_frontend_completion_tokens_total") > 0
    assert value("dynamo_frontend_queued_requests") == 0 and value("dynamo_frontend_inflight_requests") == 0
