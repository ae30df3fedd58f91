"""CUDA-graph bucketing and padding: the static, padded forward equals the eager one.

On CPU the graph runner runs its static forward eagerly (``capture=False``): bucket choice, the
padded layout, the scratch block and row selection are what is tested. The ``gpu`` tests capture
real graphs and check that replaying them gives what eager execution gives.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # the fused model's kernels, on CPU

from runtime.messages import SamplingParams  # noqa: E402
from tests.support.tiny_models import tiny_hf_model  # noqa: E402
from workers.engine.cuda_graphs import GraphConfig, batch_buckets  # noqa: E402
from workers.engine.engine import Engine, EngineConfig  # noqa: E402
from workers.engine.model_runner import ModelRunner  # noqa: E402
from workers.engine.weights import load_model  # noqa: E402
from workers.speculation.payloads import DraftOutput  # noqa: E402

pytestmark = pytest.mark.unit
CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_hf_model("llama", path, vocab=256, layers=2)
    return path


def test_batch_buckets():
    assert batch_buckets(1) == (1,)
    assert batch_buckets(6) == (1, 2, 4, 6)
    assert batch_buckets(64) == (1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64)
    assert batch_buckets(200)[-4:] == (96, 128, 160, 192, 200)[-4:]
    with pytest.raises(ValueError):
        batch_buckets(0)


def _runners(model, capture: bool):
    """An eager runner and a graph runner over the same weights, each with its own cache."""
    eager = ModelRunner(model, 32, 4)
    graphed = ModelRunner(model, 32, 4, GraphConfig(8, (1, 4), (1,), capture=capture), max_model_len=64)
    return eager, graphed


def _chunks(runner: ModelRunner, eager: ModelRunner, prompts: dict[str, list[int]]):
    """Prefill every prompt in both runners (eagerly); returns block tables."""
    tables, next_block = {}, 0
    for rid, prompt in prompts.items():
        n = -(-(len(prompt) + 8) // 4)
        tables[rid] = list(range(next_block, next_block + n))
        next_block += n
        for r in (runner, eager):
            r.forward([(prompt, 0, tables[rid])], [1])
    return tables


@pytest.mark.parametrize("fused", [False, True])
def test_padded_static_forward_equals_eager(model_dir, fused):
    """Decode of 3 sequences (bucket 4) and a verify step mixing 1, 2 and 4 new tokens (Q = 4)."""
    model = load_model(model_dir, device=DEVICE, fused=fused)
    if not fused:  # the torch path's static metadata reference
        assert model.static_capable
    eager, graphed = _runners(model, capture=False)
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(256) for _ in range(rng.randrange(3, 20))] for i in range(3)}
    tables = _chunks(graphed, eager, prompts)
    lens = {rid: len(p) for rid, p in prompts.items()}
    for new in ({"r0": 1, "r1": 1, "r2": 1}, {"r0": 1, "r1": 2, "r2": 4}):
        chunks = [([rng.randrange(256) for _ in range(n)], lens[rid], tables[rid]) for rid, n in new.items()]
        wants = [len(c[0]) for c in chunks]
        shape = graphed.graphs.shape_for(chunks, wants, (1,))
        assert shape == (4, max(wants), (1,), False)
        ref = eager.forward(chunks, wants, (1,))
        got = graphed.forward(chunks, wants, (1,))
        assert got.logits.shape == ref.logits.shape
        assert (got.logits - ref.logits).abs().max() < 1e-4
        assert (got.hidden[1] - ref.hidden[1]).abs().max() < 1e-4
        for rid, n in new.items():
            lens[rid] += n
    assert graphed.graphs.replays == 2
    # padding wrote only to the scratch block: every real block holds what the eager run holds
    for (k_ref, v_ref), (k_got, v_got) in zip(eager.kv_caches, graphed.kv_caches):
        assert k_got.shape[0] == k_ref.shape[0] + 1  # the scratch block
        assert (k_got[:32] - k_ref).abs().max() < 1e-5 and (v_got[:32] - v_ref).abs().max() < 1e-5


def test_uploaded_block_tables_hold_only_the_batch(model_dir):
    """The static block tables are rewritten in place step after step: entries past a row's table,
    and the bucket's rows past the batch, point at the scratch block, whatever earlier (longer)
    batches wrote."""
    model = load_model(model_dir, device=DEVICE)
    eager, graphed = _runners(model, capture=False)
    runner = graphed.graphs
    scratch = runner.scratch_block
    steps = [[([5], 9, [3, 4, 5]), ([6], 13, [0, 1, 2, 7]), ([7], 2, [8])],  # bucket 4
             [([5, 6], 10, [3, 4, 5])],  # fewer sequences, shorter tables, verify shape
             [([5], 1, [9])]]
    for chunks in steps:
        wants = [len(c[0]) for c in chunks]
        bucket = runner.shape_for(chunks, wants, ())[0]
        ref = eager.forward(chunks, wants)
        got = graphed.forward(chunks, wants)
        assert (got.logits - ref.logits).abs().max() < 1e-4
        tables = runner.block_tables.cpu()
        for b in range(bucket):
            table = chunks[b][2] if b < len(chunks) else []
            assert tables[b, : len(table)].tolist() == table
            assert bool((tables[b, len(table) :] == scratch).all())


def test_non_uniform_batches_run_eagerly(model_dir):
    model = load_model(model_dir, device=DEVICE)
    runner = ModelRunner(model, 32, 4, GraphConfig(2, (1, 3), capture=False), max_model_len=64)
    shape = runner.graphs.shape_for
    assert shape([([1, 2, 3], 0, [0])], [1], ()) is None  # prefill chunk
    assert shape([([1], 4, [0, 1])] * 3, [1] * 3, ()) is None  # more sequences than the largest bucket
    assert shape([([1] * 4, 4, [0, 1, 2])], [4], ()) is None  # longer than the longest captured query
    assert shape([([1, 2], 4, [0, 1])], [2], (2,)) == (1, 3, (2,), False)  # new hidden layers: captured on first use
    assert shape([([1, 2, 3], 4, [0, 1])], [3], (), [[-1, -1]]) is None  # a tree, and no tree graphs configured


def test_chains_replay_the_exact_length_and_trees_the_longest(model_dir):
    """With every length captured (the engine's default), a q-token chain verify uses the q graph, not
    one padded to γ+1 (1.4-1.8x the cost at batch 64 on an H200); a tree uses the γ+1 tree graph."""
    model = load_model(model_dir, device=DEVICE)
    runner = ModelRunner(model, 32, 4, GraphConfig(2, (1, 2, 3, 4), capture=False, trees=True), max_model_len=64)
    shape = runner.graphs.shape_for
    assert shape([([1, 2], 4, [0, 1])], [2], ()) == (1, 2, (), False)
    assert shape([([1, 2, 3], 4, [0, 1]), ([1], 4, [2, 3])], [3, 1], ()) == (2, 3, (), False)
    assert shape([([1, 2], 4, [0, 1])], [2], (), [[-1]]) == (1, 4, (), True)
    runner.graphs.capture_all()
    assert {(q, tree) for (_, q, _, tree) in runner.graphs.graphs} == {(1, False), (2, False), (3, False), (4, False),
                                                                        (4, True)}


class _GraphedEngine(Engine):
    """Graphs on any device (captured only on CUDA): decode and verify of up to γ drafts."""

    def _graph_config(self, model):
        gamma = self.spec.num_speculative_tokens
        return GraphConfig(4, (1, gamma + 1) if gamma else (1,), self.hidden_layers, capture=CUDA, trees=gamma > 1)


def _prompts(n: int, seed: int = 0) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {f"r{i}": [rng.randrange(256) for _ in range(rng.randrange(3, 30))] for i in range(n)}


def test_engine_greedy_equal_with_graphs(model_dir):
    """6 requests of different lengths: batches of 6 and 5 run eagerly, then buckets 4, 2 and 1 replay;
    tokens equal the plain engine's."""
    model = load_model(model_dir, device=DEVICE, fused=True)
    cfg = EngineConfig(num_blocks=128, block_size=4, max_num_seqs=6)
    prompts = _prompts(6)
    params = {rid: SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True)
              for i, rid in enumerate(prompts)}
    plain = Engine(model, cfg, eos_token_ids=()).generate(prompts, params)
    engine = _GraphedEngine(model, cfg, eos_token_ids=())
    assert engine.generate(prompts, params) == plain
    assert engine.runner.graphs.replays > 0


def _verify_with_graphs(model_dir, seed: int, num_speculative_tokens: int, propose) -> _GraphedEngine:
    """Three prompts decoded plainly, then by a graphed speculative engine whose drafts come from
    ``propose(step, i, inp, truth)`` (the i-th draft input of that step; truth: the plain continuation
    from where the request stands), as a DraftOutput's arguments after the round; asserts the output
    equals plain decoding and returns the graphed engine."""
    model = load_model(model_dir, device=DEVICE, fused=True)
    cfg = EngineConfig(num_blocks=128, block_size=4, max_num_seqs=4)
    prompts = _prompts(3, seed=seed)
    plain = Engine(model, cfg, eos_token_ids=()).generate(prompts, GREEDY)
    engine = _GraphedEngine(model, cfg, eos_token_ids=(), num_speculative_tokens=num_speculative_tokens,
                            adaptive=False)
    got = {rid: [] for rid in prompts}
    for rid, p in prompts.items():
        engine.add_request(rid, p, GREEDY)
    step = 0
    while engine.has_work():
        proposals = {}
        for i, inp in enumerate(engine.draft_inputs()):
            truth = plain[inp.seq_id][len(got[inp.seq_id]):]
            proposals[inp.seq_id] = DraftOutput(inp.seq_id, inp.round, *propose(step, i, inp, truth))
        for rid, delta in engine.step(proposals):
            got[rid].extend(delta.token_ids)
        step += 1
    assert got == plain
    return engine


def test_spec_engine_verify_steps_with_graphs(model_dir):
    """Verify steps with drafts of the right tokens (oracle) and wrong ones: output equals plain decoding."""

    def propose(step, i, inp, truth):
        future = truth[: inp.num_speculative_tokens]
        if step % 2:  # every other step a wrong last draft token
            future = future[:-1] + [(future[-1] + 1) % 256] if future else future
        return (future,)

    engine = _verify_with_graphs(model_dir, 1, 3, propose)
    assert engine.runner.graphs.replays > 0
    assert {key[1] for key in engine.runner.graphs.graphs} == {1, 4}


def test_tree_verify_steps_with_graphs(model_dir):
    """Token trees in the graphed verify step (the correct path among wrong siblings, chains beside
    them in the same batch): output equals plain decoding, and tree graphs were replayed."""

    def propose(step, i, inp, truth):
        f = truth[:3]
        if i == 0 or len(f) < 3:  # a chain
            return (f[: inp.num_speculative_tokens],)
        wrong = [(t + 7) % 256 for t in f]
        # root → {f0, w0}; f0 → {w1, f1}; f1 → f2: the accepted path is nodes 0, 3, 4
        return [f[0], wrong[0], wrong[1], f[1], f[2]], [], [-1, -1, 0, 0, 3]

    engine = _verify_with_graphs(model_dir, 2, 5, propose)
    assert any(key[3] for key in engine.runner.graphs.graphs)  # a tree graph ran
    assert engine.counters[""].accepted_per_pos[2] > 0  # three-deep paths were accepted


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="no CUDA GPU")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graph_replay_equals_eager_static_forward(model_dir, dtype):
    """Replaying a captured graph gives exactly what running the same static forward eagerly gives."""
    model = load_model(model_dir, device="cuda", dtype=dtype, fused=True)
    rng = random.Random(2)
    prompts = {f"r{i}": [rng.randrange(256) for _ in range(rng.randrange(3, 20))] for i in range(3)}
    runners = []
    for capture in (True, False):
        runner = ModelRunner(model, 32, 4, GraphConfig(8, (1, 4), capture=capture), max_model_len=64)
        tables = _chunks(runner, runner, {k: v for k, v in prompts.items()})
        runners.append((runner, tables))
    outs = []
    for runner, tables in runners:
        chunks = [([7, 8][: 1 + i % 2], len(prompts[rid]), tables[rid]) for i, rid in enumerate(prompts)]
        outs.append(runner.forward(chunks, [len(c[0]) for c in chunks]).logits)
    assert runners[0][0].graphs.graphs[(4, 4, (), False)].graph is not None
    assert torch.equal(outs[0], outs[1])
