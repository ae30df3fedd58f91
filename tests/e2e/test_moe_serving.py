"""``tandem up --model DIR`` serves mixtures of experts (frontend, router, target, an n-gram draft
worker): seeded random ``qwen3_moe``, ``mixtral`` and ``gpt_oss`` models built with transformers'
own classes and the demo tokenizer. Greedy ``/v1/completions`` of 5 prompts × 32 tokens, sent at
once (one batch), equal transformers' own greedy continuation of the same weights, text for text;
the n-gram drafts are verified by the MoE target on the way (prompts that repeat themselves)."""

from __future__ import annotations

import json
import shutil
import signal
from concurrent.futures import ThreadPoolExecutor

import pytest

from tests.support.launcher import launcher  # noqa: F401  (a fixture)
from tests.support.http import streamed_completion
from tests.support.tiny_models import hf_greedy

pytestmark = pytest.mark.e2e

STEPS = 32
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    return", "1, 2, 3, 4, 1, 2, 3, 4, 1, 2,",
           "Mixtures of experts route every token to", "the cat sat on the mat and the cat sat on the"]


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral", "gpt_oss"])
def moe_dir(request, tmp_path_factory):
    """(family, model dir, greedy reference text per prompt, token ids per prompt)."""
    from transformers import AutoTokenizer

    from tests.support.tiny_moe import tiny_moe_model
    from workers.demo_model import demo_tokenizer_dir

    try:
        tokenizer = demo_tokenizer_dir()
    except FileNotFoundError:
        pytest.skip("SmolLM2's tokenizer is not installed")
    path = tmp_path_factory.mktemp(request.param)
    hf = tiny_moe_model(request.param, path, seed=4, vocab=49152, layers=2)
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**config, "eos_token_id": 2}))
    for item in tokenizer.iterdir():
        if item.is_file() and not item.name.startswith(".") and item.name != "config.json":
            shutil.copy(item, path / item.name)
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = {p: tok(p)["input_ids"] for p in PROMPTS}
    want = {p: tok.decode(hf_greedy(hf, ids[p], STEPS), skip_special_tokens=True) for p in PROMPTS}
    return request.param, path, want, ids


def complete(url: str, ids: list[int]) -> dict:
    return streamed_completion(url, "moe", ids, STEPS, timeout=180)


def test_tandem_up_serves_an_moe_equal_to_transformers(launcher, moe_dir):  # noqa: F811
    family, path, want, ids = moe_dir
    up = launcher("--model", str(path), "--served-model-name", "moe", "--draft-method", "ngram", "--dtype", "float32",
                  "--kv-cache-gb", "0.0625", "--max-num-seqs", "8", "--no-load-aware-speculation")
    up.wait_ready(timeout=240)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: one batch on the target
        got = dict(zip(PROMPTS, pool.map(lambda p: complete(up.url, ids[p]), PROMPTS)))
    for prompt in PROMPTS:
        assert got[prompt]["text"] == want[prompt], prompt
        assert got[prompt]["usage"]["completion_tokens"] == STEPS
    assert f"({family}, 2 layers" in up.logs()  # the target loaded it as that family
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(90) == 0, up.logs()[-4000:]
