"""Engine behaviour: batching invariance, preemption, prefix caching, limits, sampling options."""

import random

import pytest
import torch

from runtime.errors import InvalidRequest
from runtime.messages import KvEventKind, SamplingParams
from tests.support.engine_load import mixed_requests
from tests.support.tiny_models import tiny_model_fixture
from workers.engine.engine import Engine, EngineConfig

pytestmark = pytest.mark.unit

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


model = tiny_model_fixture(vocab=256, load=True)


def _prompts(n: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(256) for _ in range(rng.randrange(3, 60))] for i in range(n)}


def _engine(model, **kw) -> Engine:
    return Engine(model, EngineConfig(**{"num_blocks": 256, "block_size": 4, **kw}), eos_token_ids=(0,))


def test_16_concurrent_greedy_requests_equal_each_alone(model):
    prompts = _prompts(16)
    alone = {rid: _engine(model).generate({rid: p}, GREEDY)[rid] for rid, p in prompts.items()}
    engine = _engine(model, max_num_batched_tokens=48)  # chunked prefill shares steps with decodes
    got = {rid: [] for rid in prompts}
    pending = list(prompts.items())
    while pending or engine.has_work():
        if pending:  # continuous batching: one new request joins between steps
            rid, p = pending.pop(0)
            engine.add_request(rid, p, GREEDY)
        for rid, delta in engine.step():
            got[rid].extend(delta.token_ids)
    assert got == alone
    assert engine.blocks.num_free_blocks == 256


def test_preemption_by_recompute_keeps_outputs_and_frees_blocks(model):
    prompts = _prompts(8, seed=1)
    alone = {rid: _engine(model).generate({rid: p}, GREEDY)[rid] for rid, p in prompts.items()}
    engine = _engine(model, num_blocks=40, max_model_len=160)
    assert engine.generate(prompts, GREEDY) == alone
    assert engine.scheduler.num_preemptions > 0
    assert engine.blocks.num_free_blocks == 40


def test_seeded_sampling_is_reproducible_alone_and_in_a_batch(model):
    params = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=11, max_tokens=16, ignore_eos=True)
    prompt = _prompts(1)["r0"]
    first = _engine(model).generate({"a": prompt}, params)["a"]
    assert _engine(model).generate({"a": prompt}, params)["a"] == first
    mixed = {**_prompts(5, seed=3), "a": prompt}
    per = {rid: SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True) for rid in mixed}
    per["a"] = params
    assert _engine(model).generate(mixed, per)["a"] == first
    other = SamplingParams(temperature=0.9, top_p=0.9, top_k=50, seed=12, max_tokens=16, ignore_eos=True)
    assert _engine(model).generate({"a": prompt}, other)["a"] != first


@pytest.mark.parametrize("tokens, params, field", [
    ([], SamplingParams(), "prompt"),
    ([1, 2], SamplingParams(max_tokens=-1), "max_tokens"),
    ([1] * 300, SamplingParams(max_tokens=1), "prompt"),
    ([1] * 100, SamplingParams(max_tokens=200), "max_tokens"),
    ([1, 2], SamplingParams(top_p=0.0), "top_p"),
    ([1, 2], SamplingParams(top_p=1.5), "top_p"),
    ([1, 2], SamplingParams(temperature=-0.1), "temperature"),
    ([1, 2], SamplingParams(top_k=-1), "top_k"),
    ([1, 2], SamplingParams(min_tokens=5, max_tokens=2), "min_tokens"),
    ([1, 2], SamplingParams(logprobs=-1), "logprobs"),
    ([1, 999], SamplingParams(), "prompt"),
])
def test_bad_requests_raise_invalid_request_naming_the_field(model, tokens, params, field):
    engine = _engine(model, max_model_len=256)
    with pytest.raises(InvalidRequest) as err:
        engine.add_request("x", tokens, params)
    assert err.value.field == field
    assert not engine.has_work()


def test_stop_tokens_min_tokens_and_eos(model):
    prompt = _prompts(1)["r0"]
    free = _engine(model).generate({"a": prompt}, GREEDY)["a"]
    stop_at = free[5]
    first = free.index(stop_at)
    out = _engine(model).generate({"a": prompt}, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at],
                                                              ignore_eos=True))["a"]
    assert out == free[: first + 1]
    # min_tokens: the stop token is banned until enough tokens were generated
    late = _engine(model).generate({"a": prompt}, SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_at],
                                                               min_tokens=first + 1, ignore_eos=True))["a"]
    assert stop_at not in late[: first + 1]
    # eos (id 0 in this engine) is a stop token unless ignore_eos
    engine = Engine(model, EngineConfig(num_blocks=256, block_size=4), eos_token_ids=(free[2],))
    engine.add_request("e", prompt, SamplingParams(temperature=0, max_tokens=24))
    deltas = []
    while engine.has_work():
        deltas.extend(d for _, d in engine.step())
    assert deltas[-1].finish_reason == "stop" and [t for d in deltas for t in d.token_ids][-1] == free[2]
    assert deltas[-1].usage.completion_tokens == len(deltas)


def test_logprobs_match_log_softmax(model):
    engine = _engine(model)
    prompt = _prompts(1)["r0"]
    engine.add_request("a", prompt, SamplingParams(temperature=0, max_tokens=1, logprobs=3))
    (_, delta), = engine.step()
    with torch.inference_mode():
        from workers.engine.attention import AttentionMetadata, allocate_kv_cache
        cfg = model.cfg
        kv = allocate_kv_cache(cfg.num_layers, 32, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
        n = len(prompt)
        logits = model(torch.tensor(prompt), torch.arange(n), AttentionMetadata.build([n], [n], [list(range(16))], 4),
                       kv).logits[-1]
    logp = logits.log_softmax(-1)
    assert delta.logprobs[0] == pytest.approx(logp.max().item(), abs=1e-5)
    assert [t.token_id for t in delta.top_logprobs[0]] == logp.topk(3).indices.tolist()
    assert delta.finish_reason == "length" and delta.usage.prompt_tokens == n


def test_migration_continues_after_output_ids_and_prefix_hits_are_reported(model):
    prompt = _prompts(1)["r0"] + list(range(40))
    engine = _engine(model)
    full = engine.generate({"a": prompt}, GREEDY)["a"]
    engine.add_request("b", prompt, SamplingParams(temperature=0, max_tokens=24 - 7, ignore_eos=True), output_ids=full[:7])
    deltas = []
    while engine.has_work():
        deltas.extend(d for _, d in engine.step())
    assert [t for d in deltas for t in d.token_ids] == full[7:]
    usage = deltas[-1].usage
    assert usage.completion_tokens == 24 and usage.prompt_tokens == len(prompt)
    assert usage.cached_tokens == (len(prompt) + 7 - 1) // 4 * 4  # all full blocks but never the last token


def test_eviction_publishes_removed_and_500_mixed_requests_leave_no_blocks(model):
    engine = _engine(model, num_blocks=48, max_model_len=128, max_num_seqs=16)
    mixed_requests(engine, random.Random(5), 500, vocab=256, max_tokens=8, abort_p=0.1)
    events = engine.drain_kv_events()
    assert any(e.kind == KvEventKind.REMOVED for e in events)
    assert any(e.kind == KvEventKind.STORED for e in events)
    assert [e.event_id for e in events] == list(range(1, len(events) + 1))
    assert engine.blocks.num_free_blocks == 48 and all(c == 0 for c in engine.blocks.ref_count)
    assert not engine.seqs
