"""SmolLM2-135M with prompt-lookup drafting: greedy output equals plain decoding on 50 real prompts."""

from __future__ import annotations

import pytest

from runtime.messages import SamplingParams
from tests.unit.workers.engine.test_spec_engine import run_spec
from workers.demo_model import demo_model_dir
from workers.draft.ngram import NgramProposer
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

SUBJECTS = ["the router", "a draft worker", "the target worker", "etcd", "NATS", "the frontend", "a KV block",
            "the scheduler", "speculative decoding", "the prefix cache"]
TEMPLATES = [
    "Question: what does {s} do? Answer: {s} is a component. Question: what does {s} need? Answer:",
    "List three facts about {s}.\n1. {s} runs on a CPU.\n2. {s} runs on a GPU.\n3.",
    "def describe():\n    # describe {s}\n    return '{s}'\n\ndef explain():\n    # explain {s}\n",
    "In this guide we explain {s}. First, {s} starts. Then {s} waits. Finally, {s}",
    "<|im_start|>user\nRepeat after me: {s} is fast, {s} is simple.<|im_end|>\n<|im_start|>assistant\n",
]
CFG = EngineConfig(block_size=16, num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=1024)


def test_ngram_speculation_on_smollm2_is_lossless():
    from transformers import AutoTokenizer

    path = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    prompts = {f"p{i}": tok(t.format(s=s))["input_ids"] for i, (t, s) in
               enumerate((t, s) for t in TEMPLATES for s in SUBJECTS)}
    assert len(prompts) >= 50
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    model = load_model(path)
    want = Engine(model, CFG).generate(prompts, params)
    engine = Engine(model, CFG, num_speculative_tokens=4)
    proposer = NgramProposer(1, 4)
    got = {}
    items = list(prompts.items())
    for start in range(0, len(items), 8):  # 8 concurrent requests in one batch
        got.update(run_spec(engine, proposer, dict(items[start : start + 8]), params))
    assert got == want
    counters = engine.counters[""]
    assert counters.num_accepted_tokens > 0  # prompt lookup does find continuations in real text
