"""Suffix decoding through the target's speculative engine is lossless: greedy output equals plain
decoding token for token (float32, CPU), one request at a time and 8 in a batch, chains and trees,
on a tiny random Llama and on SmolLM2 with repeated structured outputs."""

from __future__ import annotations

import pytest

from runtime.messages import SamplingParams
from tests.unit.workers.engine.test_spec_engine import CFG, models, plain, prompts, run_spec  # noqa: F401 (fixture)
from workers.draft.suffix import SuffixConfig, SuffixProposer
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit


def serve(engine: Engine, proposer, batch: dict[str, list[int]], params: SamplingParams, per_step: int
          ) -> dict[str, list[int]]:
    got: dict[str, list[int]] = {}
    items = list(batch.items())
    for start in range(0, len(items), per_step):
        got.update(run_spec(engine, proposer, dict(items[start : start + per_step]), params))
    return got


@pytest.mark.parametrize("concurrent", [1, 8])
@pytest.mark.parametrize("topk", [1, 3])
def test_greedy_suffix_speculation_equals_plain_decoding(models, concurrent, topk):  # noqa: F811
    target_dir, _ = models
    batch = prompts(24 if concurrent == 1 else 48, seed=31 + topk)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = plain(target_dir, batch, params)
    engine = Engine(load_model(target_dir), CFG, num_speculative_tokens=4)
    proposer = SuffixProposer(SuffixConfig(tree_topk=topk))
    assert serve(engine, proposer, batch, params, concurrent) == want
    first = engine.counters[""]
    drafted, accepted = first.num_draft_tokens, first.num_accepted_tokens
    assert accepted > 0 and len(proposer) == 0  # every sequence released on the draft side
    # The same prompts again: the global tree now holds their outputs, and acceptance rises.
    again = {f"again-{rid}": toks for rid, toks in batch.items()}
    assert serve(engine, proposer, again, params, concurrent) == {f"again-{r}": t for r, t in want.items()}
    second = engine.counters[""]
    rate2 = (second.num_accepted_tokens - accepted) / (second.num_draft_tokens - drafted)
    assert rate2 > accepted / drafted and proposer.won["global"] > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


TOOLS = ["get_weather", "search_flights", "book_table", "convert_currency"]
ARGS = ["Paris", "Tokyo", "Lima", "Oslo"]


def test_suffix_speculation_on_smollm2_tool_calls_is_lossless():
    from transformers import AutoTokenizer

    from workers.demo_model import demo_model_dir

    path = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    system = ('You call tools. Answer with one JSON object: {"tool": NAME, "arguments": {...}}. Tools: '
              + ", ".join(TOOLS) + ".")
    prompts = {}
    for i, (tool, city) in enumerate((t, c) for t in TOOLS for c in ARGS):
        text = tok.apply_chat_template([{"role": "system", "content": system},
                                        {"role": "user", "content": f"Use {tool} for {city}."}],
                                       add_generation_prompt=True, tokenize=False)
        prompts[f"p{i}"] = tok(text, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cfg = EngineConfig(block_size=16, num_blocks=2048, max_num_seqs=16, max_num_batched_tokens=2048)
    model = load_model(path)
    want = Engine(model, cfg).generate(prompts, params)
    engine = Engine(model, cfg, num_speculative_tokens=4)
    proposer = SuffixProposer()
    assert serve(engine, proposer, prompts, params, 8) == want
    counters = engine.counters[""]
    assert counters.num_accepted_tokens > 0 and proposer.won["global"] > 0
