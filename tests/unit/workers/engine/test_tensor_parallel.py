"""Tensor parallelism: a model split over 2 ranks (this process as rank 0, one real follower process,
gloo on 127.0.0.1) gives the same greedy tokens as the whole model, plain and speculative (chains and
trees), for the demo model (9 query / 3 KV heads: an uneven split) and tiny models whose KV heads do
not split evenly over the ranks (3 KV heads over 2 ranks; 1 KV head replicated on both), with an odd
vocabulary (a padded vocabulary slice), tied embeddings and qkv biases. A killed rank fails the next
step at once, never a hang."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
from pathlib import Path

import pytest
import torch

from runtime.messages import SamplingParams
from tests.support.tiny_models import tiny_hf_model, write_llama_gguf
from tests.unit.workers.engine.test_spec_engine import make_proposer, run_spec
from workers.engine.engine import Engine, EngineConfig
from workers.engine.followers import load_sharded
from workers.engine.parallel import HeadSplit, TensorParallelFailed, split_heads, split_range, vocab_slice
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

CFG = EngineConfig(block_size=4, num_blocks=512, max_num_seqs=8, max_num_batched_tokens=256)
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


# ---------------------------------------------------------------------- the split (pure)


def test_heads_split_evenly_unevenly_and_replicated():
    # 8 query / 4 KV heads over 2: even
    assert [split_heads(8, 4, r, 2) for r in range(2)] == [HeadSplit(0, 4, 0, 2), HeadSplit(4, 4, 2, 2)]
    # the demo model: 9 query / 3 KV heads over 2 ranks, whole GQA groups as evenly as they go
    assert [split_heads(9, 3, r, 2) for r in range(2)] == [HeadSplit(0, 3, 0, 1), HeadSplit(3, 6, 1, 2)]
    # 1 KV head over 2 ranks: replicated, the query heads halved
    assert [split_heads(4, 1, r, 2) for r in range(2)] == [HeadSplit(0, 2, 0, 1), HeadSplit(2, 2, 0, 1)]
    # 2 KV heads over 4 ranks: each held twice
    assert [split_heads(8, 2, r, 4) for r in range(4)] == [HeadSplit(0, 2, 0, 1), HeadSplit(2, 2, 0, 1),
                                                           HeadSplit(4, 2, 1, 1), HeadSplit(6, 2, 1, 1)]
    # every query head exactly once, every rank's KV heads the ones its query heads read
    for heads, kv, size in ((12, 4, 3), (9, 3, 2), (6, 1, 3), (16, 2, 8), (6, 3, 4)):
        group = heads // kv
        seen = []
        for r in range(size):
            s = split_heads(heads, kv, r, size)
            seen += range(s.q_start, s.q_start + s.q_count)
            reads = {q // group for q in range(s.q_start, s.q_start + s.q_count)}
            assert reads <= set(range(s.kv_start, s.kv_start + s.kv_count))
        assert seen == list(range(heads))
    with pytest.raises(ValueError, match="query head"):
        split_heads(2, 1, 0, 4)  # 4 ranks, 2 query heads


def test_vocab_and_intermediate_slices():
    assert [vocab_slice(251, r, 2) for r in range(2)] == [(0, 126, 126), (126, 125, 126)]
    assert [vocab_slice(49152, r, 2) for r in range(2)] == [(0, 24576, 24576), (24576, 24576, 24576)]
    assert [split_range(10, r, 3) for r in range(3)] == [(0, 3), (3, 3), (6, 4)]
    with pytest.raises(ValueError):
        split_range(1, 0, 2)  # rank 0 of 2 would get nothing


# ---------------------------------------------------------------------- real ranks


def _tiny(path: Path, kind: str, *, heads: int, kv_heads: int, vocab: int, layers: int = 2, tied: bool = False,
          seed: int = 0) -> Path:
    import transformers as tf

    common = dict(hidden_size=24 * heads // 2, intermediate_size=100, num_hidden_layers=layers,
                  num_attention_heads=heads, num_key_value_heads=kv_heads, vocab_size=vocab,
                  max_position_embeddings=512, tie_word_embeddings=tied, initializer_range=0.2,
                  eos_token_id=None, bos_token_id=None, pad_token_id=None)
    torch.manual_seed(seed)
    if kind == "qwen2":
        model = tf.Qwen2ForCausalLM(tf.Qwen2Config(**common)).eval()
        with torch.no_grad():  # non-zero biases: each rank's slice of them is exercised
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.2)
    elif kind == "qwen3":
        model = tf.Qwen3ForCausalLM(tf.Qwen3Config(**common, head_dim=16)).eval()
    else:
        model = tf.LlamaForCausalLM(tf.LlamaConfig(**common)).eval()
    model.save_pretrained(path)
    return path


MODELS = {
    # 6 query / 3 KV heads: ranks hold 1 and 2 KV heads; odd vocabulary, tied embedding and LM head
    "uneven": dict(kind="llama", heads=6, kv_heads=3, vocab=251, tied=True),
    # 4 query heads, 1 KV head: replicated on both ranks; qkv biases
    "replicated": dict(kind="qwen2", heads=4, kv_heads=1, vocab=96),
}


@pytest.fixture(scope="module", params=sorted(MODELS))
def tiny(request, tmp_path_factory):
    """(name, model dir, rank 0's shard, its followers): one follower process per model, shared."""
    name = request.param
    path = _tiny(tmp_path_factory.mktemp(name), **MODELS[name])
    model, followers = load_sharded(str(path), 2)
    yield name, path, model, followers
    followers.close()


def prompts(n: int, vocab: int, seed: int) -> dict[str, list[int]]:
    """Prompts with repeated segments (drafts find matches) and a shared prefix (prefix caching)."""
    rng = random.Random(seed)
    shared = [rng.randrange(vocab) for _ in range(9)]
    out = {}
    for i in range(n):
        motif = [rng.randrange(vocab) for _ in range(rng.randrange(3, 7))]
        out[f"r{i}"] = ((shared if i % 2 else []) + motif * rng.randrange(2, 4) + motif)[:28]
    return out


def test_plain_greedy_equal_at_tp1_and_tp2(tiny):
    name, path, model, followers = tiny
    batch = prompts(8, MODELS[name]["vocab"], seed=1)
    want = Engine(load_model(path), CFG).generate(batch, GREEDY)
    # a small cache: prefix-cached blocks, copy-on-write and preemption all happen across the ranks
    small = EngineConfig(block_size=4, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=32)
    got = Engine(model, small, followers=followers).generate(batch, GREEDY)
    assert got == want
    attn = model.model.layers[0].self_attn  # rank 0 holds a shard, not the whole model
    assert attn.num_heads < model.cfg.num_heads and model.lm_head.weight.shape[0] < model.cfg.vocab_size


@pytest.fixture(scope="module")
def drafts(tmp_path_factory):
    """A 1-layer draft model per tiny target (same vocabulary)."""
    out = {}
    for name, spec in MODELS.items():
        out[name] = _tiny(tmp_path_factory.mktemp(f"{name}-draft"), spec["kind"], heads=spec["heads"],
                          kv_heads=spec["kv_heads"], vocab=spec["vocab"], layers=1, seed=7)
    return out


# the draft methods of the engine's own speculation tests (test_spec_engine.make_proposer)
@pytest.mark.parametrize("method", ["ngram", "ngram_tree", "draft_model", "self_draft", "draft_model_tree",
                                    "self_draft_tree"])
def test_speculative_greedy_equal_at_tp1_and_tp2(tiny, drafts, method):
    name, path, model, followers = tiny
    batch = prompts(8, MODELS[name]["vocab"], seed=2)
    want = Engine(load_model(path), CFG).generate(batch, GREEDY)
    engine = Engine(model, CFG, num_speculative_tokens=4, followers=followers)
    proposer = make_proposer(method, path, drafts[name])
    assert run_spec(engine, proposer, batch, GREEDY) == want
    counters = engine.counters[""]
    assert counters.num_drafts > 0
    if method == "self_draft":  # the whole model drafting for its own shards: every token accepted
        assert counters.acceptance_rate == 1.0
    assert engine.blocks.num_free_blocks == engine.blocks.num_blocks


def test_qwen3_per_head_qk_norms_split_with_their_heads(tmp_path):
    """Qwen3 (per-head q/k RMSNorm, head_dim ≠ hidden/heads): plain and a tree of self-drafts."""
    path = _tiny(tmp_path / "q3", "qwen3", heads=4, kv_heads=2, vocab=80, seed=5)
    batch = prompts(6, 80, seed=5)
    want = Engine(load_model(path), CFG).generate(batch, GREEDY)
    model, followers = load_sharded(str(path), 2)
    try:
        assert Engine(model, CFG, followers=followers).generate(batch, GREEDY) == want
        engine = Engine(model, CFG, num_speculative_tokens=4, followers=followers)
        assert run_spec(engine, make_proposer("self_draft_tree", path, path), batch, GREEDY) == want
    finally:
        followers.close()


def test_logprobs_penalties_and_stops_at_tp2(tiny):
    """Rank 0 gets whole logits: the one logits pipeline (penalties, logit bias, stop ids, logprobs)
    behaves as on one device, plain and verified."""
    name, path, model, followers = tiny
    vocab = MODELS[name]["vocab"]
    batch = prompts(4, vocab, seed=6)
    params = SamplingParams(temperature=0, max_tokens=16, logprobs=2, repetition_penalty=1.3,
                            frequency_penalty=0.5, logit_bias={3: 5.0}, stop_token_ids=[7], min_tokens=2)

    def run(engine, proposer=None):
        out = {rid: ([], []) for rid in batch}
        for rid, tokens in batch.items():
            engine.add_request(rid, tokens, params)
        while engine.has_work():
            inputs = engine.draft_inputs() if proposer else []
            proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
            for rid, delta in engine.step(proposals):
                out[rid][0].extend(delta.token_ids)
                out[rid][1].extend(delta.logprobs)
            if proposer:
                proposer.verified(engine.take_verdicts())
                proposer.release(engine.take_released())
        return out

    want = run(Engine(load_model(path), CFG))
    for proposer in (None, make_proposer("ngram_tree", path, path)):
        got = run(Engine(model, CFG, num_speculative_tokens=4, followers=followers), proposer)
        for rid in batch:
            assert got[rid][0] == want[rid][0], rid
            torch.testing.assert_close(got[rid][1], want[rid][1], atol=1e-4, rtol=0)


def test_graph_shaped_steps_run_in_lockstep(tiny):
    """The CUDA-graph path's static, padded forward (run eagerly on CPU, ``capture=False``) on every
    rank: decode, chain and tree verify batches in their buckets give the eager single-device logits.
    (On CUDA each rank captures and replays these graphs with its collectives inside: not run here.)"""
    from workers.engine.cuda_graphs import GraphConfig
    from workers.engine.model_runner import ModelRunner

    name, path, model, followers = tiny
    rng = random.Random(8)
    vocab = MODELS[name]["vocab"]
    ref = ModelRunner(load_model(path), 64, 4)
    graphs = GraphConfig(8, (1, 5), (), capture=False, trees=True)
    tp = ModelRunner(model, 64, 4, graphs, max_model_len=64, followers=followers)
    tables = [list(range(8 * b, 8 * b + 8)) for b in range(3)]
    lens = [9, 13, 6]
    for runner in (ref, tp):  # prefill (eager on both)
        prompts_ = [[rng.randrange(vocab) for _ in range(n)] for n in lens]
        rng = random.Random(8)
        runner.forward([(p, 0, t) for p, t in zip(prompts_, tables)], [1, 1, 1])
    decode = [([rng.randrange(vocab)], n, t) for n, t in zip(lens, tables)]
    verify = [([rng.randrange(vocab) for _ in range(5)], n + 1, t) for n, t in zip(lens, tables)]
    trees = [[-1, -1, 0, 1], None, [-1, 0, 0, 2]]
    for chunks, wants, tree in ((decode, [1] * 3, None), (verify, [5] * 3, None), (verify, [5] * 3, trees)):
        assert tp.graphs.shape_for(chunks, wants, (), tree) is not None  # the graph path, not eager
        want = ref.forward(chunks, wants, (), tree)
        got = tp.forward(chunks, wants, (), tree)
        torch.testing.assert_close(got.logits, want.logits, atol=1e-4, rtol=1e-4)


def test_hidden_states_and_logits_are_whole(tiny):
    """Draft workers get hidden states of the full hidden size (the residual stream is whole on every
    rank), equal to the single-device model's; logits cover the whole vocabulary."""
    name, path, model, followers = tiny
    batch = dict(list(prompts(3, MODELS[name]["vocab"], seed=3).items()))
    layers = (0, 1, 2)
    ref = Engine(load_model(path), CFG, hidden_layers=layers)
    tp = Engine(model, CFG, hidden_layers=layers, followers=followers)
    for engine in (ref, tp):
        for rid, tokens in batch.items():
            engine.add_request(rid, tokens, GREEDY)
        engine.step()
    want, got = ref.draft_inputs(), tp.draft_inputs()
    assert [d.seq_id for d in got] == [d.seq_id for d in want]
    for w, g in zip(want, got):
        assert len(g.hidden_states) == len(layers)
        for wl, gl in zip(w.hidden_states, g.hidden_states):
            assert gl.shape == wl.shape and gl.shape[-1] == model.cfg.hidden_size
            torch.testing.assert_close(gl, wl, atol=1e-5, rtol=1e-4)
    out_ref = ref.runner.forward([([1, 2, 3], 0, [0])], [3])
    out_tp = tp.runner.forward([([1, 2, 3], 0, [0])], [3])
    assert out_tp.logits.shape == (3, MODELS[name]["vocab"])
    torch.testing.assert_close(out_tp.logits, out_ref.logits, atol=1e-4, rtol=1e-4)


def test_a_gguf_checkpoint_loads_sharded(tmp_path):
    """A GGUF file loads sharded: each rank reads its slices (an F32 Llama file, q/k permuted)."""
    hf = tiny_hf_model("llama", tmp_path / "hf", seed=4, vocab=97)
    write_llama_gguf(hf, tmp_path / "tiny.gguf")
    batch = prompts(4, 97, seed=4)
    want = Engine(load_model(tmp_path / "tiny.gguf"), CFG).generate(batch, GREEDY)
    model, followers = load_sharded(str(tmp_path / "tiny.gguf"), 2)
    try:
        assert model.model.layers[0].self_attn.num_heads == 2  # of 4: a shard
        assert Engine(model, CFG, followers=followers).generate(batch, GREEDY) == want
    finally:
        followers.close()


@pytest.mark.demo
def test_gguf_slices_equal_transformers_dequantization_cut():
    """The demo model's quantized GGUF (Q4_1, a Q8_0 embedding; Llama: q/k rows permuted per head):
    each rank's slices as our reader yields them equal the tensors transformers dequantized from the
    same file (the demo's safetensors directory), cut. The embedding and the first layers: every
    kind of tensor, without dequantizing the whole file in numpy twice."""
    from safetensors import safe_open

    from workers.demo_model import demo_model_dir, gguf_path
    from workers.engine.config import ModelConfig
    from workers.engine.model import DecoderModel
    from workers.engine.parallel import TensorParallel
    from workers.engine.weights import iter_gguf_sliced

    ref_dir = demo_model_dir()
    cfg = ModelConfig.from_dir(ref_dir)
    [ref_file] = ref_dir.glob("*.safetensors")
    with safe_open(str(ref_file), framework="pt") as ref:
        for rank in range(2):
            with torch.device("meta"):
                model = DecoderModel(cfg, 16, tp=TensorParallel(rank, 2, group=object()))
            kinds = set()
            for i, (name, got) in enumerate(iter_gguf_sliced(gguf_path(), model.checkpoint_slice, cfg)):
                if i == 30:  # the embedding and three layers
                    break
                cut = model.checkpoint_slice(name)
                want = ref.get_tensor(name)
                assert torch.equal(got, want if cut is None else want.narrow(*cut)), name
                kinds.add(name.split(".")[-2])
            assert {"embed_tokens", "q_proj", "k_proj", "o_proj", "down_proj", "input_layernorm"} <= kinds


def test_a_hung_rank_fails_the_step_after_the_timeout(tmp_path):
    """SIGSTOP the follower (alive, silent): rank 0's collective gives up after the group's timeout."""
    path = _tiny(tmp_path / "m", "llama", heads=4, kv_heads=2, vocab=64)
    model, followers = load_sharded(str(path), 2, timeout=3.0)
    proc = followers.procs[0]
    try:
        engine = Engine(model, CFG, followers=followers)
        engine.add_request("a", [1, 2, 3], GREEDY)
        engine.step()
        os.kill(proc.pid, signal.SIGSTOP)
        started = time.monotonic()
        with pytest.raises(TensorParallelFailed):
            for _ in range(100):
                engine.step()
        assert time.monotonic() - started < 15
    finally:
        proc.kill()
        followers.close()


@pytest.mark.demo
def test_a_model_whose_heads_do_not_split_is_refused_before_start():
    from workers.demo_model import demo_model_dir
    from workers.engine.target_config import TargetConfig

    TargetConfig(model=str(demo_model_dir()), served_model_name="m", tensor_parallel_size=2)  # 9 query / 3 KV heads: 2 ranks fit
    with pytest.raises(ValueError, match="query head"):
        TargetConfig(model=str(demo_model_dir()), served_model_name="m", tensor_parallel_size=12)


def test_followers_exit_when_rank_0_goes(tmp_path):
    """A follower whose step stream ends (rank 0 died or closed it) exits by itself."""
    path = _tiny(tmp_path / "m", "llama", heads=4, kv_heads=2, vocab=64)
    model, followers = load_sharded(str(path), 2)
    proc = followers.procs[0]
    followers._closing = True  # no watchdog report for this deliberate end
    proc.stdin.close()
    assert proc.wait(15) == 0


@pytest.mark.demo
def test_demo_model_greedy_equal_at_tp1_and_tp2_plain_and_eagle3_trees():
    """SmolLM2-135M (9 query / 3 KV heads: ranks hold 3+1 and 6+2) with its bundled EAGLE-3 head,
    which reads three hidden layers of the target."""
    from transformers import AutoTokenizer

    from workers.demo_model import demo_head_dir, demo_model_dir
    from workers.draft.eagle import load_eagle, load_target_parts
    from workers.draft.eagle_proposer import EagleProposer

    path = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(path)
    texts = ["The capital of France is", "def fibonacci(n):\n    ", "Water boils at a temperature of",
             "1, 2, 3, 4, 5, 6,"]
    batch = {f"p{i}": tok(t)["input_ids"] for i, t in enumerate(texts)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cfg = EngineConfig(block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)
    want = Engine(load_model(path), cfg).generate(batch, params)
    model, followers = load_sharded(str(path), 2)
    try:
        assert Engine(model, cfg, followers=followers).generate(batch, params) == want
        embed, lm_head, target_cfg = load_target_parts(path)
        head, layers = load_eagle(demo_head_dir(), embed, lm_head, target_cfg, 512)
        engine = Engine(model, cfg, num_speculative_tokens=6, hidden_layers=tuple(layers), followers=followers)
        proposer = EagleProposer(head, layers, num_blocks=64, block_size=16, tree_topk=2, tree_depth=3)
        assert run_spec(engine, proposer, batch, params) == want
        assert engine.counters[""].num_accepted_tokens > 0
    finally:
        followers.close()


def test_a_killed_rank_fails_the_next_step_at_once(tmp_path):
    """SIGKILL the follower: rank 0's next step raises TensorParallelFailed within seconds (gloo sees
    the closed connection; the watchdog sees the exit), the failure hook runs, and every later
    step is refused at once."""
    path = _tiny(tmp_path / "m", "llama", heads=4, kv_heads=2, vocab=64)
    model, followers = load_sharded(str(path), 2, timeout=30.0)
    reasons: list[str] = []
    followers.on_failure(reasons.append)
    try:
        engine = Engine(model, CFG, followers=followers)
        engine.add_request("a", [1, 2, 3, 4], SamplingParams(temperature=0, max_tokens=200, ignore_eos=True))
        engine.step()
        engine.step()
        os.kill(followers.procs[0].pid, signal.SIGKILL)
        errors: list[BaseException] = []

        def steps():
            try:
                for _ in range(200):
                    engine.step()
            except BaseException as exc:
                errors.append(exc)

        started = time.monotonic()
        thread = threading.Thread(target=steps, daemon=True)
        thread.start()
        thread.join(15)
        assert not thread.is_alive(), "a step hung after a rank died"
        assert time.monotonic() - started < 10
        assert errors and isinstance(errors[0], TensorParallelFailed), errors
        assert reasons and followers.tp.failed
        with pytest.raises(TensorParallelFailed):
            engine.runner.forward([([1], 0, [0])], [1])
    finally:
        followers.close()
