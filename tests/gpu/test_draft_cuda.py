"""The bundled EAGLE-3 head (SmolLM2-135M-Instruct's) drafting on CUDA in bfloat16, as
``python -m workers.draft --method eagle3 --device cuda`` builds it, against the same head on the
CPU in float32. Skipped without CUDA.

The target is a random model of SmolLM2-135M's shape (hidden 576, 9 heads, 3 KV heads, 49152
tokens, 28 layers: the head's layers 2, 15 and 27 exist), built in the test. Tolerance: bf16 and
float32 round differently, so the CUDA head's first draft token must be a near-argmax of the
float32 head's logits (within a quarter of the way from the row's mean to its max: a wrong kernel,
position or feature picks tokens near the mean) and equal its argmax for most sequences. Greedy
speculation with the CUDA draft on a float32 CPU target must equal plain decoding exactly: the
target decides every token, whatever the draft's device and dtype. Chain steps after the first
replay CUDA graphs (:mod:`workers.draft.head_graphs`); in float32 they draft what eager steps draft.
"""

from __future__ import annotations

import random

import pytest
import torch

from runtime.messages import SamplingParams
from workers.demo_model import demo_head_dir
from workers.draft.__main__ import make_proposer
from workers.draft.config import DraftConfig
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model
from workers.speculation.payloads import ROOT, DraftInput, SamplingSpec

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA GPU")]

VOCAB, HIDDEN = 49152, 576


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory):
    import transformers as tf

    path = tmp_path_factory.mktemp("smollm2_shaped")
    cfg = tf.LlamaConfig(hidden_size=HIDDEN, intermediate_size=1536, num_hidden_layers=28, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=VOCAB, max_position_embeddings=2048, rope_theta=100000.0,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, eos_token_id=None, bos_token_id=None,
                         pad_token_id=None)
    torch.manual_seed(0)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(path)
    return path


def _config(target_dir, device: str, dtype: str = "auto", **extra) -> DraftConfig:
    return DraftConfig(method="eagle3", device=device, dtype=dtype, eagle_model=str(demo_head_dir()),
                       target_model=str(target_dir), num_blocks=256, block_size=16, **extra)


def _inputs(proposer, n: int, seed: int, num_speculative_tokens: int = 3, sampling: SamplingSpec = SamplingSpec(),
            tree_topk: int = 0) -> list[DraftInput]:
    """``n`` sequences of random prompts with random float32 target rows (as a float32 target sends
    them), the same for every proposer given the same seed."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 40))]
        hidden = [torch.randn(len(prompt) - 1, HIDDEN, generator=gen) for _ in proposer.caps.hidden_layers]
        out.append(DraftInput(f"s{i}", 0, prompt, num_speculative_tokens, sampling, hidden, tree_topk=tree_topk))
    return out


def _target_ids(proposer) -> set[int]:
    d2t = proposer.head.d2t.cpu()
    return set((torch.arange(d2t.shape[0]) + d2t).tolist())


def test_the_demo_head_is_built_on_cuda_in_bfloat16(target_dir):
    proposer = make_proposer(_config(target_dir, "cuda"))
    head = proposer.head
    assert proposer.caps.method == "eagle3" and proposer.device.type == "cuda"
    assert {(p.device.type, p.dtype) for p in head.parameters()} == {("cuda", torch.bfloat16)}
    assert head.embed[0].weight.device.type == "cuda" and head.embed[0].weight.dtype == torch.bfloat16
    assert head.rotary.cos.device.type == "cuda" and head.rotary.cos.dtype == torch.float32
    assert head.d2t.device.type == "cuda" and head.d2t.dtype == torch.long
    assert proposer.kv[0][0].device.type == "cuda" and proposer.kv[0][0].dtype == torch.bfloat16
    assert proposer.hidden_dtype == "bfloat16" and proposer.caps.hidden_layers == [2, 15, 27]
    assert proposer.graphs is not None and all(graph is not None for graph, _ in proposer.graphs.graphs.values())


def test_cuda_bfloat16_chains_match_the_cpu_float32_head(target_dir):
    cuda = make_proposer(_config(target_dir, "cuda"))
    cpu = make_proposer(_config(target_dir, "cpu", "float32"))
    features = []
    greedy = cpu.head.greedy_tokens

    def record(feats):  # the CPU head's features at the first draft step: the reference logits' input
        features.append(feats)
        return greedy(feats)

    cpu.head.greedy_tokens = record
    batch = _inputs(cpu, 12, seed=1)
    want = cpu.propose(batch)
    got = cuda.propose(batch)
    allowed = _target_ids(cuda)
    for out in got:
        assert len(out.token_ids) == 3 and set(out.token_ids) <= allowed, out
        assert not out.distributions and not out.parents
    ref = cpu.head.logits(features[0]).float()  # [B, V]: the first draft step of every sequence
    assert ref.shape[0] == len(batch)
    first = torch.tensor([out.token_ids[0] for out in got])
    finite = ref.masked_fill(~torch.isfinite(ref), float("nan"))
    top, mean = ref.max(-1).values, finite.nanmean(-1)
    picked = ref.gather(1, first[:, None])[:, 0]
    assert bool((picked >= top - 0.25 * (top - mean)).all()), (picked, top, mean)
    same = sum(g.token_ids[0] == w.token_ids[0] for g, w in zip(got, want))
    assert same >= len(batch) * 3 // 4, f"{same} of {len(batch)} first drafts equal the float32 head's"
    assert cuda.forward_calls > 0 and not any(s.broken for s in cuda.seqs.values())
    assert cuda.graphs.replays > 0  # steps 2 and 3 of every chain replayed


def test_replayed_head_steps_draft_what_eager_steps_draft(target_dir):
    """In float32 (no TF32) the Triton attention the graphs hold and the eager SDPA attention agree
    to rounding: the chains are the same."""
    torch.backends.cuda.matmul.allow_tf32 = False
    graphs = make_proposer(_config(target_dir, "cuda", "float32"))
    eager = make_proposer(_config(target_dir, "cuda", "float32", cuda_graphs=False))
    assert graphs.graphs is not None and eager.graphs is None
    for n in (1, 5, 16):
        batch = _inputs(graphs, n, seed=10 + n, num_speculative_tokens=4)
        got, want = graphs.propose(batch), eager.propose(batch)
        same = sum(g.token_ids == w.token_ids for g, w in zip(got, want))
        assert same >= n - n // 8, [(g.token_ids, w.token_ids) for g, w in zip(got, want)]
    assert graphs.graphs.replays > 0


def test_trees_and_seeded_draws_on_cuda(target_dir):
    tree = make_proposer(_config(target_dir, "cuda", tree_topk=3, tree_depth=3))
    allowed = _target_ids(tree)
    for out in tree.propose(_inputs(tree, 4, seed=2, num_speculative_tokens=8, tree_topk=3)):
        assert 0 < len(out.token_ids) <= 8 and set(out.token_ids) <= allowed
        assert all(p == ROOT or 0 <= p < i for i, p in enumerate(out.parents)), out.parents

    def draw():
        proposer = make_proposer(_config(target_dir, "cuda"))
        outs = proposer.propose(_inputs(proposer, 3, seed=3, sampling=SamplingSpec(temperature=0.8, seed=99)))
        assert all(s.generator.device.type == "cuda" for s in proposer.seqs.values())
        return outs

    first, second = draw(), draw()
    for out in first:
        assert len(out.token_ids) == 3 and len(out.distributions) == 3 and set(out.token_ids) <= allowed
        assert all(abs(sum(d.probs) - 1) < 1e-3 and t in d.ids for t, d in zip(out.token_ids, out.distributions))
    assert [o.token_ids for o in first] == [o.token_ids for o in second]  # seeded on the draft's device


def test_greedy_speculation_with_the_cuda_draft_equals_plain_decoding(target_dir):
    from tests.unit.workers.engine.test_spec_engine import run_spec

    rng = random.Random(4)
    batch = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randrange(5, 30))] for i in range(4)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    cfg = EngineConfig(block_size=16, num_blocks=256, max_num_seqs=8, cuda_graphs=False)
    want = Engine(load_model(target_dir), cfg).generate(batch, params)
    proposer = make_proposer(_config(target_dir, "cuda"))
    engine = Engine(load_model(target_dir), cfg, num_speculative_tokens=3, hidden_layers=tuple(proposer.caps.hidden_layers))
    assert run_spec(engine, proposer, batch, params) == want
    assert engine.counters[""].num_drafts > 0 and proposer.forward_calls > 0 and proposer.graphs.replays > 0
    assert not any(s.broken for s in proposer.seqs.values())


def test_staged_branches_on_cuda_replay_and_continue_the_synchronous_chains(target_dir):
    """The pipelined seam's branches on CUDA: every branch of every sequence one pair per pass,
    replayed as CUDA graphs; in float32 a branch that assumes the first a tokens of the chain the
    synchronous seam drafted drafts the rest of it (graph and eager attention agree to rounding)."""
    from workers.draft.drafter import Branch

    torch.backends.cuda.matmul.allow_tf32 = False
    sync = make_proposer(_config(target_dir, "cuda", "float32", cuda_graphs=False))
    staged = make_proposer(_config(target_dir, "cuda", "float32"))
    assert staged.caps.stages and staged.graphs is not None
    batch = _inputs(sync, 8, seed=3, num_speculative_tokens=5)
    chains = sync.propose(batch)
    branches = []
    for item in batch:
        staged.commit(item.seq_id, item.new_tokens, item.hidden_states)
    for item, chain in zip(batch, chains):
        branches += [Branch(item.seq_id, tuple(chain.token_ids[:a]), 5 - a, 1) for a in range(4)]
    replays = staged.graphs.replays
    out = staged.draft(branches)
    assert staged.graphs.replays > replays  # the branches' passes replayed
    want = [tuple(chain.token_ids[a:]) for chain in chains for a in range(4)]
    same = sum(tuple(o.tokens) == w for o, w in zip(out, want))
    assert same >= len(want) - len(want) // 8, [(o.tokens, w) for o, w in zip(out, want)]
    assert all(len(o.alternatives) == len(o.tokens) for o in out)
    bf16 = make_proposer(_config(target_dir, "cuda"))  # bfloat16 with graphs: drafts from its own vocabulary
    for item in batch:
        bf16.commit(item.seq_id, item.new_tokens, item.hidden_states)
    allowed = _target_ids(bf16)
    for o in bf16.draft(branches):
        assert o.tokens and set(o.tokens) <= allowed, o
