"""``tandem up`` with vLLM's engine flags: ``--max-model-len 2048 --dtype float32
--gpu-memory-utilization 0.5 --served-model-name a b --lora-modules mine=DIR`` serves with those
settings, as ``/v1/models`` (through the openai SDK) and the target worker's own ``/metrics`` (whose
URL the banner prints) show; the frontend's ``--api-key`` and ``--tool-call-parser`` reach the frontend.

The model is a random one-layer Llama built here with the demo tokenizer (the real target worker
and engine; the demo model itself would only make it slower), the adapter an untrained PEFT one as
docs/models.md makes it. On this CPU the KV cache takes ``--kv-cache-gb``: the worker warns that
``--gpu-memory-utilization`` does nothing here and no metric reports it in force
(tests/gpu/test_memory_cuda.py checks the CUDA sizing)."""

from __future__ import annotations

import re
import signal

import httpx
import openai
import pytest

from tests.support.launcher import descendants, launcher, wait_gone  # noqa: F401  (launcher: a fixture)
from tests.support.tiny_models import tiny_model_with_demo_tokenizer

pytestmark = pytest.mark.e2e

KV_GB = 0.0625
KEY = "sk-flags-test"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_model_with_demo_tokenizer(tmp_path_factory.mktemp("tiny-llama-4k"), max_positions=4096)


@pytest.fixture(scope="module")
def adapter(tiny_model, tmp_path_factory):
    """An untrained LoRA adapter for ``tiny_model``, made as docs/models.md shows."""
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    out = tmp_path_factory.mktemp("adapter")
    base = tf.AutoModelForCausalLM.from_pretrained(str(tiny_model))
    lora = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, lora).save_pretrained(str(out))
    return out


def samples(text: str, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric ``name``: (labels, value)."""
    out = []
    for line in text.splitlines():
        match = re.fullmatch(re.escape(name) + r"(?:\{(.*)\})? (\S+)", line)
        if match:
            labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(1) or ""))
            out.append((labels, float(match.group(2))))
    return out


def test_the_issues_command_serves_with_its_settings(launcher, tiny_model, adapter):  # noqa: F811
    up = launcher("--model", str(tiny_model), "--draft-method", "none", "--max-model-len", "2048", "--dtype", "float32",
                  "--gpu-memory-utilization", "0.5", "--served-model-name", "a", "b", "--kv-cache-gb", str(KV_GB),
                  "--max-num-seqs", "8", "--api-key", KEY, "--tool-call-parser", "hermes",
                  "--lora-modules", f"mine={adapter}")  # no --max-loras: one slot per adapter
    up.wait_ready(timeout=180)
    assert '-H "Authorization: Bearer $TANDEM_API_KEY"' in up.logs()  # the banner's curl works as printed
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=up.url + "/v1", api_key="wrong", max_retries=0).models.list()
    client = openai.OpenAI(base_url=up.url + "/v1", api_key=KEY, max_retries=0, timeout=60)
    models = {m.id: m for m in client.models.list().data}
    assert sorted(models) == ["a", "b", "mine"] and models["mine"].model_extra["parent"] == "a"
    assert all(m.model_extra["max_model_len"] == 2048 for m in models.values())
    for name in ("a", "b"):  # each name is accepted as "model" and echoed back
        reply = client.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hello there"}],
                                               max_tokens=4, temperature=0)
        assert reply.model == name and reply.usage.completion_tokens == 4
    # SmolLM2's chat template renders no tool calls: tool_choice "auto" is a 400 unless a parser is named
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    reply = client.chat.completions.create(model="a", messages=[{"role": "user", "content": "Call f"}], tools=tools,
                                           tool_choice="auto", max_tokens=4, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "tool_calls")
    with pytest.raises(openai.BadRequestError) as err:  # the context is --max-model-len's, not the model's 4096
        client.completions.create(model="b", prompt="hi " * 2100, max_tokens=1)
    assert "2048" in str(err.value)

    port = re.search(r"target-0\s+pid \d+\s+health http://127\.0\.0\.1:(\d+)/health", up.logs()).group(1)
    # the frontend's /metrics has no vllm: names; the banner points at the target's, which has them
    assert "\nvllm:" not in httpx.get(f"{up.url}/metrics", timeout=10).text
    assert f"  http://127.0.0.1:{port}/metrics  (target-0)" in up.logs()
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text  # the worker's port: no key
    [(config, _)] = samples(text, "tandem_target_engine_config")
    # --gpu-memory-utilization did nothing on this CPU: not reported as in force
    assert (config["max_model_len"], config["dtype"], config["max_num_seqs"], config["gpu_memory_utilization"],
            config["served_model_names"]) == ("2048", "float32", "8", "", "a b")
    assert 0.9 * KV_GB * (1 << 30) <= int(config["kv_cache_bytes"]) <= KV_GB * (1 << 30)  # CPU: --kv-cache-gb
    [(cache, _)] = samples(text, "vllm:cache_config_info")
    assert cache["gpu_memory_utilization"] == "" and cache["cache_dtype"] == "float32"
    success = {labels["finished_reason"]: value for labels, value in samples(text, "vllm:request_success_total")}
    assert success.get("length") == 3
    assert samples(text, "vllm:num_preemptions_total")[0][1] == 0
    [(_, queries)], [(_, hits)] = samples(text, "vllm:prefix_cache_queries_total"), \
        samples(text, "vllm:prefix_cache_hits_total")
    # both chats' prompts were looked up (the 400 was refused before), the second found the first's full blocks
    assert queries >= 3 * 16 and 16 <= hits < queries / 2
    for name in ("vllm:request_queue_time_seconds_count", "vllm:request_prefill_time_seconds_count"):
        assert samples(text, name)[0][1] == 3, name
    [warning] = [line for line in up.logs().splitlines() if "WARNING" in line and "--gpu-memory-utilization" in line]
    assert "--gpu-memory-utilization 0.5 does nothing on a CPU" in warning

    children = descendants(up.proc.pid)
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(60) == 0, up.logs()[-4000:]
    assert wait_gone(children, 5) == set()
