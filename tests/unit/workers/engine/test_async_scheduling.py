"""Async scheduling is invisible in the output: step N+1 launched from step N's tokens on the device,
with step N's bookkeeping one step behind, gives exactly what the synchronous engine gives (greedy and
seeded sampling, float32, CPU) under chunked prefill, stop tokens, max_tokens, min_tokens, the context
length, aborts, preemption, the prefix cache, logprobs and speculative steps; and every step that can
run ahead does (the device-side input path is taken, not bypassed)."""

from __future__ import annotations

import asyncio
import random
from collections import Counter

import pytest

from runtime.messages import KvEventKind, SamplingParams, TokenDelta
from tests.support.engine_load import mixed_requests
from tests.support.tiny_models import tiny_hf_model
from tests.unit.workers.engine.test_spec_engine import make_proposer, run_spec
from tests.unit.workers.engine.test_spec_engine import prompts as spec_prompts
from workers.engine.cuda_graphs import GraphConfig
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model
from workers.target.step_loop import StepLoop

pytestmark = pytest.mark.unit

VOCAB = 256
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama", path, vocab=VOCAB)
    return path


@pytest.fixture(scope="module")
def model(model_dir):
    return load_model(model_dir)


def _prompts(n: int, seed: int) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randrange(3, 60))] for i in range(n)}


def _engine(model, async_scheduling: bool, eos: tuple[int, ...] = (), **kw) -> Engine:
    cfg = EngineConfig(**{"num_blocks": 256, "block_size": 4, "max_num_batched_tokens": 48, **kw},
                       async_scheduling=async_scheduling)
    engine = Engine(model, cfg, eos_token_ids=eos)
    _count_device_inputs(engine)
    return engine


def _count_device_inputs(engine: Engine) -> None:
    """``engine.device_fed``: steps whose inputs took a token from the device; ``engine.computed``:
    tokens the forward passes computed (a step scheduled for nothing shows here)."""
    forward = engine.runner.forward
    engine.device_fed = engine.computed = engine.forwards = 0

    def counting(chunks, logits_last, hidden_layers=(), trees=None, last_from=None):
        if last_from is not None and any(r >= 0 for r in last_from[1]):
            engine.device_fed += 1
        engine.computed += sum(len(c) for c, _, _ in chunks)
        engine.forwards += 1
        return forward(chunks, logits_last, hidden_layers, trees, last_from)

    engine.runner.forward = counting


def _drive(engine: Engine, arrivals: dict[int, list[tuple[str, list[int], SamplingParams]]],
           aborts: dict[int, list[str]] | None = None) -> dict[str, list[TokenDelta]]:
    """Step to the end; ``arrivals[k]`` are added and ``aborts[k]`` aborted before the k-th step.
    Returns every request's deltas in order."""
    out: dict[str, list[TokenDelta]] = {}
    aborts = aborts or {}
    step = 0
    while step <= max(arrivals, default=0) or engine.has_work():
        for rid, prompt, params in arrivals.get(step, []):
            engine.add_request(rid, prompt, params)
            out[rid] = []
        for rid in aborts.get(step, []):
            engine.abort(rid)
        for rid, delta in engine.step():
            out[rid].append(delta)
        step += 1
        assert step < 5000
    return out


def _tokens(deltas: dict[str, list[TokenDelta]]) -> dict[str, list[int]]:
    return {rid: [t for d in ds for t in d.token_ids] for rid, ds in deltas.items()}


def _same(sync: dict[str, list[TokenDelta]], fast: dict[str, list[TokenDelta]]) -> None:
    """Token for token, delta for delta: finish reasons, usage and logprobs (to float noise: a
    different batch may round differently) too."""
    assert _tokens(fast) == _tokens(sync)
    for rid, want in sync.items():
        got = fast[rid]
        assert [(d.finish_reason, d.usage) for d in got] == [(d.finish_reason, d.usage) for d in want], rid
        for g, w in zip(got, want):
            assert (g.logprobs is None) == (w.logprobs is None)
            if w.logprobs is not None:
                assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
                assert [[t.token_id for t in row] for row in g.top_logprobs] == \
                       [[t.token_id for t in row] for row in w.top_logprobs]


def _both(model, arrivals, **kw) -> tuple[dict, dict, Engine, Engine]:
    """(sync deltas, async deltas, the async engine, the sync engine)"""
    reference = _engine(model, False, **kw)
    sync = _drive(reference, arrivals)
    engine = _engine(model, True, **kw)
    fast = _drive(engine, arrivals)
    return sync, fast, engine, reference


def _idle(engine: Engine) -> None:
    assert not engine.seqs and engine._pending is None
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks
    assert all(c == 0 for c in engine.blocks.ref_count)


# ---------------------------------------------------------------------------------------- plain steps


def test_mixed_batch_with_chunked_prefill_and_staggered_arrivals_equals_sync(model):
    prompts = _prompts(16, seed=0)
    arrivals = {i: [(rid, p, GREEDY)] for i, (rid, p) in enumerate(prompts.items())}  # one joins per step
    sync, fast, engine, reference = _both(model, arrivals)
    _same(sync, fast)
    assert all(len(t) == 24 for t in _tokens(fast).values())
    # the async path was taken: most decode steps read their inputs from the device
    assert engine.device_fed > 24
    # every request ends by max_tokens, which is known at launch: not one token computed in vain
    assert engine.computed == reference.computed
    _idle(engine)


def test_a_queue_longer_than_max_num_seqs_runs_in_as_many_steps(model):
    """A sequence ending by length frees its place for a waiting one in the step it would have in the
    synchronous engine, although its last token is still on the device."""
    prompts = _prompts(12, seed=16)
    arrivals = {0: [(rid, p, SamplingParams(temperature=0, max_tokens=4 + 3 * i, ignore_eos=True))
                    for i, (rid, p) in enumerate(prompts.items())]}
    sync, fast, engine, reference = _both(model, arrivals, max_num_seqs=4)
    _same(sync, fast)
    assert (engine.forwards, engine.computed) == (reference.forwards, reference.computed)
    _idle(engine)


def test_stop_tokens_max_tokens_min_tokens_and_eos_finish_exactly(model):
    """Sequences finish at different steps on their own stop token, eos, max_tokens and the context
    length; min_tokens holds a stop token back; ignore_eos runs past eos."""
    prompts = _prompts(12, seed=1)
    free = _tokens(_drive(_engine(model, False), {0: [(rid, p, GREEDY) for rid, p in prompts.items()]}))
    eos = Counter(t for out in free.values() for t in out).most_common(1)[0][0]  # one that occurs
    arrivals: dict[int, list] = {}
    for i, (rid, p) in enumerate(prompts.items()):
        out = free[rid]
        if i % 4 == 0:  # its own stop token, somewhere in its free run
            params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[out[2 + i % 9]], ignore_eos=True)
        elif i % 8 == 1:  # the same, held back by min_tokens past its first occurrence
            stop = out[1 + i % 7]
            params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop],
                                    min_tokens=out.index(stop) + 2, ignore_eos=True)
        elif i % 8 == 5:  # min_tokens right at the stop token's first place: allowed there, not one later
            k = next(k for k in range(2, 24) if out[k] not in out[:k])
            params = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[out[k]], min_tokens=k,
                                    ignore_eos=True)
            boundary = (rid, k)
        elif i % 4 == 2:  # eos stops it (unless it never comes), short max_tokens for some
            params = SamplingParams(temperature=0, max_tokens=3 + i)
        else:  # eos ignored, max_tokens 1 .. 12
            params = SamplingParams(temperature=0, max_tokens=1 + i, ignore_eos=True)
        arrivals.setdefault(i % 3, []).append((rid, p, params))
    sync, fast, engine, reference = _both(model, arrivals, eos=(eos,))
    _same(sync, fast)
    reasons = Counter(ds[-1].finish_reason for ds in fast.values())
    assert reasons["stop"] >= 3 and reasons["length"] >= 3, reasons
    assert len(_tokens(fast)[boundary[0]]) == boundary[1] + 1
    # a stop token is seen one step late: at most one token computed in vain per stopped request
    assert reference.computed <= engine.computed <= reference.computed + reasons["stop"]
    assert any(eos in t for rid, t in _tokens(fast).items() if int(rid[1:]) % 4 == 3)  # ignore_eos ran past it
    _idle(engine)


def test_running_up_to_the_context_length_finishes_exactly(model):
    prompts = _prompts(6, seed=2)
    arrivals = {0: [(rid, p, SamplingParams(temperature=0, max_tokens=72 - len(p), ignore_eos=True))
                    for rid, p in prompts.items()]}
    sync, fast, engine, _ = _both(model, arrivals, max_model_len=72)
    _same(sync, fast)
    assert {ds[-1].finish_reason for ds in fast.values()} == {"length"}
    assert all(ds[-1].usage.prompt_tokens + ds[-1].usage.completion_tokens == 72 for ds in fast.values())
    _idle(engine)


def test_seeded_sampling_draws_as_sync_does(model):
    prompts = _prompts(10, seed=3)
    arrivals = {i % 4: [] for i in range(4)}
    for i, (rid, p) in enumerate(prompts.items()):
        params = SamplingParams(temperature=0.7 + 0.1 * (i % 4), top_p=0.9 if i % 2 else 1.0, top_k=40 * (i % 3),
                                min_p=0.05 * (i % 2), seed=100 + i, max_tokens=12 + i, ignore_eos=True)
        arrivals[i % 4].append((rid, p, params))
    sync, fast, engine, _ = _both(model, arrivals)
    _same(sync, fast)
    assert engine.device_fed > 10
    greedy = _tokens(_drive(_engine(model, False), {0: [(rid, p, GREEDY) for rid, p in prompts.items()]}))
    assert any(_tokens(fast)[rid][:12] != greedy[rid][:12] for rid in prompts)  # it really sampled
    _idle(engine)


def test_logprobs_come_one_step_behind_with_their_tokens(model):
    prompts = _prompts(6, seed=4)
    arrivals = {0: [(rid, p, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=i % 3 or None))
                    for i, (rid, p) in enumerate(prompts.items())]}
    sync, fast, engine, _ = _both(model, arrivals)
    _same(sync, fast)
    assert engine.device_fed > 5 and any(d.top_logprobs for ds in fast.values() for d in ds)
    _idle(engine)


def test_preemption_when_blocks_run_out_equals_sync(model):
    """Preempted with a token still on the device, a sequence keeps that token (it is recomputed with
    the rest): seeded sampling shows it, as a dropped token would be drawn again."""
    prompts = _prompts(8, seed=5)
    params = {rid: GREEDY if i % 2 else SamplingParams(temperature=1.0, seed=i, max_tokens=24, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    arrivals = {0: [(rid, p, params[rid]) for rid, p in prompts.items()]}
    sync = _drive(_engine(model, False, num_blocks=40, max_model_len=160), arrivals)
    engine = _engine(model, True, num_blocks=40, max_model_len=160)
    preempt, victims = engine.scheduler._preempt, []

    def recording(seq, batch):
        victims.append(seq.num_pending)
        preempt(seq, batch)

    engine.scheduler._preempt = recording
    fast = _drive(engine, arrivals)
    _same(sync, fast)
    assert any(victims), victims  # some victim had its latest token on the device
    assert engine.device_fed > 10
    _idle(engine)


def test_prefix_cache_hits_and_kv_events_equal_sync(model):
    """A second wave continues the first wave's conversations (prompt + output + more): its hits
    include blocks completed by generated tokens, which async scheduling registers one step later
    than the synchronous engine; the stored blocks and every request's cached_tokens must not change."""
    first = _prompts(8, seed=6)
    free = _tokens(_drive(_engine(model, False), {0: [(rid, p, GREEDY) for rid, p in first.items()]}))
    params = {}
    for i, (rid, p) in enumerate(first.items()):
        if i % 2:  # ends by max_tokens
            params[rid] = SamplingParams(temperature=0, max_tokens=9 + 2 * i, ignore_eos=True)
        else:  # ends on a stop token whose own position completes a block (its KV is never computed in
            # sync; async computes it in the step launched before the host saw it: it must not be cached)
            out = free[rid]
            fits = [k for k in range(8, 24) if out[k] not in out[:k]]
            k = next((k for k in fits if (len(p) + k + 1) % 4 == 0), fits[0])
            params[rid] = SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[out[k]], ignore_eos=True)
    results = []
    for async_scheduling in (False, True):
        engine = _engine(model, async_scheduling)
        wave1 = _drive(engine, {0: [(rid, p, params[rid]) for rid, p in first.items()]})
        rng = random.Random(7)
        second = {f"f{rid}": first[rid] + _tokens(wave1)[rid] + [rng.randrange(VOCAB) for _ in range(5)]
                  for rid in first}
        wave2 = _drive(engine, {0: [(rid, p, GREEDY) for rid, p in second.items()]})
        events = engine.drain_kv_events()
        stored = Counter(h for e in events if e.kind == KvEventKind.STORED for h in e.block_hashes)
        removed = [e for e in events if e.kind == KvEventKind.REMOVED]
        results.append((wave1, wave2, stored, removed, engine))
    (s1, s2, s_stored, s_removed, _), (f1, f2, f_stored, f_removed, engine) = results
    _same(s1, f1)
    assert Counter(ds[-1].finish_reason for ds in f1.values()) == {"stop": 4, "length": 4}
    _same(s2, f2)
    assert all(ds[-1].usage.cached_tokens > len(first[rid[1:]]) for rid, ds in f2.items())  # hits past the prompt
    assert f_stored == s_stored and not s_removed and not f_removed
    _idle(engine)


def test_aborts_mid_run_and_a_reused_request_id(model):
    """Aborted requests free everything (even with a token still on the device) and deliver a prefix
    of what they would have; the others, and a new request reusing an aborted id, are unaffected."""
    prompts = _prompts(8, seed=8)
    alone = _tokens(_drive(_engine(model, False), {0: [(rid, p, GREEDY) for rid, p in prompts.items()]}))
    engine = _engine(model, True)
    aborted = {"r1": 3, "r4": 9, "r6": 14}  # step before which each is aborted
    arrivals = {0: [(rid, p, GREEDY) for rid, p in prompts.items()], 16: [("r4", prompts["r2"], GREEDY)]}
    aborts: dict[int, list[str]] = {}
    for rid, step in aborted.items():
        aborts.setdefault(step, []).append(rid)
    seen_pending = []

    def probe(step):  # an aborted request still had a token on the device when it was aborted
        if step in aborts:
            seen_pending.extend(engine.seqs[r].num_pending for r in aborts[step])

    out: dict[str, list[int]] = {}
    step = 0
    while step <= 16 or engine.has_work():
        for rid, p, params in arrivals.get(step, []):
            engine.add_request(rid, p, params)
            out[rid] = [] if step == 0 else out.get(rid, []) + ["|"]
        probe(step)
        for rid in aborts.get(step, []):
            engine.abort(rid)
        for rid, delta in engine.step():
            out[rid].extend(delta.token_ids)
        step += 1
    for rid in prompts:
        if rid == "r4":
            before, again = out[rid][: out[rid].index("|")], out[rid][out[rid].index("|") + 1 :]
            assert before == alone["r4"][: len(before)] and len(before) < 24
            assert again == alone["r2"]  # the new request under the old id
        elif rid in aborted:
            assert out[rid] == alone[rid][: len(out[rid])] and len(out[rid]) < 24
        else:
            assert out[rid] == alone[rid]
    assert any(seen_pending)
    _idle(engine)


def test_many_mixed_requests_with_aborts_leave_nothing_behind(model):
    """A long random run (sampled and greedy, stops, aborts, a small cache that evicts and preempts)."""
    engine = _engine(model, True, eos=(7,), num_blocks=48, max_model_len=128, max_num_seqs=16)
    mixed_requests(engine, random.Random(9), 300, vocab=VOCAB, max_tokens=10, abort_p=0.15, finished_are_live=True,
                   extra=lambda rng: {"stop_token_ids": [rng.randrange(VOCAB)], "logprobs": rng.choice([None, 2])})
    events = engine.drain_kv_events()
    assert any(e.kind == KvEventKind.REMOVED for e in events)
    assert engine.device_fed > 50
    _idle(engine)


class _GraphedEngine(Engine):
    """Decode steps through the CUDA-graph runner's static, padded layout (run eagerly on a CPU)."""

    def _graph_config(self, model):
        return GraphConfig(8, (1,), (), capture=False)


def test_graphed_decode_steps_take_their_inputs_from_the_device(model):
    """In the graph runner's padded layout the previous step's tokens land in the static input buffer."""
    prompts = _prompts(6, seed=15)
    params = {rid: GREEDY if i % 2 else SamplingParams(temperature=0.9, seed=i, max_tokens=24, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    arrivals = {i: [(rid, prompts[rid], params[rid])] for i, rid in enumerate(prompts)}
    sync = _drive(_engine(model, False), arrivals)
    engine = _GraphedEngine(model, EngineConfig(num_blocks=256, block_size=4, max_num_batched_tokens=48,
                                                async_scheduling=True), eos_token_ids=())
    _count_device_inputs(engine)
    fast = _drive(engine, arrivals)
    _same(sync, fast)
    assert engine.runner.graphs.replays > 10 and engine.device_fed > 10
    _idle(engine)


def test_sequences_needing_host_state_run_synchronously(model):
    """Penalties read the output so far: a step with such a sequence is not left pending (and the
    output still equals sync)."""
    prompts = _prompts(4, seed=10)
    params = {rid: SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3,
                                  frequency_penalty=0.5) if rid == "r0" else GREEDY for rid in prompts}
    arrivals = {0: [(rid, p, params[rid]) for rid, p in prompts.items()]}
    sync, fast, engine, _ = _both(model, arrivals)
    _same(sync, fast)
    _idle(engine)
    # while r0 runs, no step takes a device token: its every step is resolved before the next
    engine = _engine(model, True)
    engine.add_request("r0", prompts["r0"], params["r0"])
    while engine.has_work():
        engine.step()
        assert engine._pending is None
    assert engine.device_fed == 0


# ---------------------------------------------------------------------------------------- speculative steps


SPEC_CFG = dict(block_size=4, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=256)


@pytest.fixture(scope="module")
def spec_models(tmp_path_factory):
    target_dir = tmp_path_factory.mktemp("spec-target")
    draft_dir = tmp_path_factory.mktemp("spec-draft")
    tiny_hf_model("llama", target_dir, seed=1, vocab=96, layers=2)
    tiny_hf_model("llama", draft_dir, seed=2, vocab=96, layers=1)
    return target_dir, draft_dir


def _spec_engine(target_dir, async_scheduling: bool) -> Engine:
    engine = Engine(load_model(target_dir), EngineConfig(**SPEC_CFG, async_scheduling=async_scheduling),
                    num_speculative_tokens=4)
    _count_device_inputs(engine)
    return engine


@pytest.mark.parametrize("method", ["ngram", "draft_model_tree", "self_draft"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_speculative_decoding_equals_sync(spec_models, method, temperature):
    """run_spec asks for proposals before every step: plain steps between verify steps run ahead
    (pending), the proposal request brings their tokens to the host first, verify steps run on them."""
    target_dir, draft_dir = spec_models
    batch = spec_prompts(16, seed=11)
    params = SamplingParams(temperature=temperature, seed=5 if temperature else None, max_tokens=20,
                            ignore_eos=True)
    got = []
    for async_scheduling in (False, True):
        engine = _spec_engine(target_dir, async_scheduling)
        proposer = make_proposer(method, target_dir, draft_dir)
        items = list(batch.items())
        out = {}
        for start in range(0, len(items), 8):
            out.update(run_spec(engine, proposer, dict(items[start : start + 8]), params))
        assert engine.blocks.num_free_blocks == engine.blocks.num_blocks and len(proposer) == 0
        got.append((out, engine))
    (sync, _), (fast, engine) = got
    assert fast == sync
    assert engine.counters[""].num_drafts > 0
    if temperature == 0:
        plain = Engine(load_model(target_dir), EngineConfig(**SPEC_CFG)).generate(batch, params)
        assert fast == plain


def test_verify_steps_after_pending_steps_and_late_proposals(spec_models):
    """Proposals asked only every third step and handed in a step late (stale: drafted from a state
    one token behind): plain steps run ahead in between, a step given proposals first brings the
    pending tokens to the host, and greedy output is still plain decoding's."""
    target_dir, draft_dir = spec_models
    batch = spec_prompts(8, seed=12)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    want = Engine(load_model(target_dir), EngineConfig(**SPEC_CFG)).generate(batch, params)
    engine = _spec_engine(target_dir, True)
    proposer = make_proposer("self_draft", target_dir, draft_dir)
    out = {rid: [] for rid in batch}
    for rid, p in batch.items():
        engine.add_request(rid, p, params)
    step, held, flushed_by_proposals = 0, {}, 0
    while engine.has_work():
        proposals, held = held, {}
        if step % 3 == 0:
            inputs = engine.draft_inputs()
            held = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}  # given one step late
        if proposals and engine._pending is not None:
            flushed_by_proposals += 1
        for rid, delta in engine.step(proposals):
            out[rid].extend(delta.token_ids)
        proposer.verified(engine.take_verdicts())
        proposer.release(engine.take_released())
        step += 1
    assert out == want
    assert flushed_by_proposals > 0 and engine.device_fed > 0 and engine.counters[""].num_accepted_tokens > 0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_a_connected_draft_worker_keeps_speculating_sequences_synchronous(spec_models):
    """With a draft worker connected (the step loop sets draft_id), a speculating sequence's next
    round needs this step's tokens on the host: its steps are not left pending."""
    target_dir, draft_dir = spec_models
    batch = spec_prompts(4, seed=13)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    engine = _spec_engine(target_dir, True)
    engine.spec.draft_id = "d"
    proposer = make_proposer("ngram", target_dir, draft_dir)
    got = run_spec(engine, proposer, batch, params, before_step=lambda _: None)
    assert engine.device_fed == 0
    assert got == Engine(load_model(target_dir), EngineConfig(**SPEC_CFG)).generate(batch, params)


# ---------------------------------------------------------------------------------------- the worker's loop


async def test_the_step_loop_serves_an_async_engine(model):
    prompts = _prompts(6, seed=14)
    want = _tokens(_drive(_engine(model, False), {0: [(rid, p, GREEDY) for rid, p in prompts.items()]}))
    engine = _engine(model, True)
    loop = StepLoop(engine)
    loop.start()
    try:
        queues = {rid: loop.submit(rid, p, GREEDY) for rid, p in prompts.items()}

        async def drain(queue):
            tokens = []
            while True:
                delta = await asyncio.wait_for(queue.get(), 20)
                tokens.extend(delta.token_ids)
                if delta.finish_reason:
                    return tokens

        got = dict(zip(queues, await asyncio.gather(*map(drain, queues.values()))))
    finally:
        await loop.stop()
    assert got == want
    assert engine.device_fed > 0
    _idle(engine)
