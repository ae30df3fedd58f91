"""API keys: the openai SDK with a key works, without one it gets AuthenticationError; probes stay open."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.e2e.test_frontend_openai import FrontendStack

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def stack(servers, tmp_path_factory):
    keys = tmp_path_factory.mktemp("keys") / "keys.txt"
    keys.write_text("# one key per line\nfile-key\n")
    s = FrontendStack(servers)
    s.worker("--token-latency-ms", "0", "--num-speculative-tokens", "0")
    s.frontend("--api-key", "k1,k2", "--api-key", f"@{keys}")
    yield s
    s.stop()


def test_keys_from_flags_and_files_work_and_a_wrong_or_missing_key_is_401(stack):
    import time

    deadline = time.monotonic() + 60
    # probes need no key; /ping is 200 once a worker serves the model (/health already before: a
    # request sent then got a 503)
    while httpx.get(stack.url + "/ping", timeout=5).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    assert httpx.get(stack.url + "/health", timeout=5).status_code == 200
    assert httpx.get(stack.url + "/live", timeout=5).status_code == 200
    assert httpx.get(stack.url + "/metrics", timeout=5).status_code == 200
    for key in ("k1", "k2", "file-key"):
        client = openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0)
        r = client.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        assert r.usage.completion_tokens == 2
        assert [m.id for m in client.models.list().data] == ["mock"]
    bad = openai.OpenAI(base_url=stack.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad.chat.completions.create(model="mock", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
    assert err.value.body["code"] == "invalid_api_key"
    raw = httpx.post(stack.url + "/v1/completions", json={"model": "mock", "prompt": "hi"}, timeout=5)
    assert raw.status_code == 401 and raw.headers["www-authenticate"] == "Bearer"
    assert raw.json()["error"]["type"] == "invalid_request_error"
    assert httpx.get(stack.url + "/v1/models", timeout=5).status_code == 401
