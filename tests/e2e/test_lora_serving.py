"""Multi-LoRA through the HTTP API, on real processes: a target worker (a tiny Llama with the demo
tokenizer's vocabulary, adapters trained here with ``peft``) and the frontend, over real etcd and NATS.

An adapter named at start (``--lora-modules``) and one loaded at run time (``/v1/load_lora_adapter``)
are listed by ``/v1/models`` with their parent and answer greedily what PEFT's merged model does;
unloading takes one out (404 after); bad admin requests are 400s naming the field.
"""

from __future__ import annotations

import functools
import shutil
import uuid

import httpx
import pytest

from tests.support.lora import merged_reference, train_lora
from tests.support.procs import ManagedProcess
from tests.support.servers import env_for, free_port
from tests.support.tiny_models import hf_greedy, tiny_hf_model

pytestmark = pytest.mark.e2e

PROMPT = "The adapter says"
STEPS = 8


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    from workers.demo_model import demo_model_dir

    root = tmp_path_factory.mktemp("lora-e2e")
    base = root / "base"
    tiny_hf_model("llama", base, vocab=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_model_dir() / name, base / name)
    train_lora(base, root / "a1", seed=1, steps=8, batch=4, seq_len=16)
    train_lora(base, root / "a2", seed=2, steps=8, batch=4, seq_len=16, rank=4, targets=("q_proj", "v_proj", "gate_proj"))
    return root


@pytest.fixture(scope="module")
def stack(servers, dirs):
    env = env_for(*servers, "l" + uuid.uuid4().hex[:10])
    url = f"http://127.0.0.1:{free_port()}"
    procs = []
    try:
        for module, args in (
                ("workers.target", ["--model", str(dirs / "base"), "--served-model-name", "tiny", "--num-blocks", "128",
                                    "--max-loras", "2", "--max-lora-rank", "8", "--lora-modules", f"a1={dirs / 'a1'}"]),
                ("frontend", ["--http-port", url.rsplit(":", 1)[1]])):
            procs.append(ManagedProcess(module, ["--lease-ttl", "3", *args], env, module).start())
        procs[0].wait_for_log("target worker", 120)
        procs[1].wait_for_log("frontend ready", 60)
        with httpx.Client(base_url=url, timeout=60) as client:
            yield client
    finally:
        for proc in reversed(procs):
            proc.stop(timeout=10)


@functools.cache
def _expected(dirs, name: str | None) -> str:
    import transformers as tf

    tok = tf.AutoTokenizer.from_pretrained(str(dirs / "base"))
    model = (merged_reference(dirs / "base", dirs / name) if name else
             tf.AutoModelForCausalLM.from_pretrained(str(dirs / "base")).eval())
    return tok.decode(hf_greedy(model, tok.encode(PROMPT), STEPS))


def _complete(client: httpx.Client, model: str) -> httpx.Response:
    return client.post("/v1/completions", json={"model": model, "prompt": PROMPT, "max_tokens": STEPS,
                                                "temperature": 0, "ignore_eos": True})


def _models(client: httpx.Client) -> dict[str, str | None]:
    return {m["id"]: m["parent"] for m in client.get("/v1/models").json()["data"]}


def test_adapters_are_listed_served_loaded_and_unloaded(stack, dirs):
    assert _models(stack) == {"tiny": None, "a1": "tiny"}
    assert len({_expected(dirs, name) for name in (None, "a1", "a2")}) == 3  # each adapter changes the output
    for model, adapter in (("a1", "a1"), ("tiny", None)):
        r = _complete(stack, model)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == model
        assert r.json()["choices"][0]["text"] == _expected(dirs, adapter), model
    r = stack.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": str(dirs / "a2")})
    assert r.status_code == 200, r.text
    assert _models(stack) == {"tiny": None, "a1": "tiny", "a2": "tiny"}
    r = _complete(stack, "a2")
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == _expected(dirs, "a2")
    r = stack.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 200, r.text
    assert _models(stack) == {"tiny": None, "a1": "tiny"}
    r = _complete(stack, "a2")
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = stack.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
    assert r.status_code == 404


@pytest.mark.parametrize("body, field", [
    ({"lora_name": "x"}, "lora_path"),
    ({"lora_path": "/nowhere"}, "lora_name"),
    ({"lora_name": "x", "lora_path": "/nowhere/at/all"}, "lora_path"),  # the worker cannot read it
    ({"lora_name": "a1", "lora_path": "/nowhere"}, "lora_name"),  # taken
    ({"lora_name": "x", "lora_path": "/nowhere", "model": "other"}, "model"),
])
def test_bad_load_requests_are_400s_naming_the_field(stack, body, field):
    r = stack.post("/v1/load_lora_adapter", json=body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == field
    assert "x" not in _models(stack)
