"""Where a draft runs: --device / --dtype resolution, clear errors for a device that is not there,
every method built by the worker in bfloat16 on the CPU drafting valid proposals (and greedy
speculation with it still equal to plain decoding), and the tensors a proposer builds living on
its device in its dtype. The same on CUDA: tests/gpu/test_draft_cuda.py."""

from __future__ import annotations

import pytest
import torch

from runtime.messages import SamplingParams
from tests.support.eagle_heads import write_eagle1, write_eagle3
from tests.unit.workers.draft.test_spec_heads import write_medusa_vllm, write_mlp_ibm
from tests.support.tiny_models import tiny_hf_model
from tests.unit.workers.engine.test_spec_engine import CFG, VOCAB, plain, prompts, run_spec
from workers.draft.__main__ import draft_config, main, make_proposer, parse_args
from workers.draft.config import DraftConfig, resolve_device, resolve_dtype
from workers.draft.drafter import Capabilities
from workers.draft.eagle_proposer import EagleProposer
from workers.draft.ngram import NgramProposer
from workers.draft.online import trainable_state
from workers.draft.service import DraftService
from workers.engine.engine import Engine
from workers.engine.weights import load_model
from workers.speculation.payloads import DraftInput, SamplingSpec

pytestmark = pytest.mark.unit

CUDA = torch.cuda.is_available()
no_cuda = pytest.mark.skipif(CUDA, reason="checks the error for a missing GPU")


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """A 4-layer random target and one draft of every model-based kind for it."""
    root = tmp_path_factory.mktemp("placement")
    out = {name: root / name for name in ("target", "eagle", "eagle3", "draft_model", "medusa", "mlp_speculator")}
    for path in out.values():
        path.mkdir()
    tiny_hf_model("llama", out["target"], seed=7, vocab=VOCAB, layers=4)
    tiny_hf_model("llama", out["draft_model"], seed=8, vocab=VOCAB, layers=1)
    write_eagle1(out["eagle"])
    write_eagle3(out["eagle3"])
    write_medusa_vllm(out["medusa"])
    write_mlp_ibm(out["mlp_speculator"], inner=64)
    return out


def config(dirs, method: str, **extra) -> DraftConfig:
    paths = {}
    if method == "draft_model":
        paths = {"draft_model": str(dirs["draft_model"])}
    elif method in ("eagle", "eagle3", "medusa", "mlp_speculator"):
        paths = {"eagle_model": str(dirs[method]), "target_model": str(dirs["target"])}
    return DraftConfig(method=method, num_blocks=512, block_size=4, **paths, **extra)


# ------------------------------------------------------------------ resolution


def test_auto_is_cuda_in_bfloat16_where_a_gpu_is_visible_else_cpu_in_float32():
    device = resolve_device("auto")
    assert device.type == ("cuda" if CUDA else "cpu")
    assert resolve_dtype("auto", device) == (torch.bfloat16 if CUDA else torch.float32)
    assert resolve_dtype("auto", torch.device("cuda")) == torch.bfloat16  # a name: needs no GPU
    assert resolve_dtype("auto", torch.device("cpu")) == torch.float32
    assert resolve_dtype("float16", torch.device("cpu")) == torch.float16
    assert resolve_device("cpu") == torch.device("cpu")


@pytest.mark.parametrize("bad", ["gpu", "cuda:x", "cuda:", "CPU", ""])
def test_malformed_devices_and_dtypes_are_value_errors(bad):
    with pytest.raises(ValueError, match="--device"):
        resolve_device(bad)
    with pytest.raises(ValueError, match="--device"):
        DraftConfig(method="ngram", device=bad)
    with pytest.raises(ValueError, match="--dtype"):
        resolve_dtype("bf16", torch.device("cpu"))


@no_cuda
@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:3"])
def test_cuda_without_a_gpu_is_a_clear_error_for_methods_with_tensors(dirs, device):
    with pytest.raises(ValueError, match="CUDA is not available"):
        resolve_device(device)
    with pytest.raises(ValueError, match=f"--device {device}: CUDA is not available"):
        config(dirs, "eagle3", device=device)
    assert config(dirs, "ngram", device=device).device == device  # no tensors: nothing to place


@no_cuda
def test_the_worker_exits_with_one_line_for_a_missing_gpu(dirs, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--method", "eagle3", "--eagle-model", str(dirs["eagle3"]), "--target-model", str(dirs["target"]),
              "--device", "cuda"])
    message = str(exc.value.code)
    assert message.startswith("python -m workers.draft: --device cuda: CUDA is not available") and "\n" not in message


def test_flags_and_environment_reach_the_config(dirs, monkeypatch):
    args = ["--method", "eagle3", "--eagle-model", str(dirs["eagle3"]), "--target-model", str(dirs["target"])]
    cfg = draft_config(parse_args([*args, "--device", "cpu", "--dtype", "bfloat16"]))
    assert (cfg.device, cfg.dtype, cfg.torch_device, cfg.torch_dtype) == ("cpu", "bfloat16", torch.device("cpu"),
                                                                           torch.bfloat16)
    monkeypatch.setenv("TANDEM_DTYPE", "float16")
    monkeypatch.setenv("TANDEM_DEVICE", "cpu")
    cfg = draft_config(parse_args(args))
    assert (cfg.device, cfg.torch_dtype) == ("cpu", torch.float16)
    with pytest.raises(SystemExit):  # not a choice
        parse_args([*args, "--dtype", "int8"])


# ------------------------------------------------------------------ every method in bfloat16


MODEL_METHODS = ["eagle3", "eagle", "draft_model", "medusa", "mlp_speculator"]


def _params(proposer) -> list[torch.Tensor]:
    model = getattr(proposer, "head", None) or proposer.model
    return list(model.parameters())


@pytest.mark.parametrize("method", MODEL_METHODS)
def test_every_model_method_is_built_in_bfloat16_on_the_cpu(dirs, method):
    proposer = make_proposer(config(dirs, method, device="cpu", dtype="bfloat16"))
    assert proposer.device == torch.device("cpu")
    assert {p.dtype for p in _params(proposer)} == {torch.bfloat16}
    assert {p.device.type for p in _params(proposer)} == {"cpu"}
    if method in ("eagle", "eagle3"):
        head = proposer.head
        assert proposer.caps.hidden_dtype == "bfloat16"  # targets send hidden states in it
        assert head.embed[0].weight.dtype == torch.bfloat16  # held outside the head's state, moved too
        assert head.rotary.cos.dtype == torch.float32  # positions keep their angles
        assert proposer.kv[0][0].dtype == torch.bfloat16
        assert proposer.caps.distillable == (method == "eagle3")
        if method == "eagle3":
            assert head.d2t.dtype == torch.long
    if method == "draft_model":
        assert proposer.runner.kv_caches[0][0].dtype == torch.bfloat16 and proposer.caps.drafts_ahead


@pytest.mark.parametrize("method", [*MODEL_METHODS, "ngram", "suffix"])
def test_greedy_speculation_with_a_bfloat16_draft_equals_plain_decoding(dirs, method):
    """The target (float32) decides every token: a draft in another dtype changes what is accepted,
    never the output."""
    proposer = make_proposer(config(dirs, method, device="cpu", dtype="bfloat16"))
    batch = prompts(8, seed=90)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    want = plain(dirs["target"], batch, params)
    engine = Engine(load_model(dirs["target"]), CFG, num_speculative_tokens=3,
                    hidden_layers=tuple(proposer.caps.hidden_layers))
    proposals = []
    real_propose = proposer.propose

    def propose(inputs):
        out = real_propose(inputs)
        proposals.extend(out)
        return out

    proposer.propose = propose
    assert run_spec(engine, proposer, batch, params) == want
    drafted = [t for out in proposals for t in out.token_ids]
    assert drafted and all(0 <= t < VOCAB for t in drafted)  # proposals were made, of real token ids
    assert engine.counters[""].num_drafts > 0
    if method in MODEL_METHODS:  # (a draft LM's sequences cannot break: it reads no hidden states)
        assert not any(getattr(s, "broken", False) for s in proposer.seqs.values())


@pytest.mark.parametrize("method", MODEL_METHODS)
def test_seeded_sampled_drafts_in_bfloat16_are_valid_and_reproducible(dirs, method):
    def draw():
        proposer = make_proposer(config(dirs, method, device="cpu", dtype="bfloat16"))
        prompt = prompts(1, seed=5)["r0"]
        hidden = [torch.randn(len(prompt) - 1, 64, generator=torch.Generator().manual_seed(i))
                  for i, _ in enumerate(proposer.caps.hidden_layers)]
        spec = SamplingSpec(temperature=0.8, seed=1234)
        [out] = proposer.propose([DraftInput("s", 0, prompt, 3, spec, hidden)])
        seq = proposer.seqs["s"]
        assert seq.generator is not None and seq.generator.device == proposer.device
        return out

    first, second = draw(), draw()
    assert first.token_ids and all(0 <= t < VOCAB for t in first.token_ids)
    dists = first.distributions
    assert len(dists) == len(first.token_ids)  # sampled: the distribution of each draw travels
    assert all(abs(sum(d.probs) - 1) < 1e-3 and t in d.ids for t, d in zip(first.token_ids, dists))
    assert first.token_ids == second.token_ids


def test_an_eagle_proposer_builds_its_inputs_on_the_heads_device_in_its_dtype(dirs):
    proposer = make_proposer(config(dirs, "eagle3", device="cpu", dtype="bfloat16"))
    seen = []
    forward = proposer.head.forward

    def spy(input_ids, features, positions, meta, kv_caches):
        seen.append((input_ids, features, positions, meta.slot_mapping, meta.block_tables, meta.token_pos))
        return forward(input_ids, features, positions, meta, kv_caches)

    proposer.head.forward = spy
    prompt = prompts(1, seed=6)["r0"]
    hidden = [torch.randn(len(prompt) - 1, 64, dtype=torch.float32) for _ in proposer.caps.hidden_layers]
    proposer.propose([DraftInput("s", 0, prompt, 3, hidden_states=hidden)])
    assert seen
    for input_ids, features, positions, *meta in seen:
        assert features.dtype == torch.bfloat16  # float32 target rows arrive in the head's dtype
        for t in (input_ids, features, positions, *meta):
            assert t.device == proposer.device
    assert all(f.dtype == torch.bfloat16 for f in proposer.seqs["s"].feats.values())


# ------------------------------------------------------------------ capabilities, distillation


def test_the_service_reads_declared_capabilities(dirs):
    ngram = NgramProposer(1, 3)
    caps = ngram.caps
    assert (caps.drafts_ahead, caps.distillable, caps.hidden_dtype, caps.vocab_size, caps.hidden_layers) == (
        False, False, "", 0, ())
    assert not DraftService(ngram, "d").overlap
    draft_lm = make_proposer(config(dirs, "draft_model", device="cpu"))
    assert DraftService(draft_lm, "d").overlap and not DraftService(draft_lm, "d", overlap=False).overlap
    with pytest.raises(ValueError, match="takes no new weights"):
        ngram.load_weights({})
    with pytest.raises(ValueError):
        Capabilities("")  # a drafter names its method


def test_float32_weights_from_the_trainer_load_into_a_bfloat16_head(dirs):
    """Online distillation trains float32 master weights on the head's device; the serving head
    takes them in its own dtype."""
    served = make_proposer(config(dirs, "eagle3", device="cpu", dtype="bfloat16"))
    trained = make_proposer(config(dirs, "eagle3", device="cpu", dtype="float32"))
    state = trainable_state(trained.head)
    for v in state.values():
        v.add_(0.01)
    assert isinstance(served, EagleProposer)
    served.load_weights(state)
    own = served.head.state_dict()
    for k, v in state.items():
        assert own[k].dtype == torch.bfloat16 and torch.equal(own[k], v.to(torch.bfloat16))


def test_a_bfloat16_head_follows_heads_written_in_float32(dirs):
    """--distill-config's follow compares the new head's projection with the serving one's in the serving dtype."""
    from workers.draft.__main__ import followed_weights

    served = make_proposer(config(dirs, "eagle3", device="cpu", dtype="bfloat16"))
    state = followed_weights(served, dirs["eagle3"], str(dirs["target"]))
    assert state and not any(k.startswith("fc.") for k in state)
    served.load_weights(state)


# ------------------------------------------------------------------ head steps as graphs


def test_static_head_steps_draft_what_eager_steps_draft(dirs):
    """The padded, static steps CUDA graphs replay (run eagerly here: no capture on the CPU) give the
    same chains as the eager steps, one sequence or many, and speculation with them stays lossless."""
    embed_cfg = config(dirs, "eagle3", device="cpu")
    eager = make_proposer(embed_cfg)
    static = make_proposer(embed_cfg)
    static_graphs = EagleProposer(static.head, static.caps.hidden_layers, 512, 4, cuda_graphs=True, graph_batch=8)
    assert eager.graphs is None and static_graphs.graphs is not None
    assert static_graphs.graphs.buckets == (1, 2, 4, 8)
    for n in (1, 3, 11):  # 11: more than the largest bucket, so those steps run eagerly
        batch = [DraftInput(f"s{i}", 0, prompt, 4, hidden_states=[torch.randn(len(prompt) - 1, 64) for _ in range(3)])
                 for i, prompt in enumerate(prompts(n, seed=20 + n).values())]
        assert [o.token_ids for o in static_graphs.propose(batch)] == [o.token_ids for o in eager.propose(batch)]
        static_graphs.release([d.seq_id for d in batch])
        eager.release([d.seq_id for d in batch])
    assert static_graphs.graphs.replays > 0
    batch = prompts(8, seed=91)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine = Engine(load_model(dirs["target"]), CFG, num_speculative_tokens=4,
                    hidden_layers=tuple(static_graphs.caps.hidden_layers))
    replays = static_graphs.graphs.replays
    assert run_spec(engine, static_graphs, batch, params) == plain(dirs["target"], batch, params)
    assert static_graphs.graphs.replays > replays


def test_the_worker_asks_for_graphs_only_on_cuda(dirs):
    assert make_proposer(config(dirs, "eagle3", device="cpu")).graphs is None
    assert draft_config(parse_args(["--no-cuda-graphs"])).cuda_graphs is False
    assert draft_config(parse_args([])).cuda_graphs is True
