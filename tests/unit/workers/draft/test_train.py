"""``tandem train-draft``: the training-time-test forward matches what the head computes when it
drafts, a tiny seeded run writes a speculators-layout head that loads back and speculates
losslessly (and Medusa and MLP-speculator runs, the second on the first's conversations, write
heads that do too), and a speculators-format EAGLE-3 checkpoint loads."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from runtime.messages import SamplingParams
from tests.unit.workers.engine.test_spec_engine import run_spec
from workers.demo_model import demo_tokenizer_dir
from workers.draft.eagle import Eagle3Head, load_eagle, load_target_parts
from workers.draft.eagle_proposer import EagleProposer
from workers.draft.train.checkpoint import save_eagle3
from workers.draft.train.trainer import TrainConfig, build_head, check_target, train
from workers.draft.train.ttt import draft_vocabulary, step_features
from workers.engine.attention import AttentionMetadata, allocate_kv_cache
from workers.engine.config import ModelConfig
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.unit

VOCAB = 49152  # the demo tokenizer's


@pytest.fixture(scope="module")
def tiny_target(tmp_path_factory) -> Path:
    """A seeded random 4-layer Llama with the demo model's tokenizer."""
    import transformers as tf

    path = tmp_path_factory.mktemp("tiny-target")
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, tie_word_embeddings=True,
                         initializer_range=0.2, eos_token_id=None, bos_token_id=None, pad_token_id=None)
    tf.LlamaForCausalLM(cfg).save_pretrained(path)
    for f in Path(demo_tokenizer_dir()).iterdir():
        if f.is_file() and f.name not in ("config.json", "model.safetensors"):
            shutil.copy(f, path / f.name)
    return path


def _head(cfg: ModelConfig, seed: int = 1, draft_vocab: int = 300) -> tuple[Eagle3Head, torch.nn.Embedding]:
    gen = torch.Generator().manual_seed(seed)
    embed = torch.nn.Embedding.from_pretrained(torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen) * 0.5)
    counts = torch.randint(0, 100, (cfg.vocab_size,), generator=gen)
    draft_ids, d2t, _ = draft_vocabulary(counts, draft_vocab)
    head = build_head(cfg, embed, torch.randn(cfg.vocab_size, cfg.hidden_size, generator=gen), draft_ids, d2t, 256, seed)
    with torch.no_grad():  # larger weights than training's init, so that every path matters
        for p in head.parameters():
            p.normal_(0, 0.2, generator=gen) if p.dim() == 2 else p.uniform_(0.5, 1.5, generator=gen)
    return head.eval(), embed


def test_training_steps_equal_the_drafting_path(tiny_target):
    """TTT step k of chain t equals the head run as the draft worker runs it: a prefill of the pairs
    (x_{u+1}, f_u) for u ≤ t from target features, then k decode steps on its own features."""
    cfg = ModelConfig.from_dir(tiny_target)
    head, embed = _head(cfg)
    gen = torch.Generator().manual_seed(3)
    T, steps = 14, 3
    tokens = torch.randint(0, cfg.vocab_size, (T,), generator=gen)
    hidden = torch.randn(T, 3 * cfg.hidden_size, generator=gen)
    with torch.no_grad():
        outs = step_features(head, embed, tokens, hidden, steps)
        feats = head.project([hidden])
        for t in (0, 4, 9):
            kv = allocate_kv_cache(1, 8, 4, cfg.num_kv_heads, cfg.head_dim, torch.float32, "cpu")
            table = list(range(8))
            meta = AttentionMetadata.build([t + 1], [t + 1], [table], 4)
            head.embed = [embed]
            out = head(tokens[1 : t + 2], feats[: t + 1], torch.arange(t + 1), meta, kv)[-1]
            assert torch.allclose(out, outs[0][t], atol=1e-4)
            for k in range(1, steps):
                pos = t + k
                meta = AttentionMetadata.build([1], [pos + 1], [table], 4)
                out = head(tokens[pos + 1 : pos + 2], out[None], torch.tensor([pos]), meta, kv)[0]
                assert torch.allclose(out, outs[k][t], atol=1e-4), (t, k)


def test_checkpoint_round_trips_through_the_loader(tiny_target, tmp_path):
    cfg = ModelConfig.from_dir(tiny_target)
    head, _ = _head(cfg)
    t2d = torch.zeros(cfg.vocab_size, dtype=torch.bool)
    t2d[torch.arange(300) + head.d2t] = True
    save_eagle3(head, t2d, tmp_path, layers=[2, 2, 1], verifier=str(tiny_target), num_speculative_tokens=3,
                dtype=torch.float32)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3" and config["draft_vocab_size"] == 300
    embed, lm_head, target_cfg = load_target_parts(tiny_target)
    loaded, layers = load_eagle(tmp_path, embed, lm_head, target_cfg, 256)
    assert layers == [2, 2, 1] and isinstance(loaded, Eagle3Head)
    for (name, a), (_, b) in zip(sorted(head.state_dict().items()), sorted(loaded.state_dict().items())):
        assert torch.equal(a, b), name


def test_speculators_format_eagle3_config_loads(tmp_path, tiny_target):
    """A checkpoint as speculators 0.9.0 writes it: nested transformer_layer_config, layers.0.* names,
    the embedding saved, t2d bool, top-level aux layer ids."""
    H, heads, kv, inter, dv = 64, 4, 2, 128, 100
    gen = torch.Generator().manual_seed(5)

    def w(*shape):
        return torch.randn(*shape, generator=gen) * 0.1

    state = {"fc.weight": w(H, 3 * H), "layers.0.self_attn.q_proj.weight": w(heads * 16, 2 * H),
             "layers.0.self_attn.k_proj.weight": w(kv * 16, 2 * H), "layers.0.self_attn.v_proj.weight": w(kv * 16, 2 * H),
             "layers.0.self_attn.o_proj.weight": w(H, heads * 16), "layers.0.mlp.gate_proj.weight": w(inter, H),
             "layers.0.mlp.up_proj.weight": w(inter, H), "layers.0.mlp.down_proj.weight": w(H, inter),
             "layers.0.input_layernorm.weight": torch.ones(H), "layers.0.hidden_norm.weight": torch.ones(H),
             "layers.0.post_attention_layernorm.weight": torch.ones(H), "norm.weight": torch.ones(H),
             "lm_head.weight": w(dv, H), "embed_tokens.weight": w(VOCAB, H),
             "d2t": torch.arange(dv, dtype=torch.long) * 3, "t2d": torch.zeros(VOCAB, dtype=torch.bool)}
    save_file(state, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": ["Eagle3DraftModel"], "auto_map": {"": "config.Eagle3SpeculatorConfig"},
        "draft_vocab_size": dv, "dtype": "float32", "eagle_aux_hidden_state_layer_ids": [1, 2, 3],
        "embed_requires_grad": False, "fc_norm": False, "norm_before_fc": False, "norm_before_residual": True,
        "norm_output": False,
        "speculators_config": {"algorithm": "eagle3", "default_proposal_method": "greedy",
                               "proposal_methods": [{"accept_tolerance": 0.0, "proposal_type": "greedy",
                                                     "speculative_tokens": 3, "verifier_accept_k": 1}],
                               "verifier": {"architectures": ["LlamaForCausalLM"], "name_or_path": str(tiny_target)}},
        "speculators_model_type": "eagle3", "speculators_version": "0.9.0", "target_hidden_size": None,
        "tie_word_embeddings": False,
        "transformer_layer_config": {
            "attention_bias": False, "attention_dropout": 0.0, "head_dim": 16, "hidden_act": "silu", "hidden_size": H,
            "initializer_range": 0.02, "intermediate_size": inter, "max_position_embeddings": 512, "mlp_bias": False,
            "model_type": "llama", "num_attention_heads": heads, "num_hidden_layers": 1, "num_key_value_heads": kv,
            "rms_norm_eps": 1e-06, "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"},
            "tie_word_embeddings": False, "use_cache": True, "vocab_size": VOCAB},
        "transformers_version": "5.23.0"}
    (tmp_path / "config.json").write_text(json.dumps(config))
    embed, lm_head, target_cfg = load_target_parts(tiny_target)
    head, layers = load_eagle(tmp_path, embed, lm_head, target_cfg, 256)
    assert isinstance(head, Eagle3Head) and layers == [1, 2, 3]
    assert head.midlayer.norm_before_residual
    assert torch.equal(head.midlayer.self_attn.qkv_proj.weight[: heads * 16], state["layers.0.self_attn.q_proj.weight"])
    assert torch.equal(head.d2t, state["d2t"])
    bad = dict(config, norm_before_fc=True)
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ValueError, match="norm_before_fc"):
        load_eagle(tmp_path, embed, lm_head, target_cfg, 256)


def test_tiny_training_run_writes_a_head_that_speculates_losslessly(tiny_target, tmp_path):
    out = tmp_path / "head"
    metrics = train(TrainConfig(target=str(tiny_target), out=str(out), prompts=6, eval_prompts=2, max_tokens=12,
                                max_len=256, shard_size=4, draft_vocab=512, steps=2, epochs=1, batch_tokens=256,
                                warmup=1, save_every=2, threads=1, dtype="float32"), progress=_quiet)
    assert metrics["train_sequences"] > 0 and metrics["acceptance_length"] is not None
    assert (out / "train_state.pt").exists() and (out / "data" / "eval" / "shard_00000.pt").exists()
    # resuming finds every stage done and gives the same head
    again = train(TrainConfig(target=str(tiny_target), out=str(out), prompts=6, eval_prompts=2, max_tokens=12,
                              max_len=256, shard_size=4, draft_vocab=512, steps=2, epochs=1, batch_tokens=256,
                              warmup=1, save_every=2, threads=1, dtype="float32"), progress=_quiet)
    assert again["acceptance_length"] == metrics["acceptance_length"]
    embed, lm_head, target_cfg = load_target_parts(tiny_target)
    head, layers = load_eagle(out, embed, lm_head, target_cfg, 256)
    model = load_model(tiny_target)
    rng = random.Random(0)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 20))] for i in range(8)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = Engine(model, EngineConfig(num_blocks=256, block_size=4), eos_token_ids=()).generate(prompts, params)
    for batch in (1, 8):
        engine = Engine(model, EngineConfig(num_blocks=256, block_size=4), eos_token_ids=(),
                            num_speculative_tokens=3, hidden_layers=tuple(layers))
        proposer = EagleProposer(head, layers, num_blocks=256, block_size=4)
        got = {}
        items = list(prompts.items())
        for i in range(0, len(items), batch):
            got.update(run_spec(engine, proposer, dict(items[i : i + batch]), params))
        assert got == plain
        assert engine.counters[""].num_drafts > 0  # the trained head drafted and was verified


def test_chat_and_self_instruct_prompts_and_fine_tuning_from_a_head(tiny_target, tmp_path):
    from workers.draft.train.prompts import STYLES, clean_user_turn, mixed_conversation

    # the styles are pure functions of (seed, index), taken in turn; self-instruct asks the target to write
    styles = ("chat", "self-instruct", "templates")
    convs = [mixed_conversation(3, i, styles) for i in range(30)]
    assert convs == [mixed_conversation(3, i, styles) for i in range(30)]
    assert all("writer" in c for c in convs[1::3]) and not any("writer" in c for c in convs[0::3] + convs[2::3])
    assert len({c["messages"][-1]["content"] for c in convs[0::3]}) >= 9  # chat prompts vary
    assert clean_user_turn('  Message: "how do I boil an egg?" ') == "how do I boil an egg?"
    assert clean_user_turn("ok") is None
    with pytest.raises(ValueError, match="--styles"):
        TrainConfig(target=str(tiny_target), out=str(tmp_path / "x"), styles=("poems",))
    assert set(STYLES) == {"templates", "chat", "self-instruct"}

    common = dict(target=str(tiny_target), prompts=6, eval_prompts=2, max_tokens=12, max_len=256, shard_size=4,
                  draft_vocab=512, steps=2, epochs=1, batch_tokens=256, warmup=1, save_every=2, threads=1,
                  dtype="float32", styles=("chat", "self-instruct"))
    first = train(TrainConfig(out=str(tmp_path / "first"), **common), progress=_quiet)
    assert first["train_sequences"] >= 4  # self-instruct turns the tiny target wrote were used
    samples = torch.load(tmp_path / "first" / "data" / "train" / "shard_00000.pt", weights_only=True)
    assert all(bool(s["mask"].any()) for s in samples)
    # fine-tuning: the second head starts from the first one's weights, its vocabulary re-chosen
    embed, lm_head, target_cfg = load_target_parts(tiny_target)
    start, _ = load_eagle(tmp_path / "first", embed, lm_head, target_cfg, 256)
    tuned = train(TrainConfig(out=str(tmp_path / "tuned"), init_from=str(tmp_path / "first"), lr=1e-9,
                              data_from=str(tmp_path / "first"), **common), progress=_quiet)
    head, _ = load_eagle(tmp_path / "tuned", embed, lm_head, target_cfg, 256)
    torch.testing.assert_close(head.fc.weight, start.fc.weight)  # lr ≈ 0: the weights it started from
    assert tuned["acceptance_length"] == pytest.approx(first["acceptance_length"])
    with pytest.raises(ValueError, match="--init-from"):
        TrainConfig(out=str(tmp_path / "m"), head="medusa", init_from=str(tmp_path / "first"),
                    **{k: v for k, v in common.items()})


def test_medusa_and_mlp_heads_train_reuse_conversations_and_speculate_losslessly(tiny_target, tmp_path):
    from workers.draft.head_proposer import HeadProposer
    from workers.draft.spec_heads import MedusaHead, MlpSpeculatorHead, load_spec_head

    common = dict(target=str(tiny_target), prompts=6, eval_prompts=2, max_tokens=12, max_len=256, shard_size=4,
                  draft_vocab=512, steps=3, epochs=1, batch_tokens=256, warmup=1, save_every=2, threads=1,
                  dtype="float32")
    medusa = train(TrainConfig(out=str(tmp_path / "medusa"), head="medusa", **common), progress=_quiet)
    assert medusa["head"] == "medusa" and medusa["acceptance_length"] is not None and medusa["draft_vocab"] == 512
    assert json.loads((tmp_path / "medusa" / "data" / "layers.json").read_text()) == [4]
    # the MLP speculator reuses those conversations: hidden states recomputed, the same tokens
    mlp = train(TrainConfig(out=str(tmp_path / "mlp"), head="mlp", data_from=str(tmp_path / "medusa"), **common),
                progress=_quiet)
    assert mlp["train_tokens"] == medusa["train_tokens"] and mlp["draft_vocab"] == VOCAB
    a = torch.load(tmp_path / "medusa" / "data" / "train" / "shard_00000.pt", weights_only=True)
    b = torch.load(tmp_path / "mlp" / "data" / "train" / "shard_00000.pt", weights_only=True)
    assert [x["tokens"].tolist() for x in a] == [x["tokens"].tolist() for x in b]
    torch.testing.assert_close(a[0]["hidden"], b[0]["hidden"])
    # shards of other layers under --out are refused, not mixed
    (tmp_path / "e3" / "data").mkdir(parents=True)
    (tmp_path / "e3" / "data" / "layers.json").write_text("[2, 2, 1]")
    with pytest.raises(ValueError, match="other target layers"):
        train(TrainConfig(out=str(tmp_path / "e3"), head="medusa", **common), progress=_quiet)
    model = load_model(tiny_target)
    rng = random.Random(1)
    prompts = {f"r{i}": [rng.randrange(VOCAB) for _ in range(rng.randrange(4, 20))] for i in range(8)}
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = Engine(model, EngineConfig(num_blocks=256, block_size=4), eos_token_ids=()).generate(prompts, params)
    _, lm_head, _ = load_target_parts(tiny_target)
    for name, cls in (("medusa", MedusaHead), ("mlp", MlpSpeculatorHead)):
        head = load_spec_head(tmp_path / name, 64, VOCAB, lm_head)
        assert isinstance(head, cls) and head.n_predict == 3
        for batch in (1, 8):
            engine = Engine(model, EngineConfig(num_blocks=256, block_size=4), eos_token_ids=(),
                                num_speculative_tokens=3, hidden_layers=(4,))
            proposer = HeadProposer(head, 4)
            got = {}
            items = list(prompts.items())
            for i in range(0, len(items), batch):
                got.update(run_spec(engine, proposer, dict(items[i : i + batch]), params))
            assert got == plain
            assert engine.counters[""].num_drafts > 0


def test_targets_it_cannot_train_for_are_one_line_errors(tmp_path, tiny_target):
    with pytest.raises(ValueError, match="not a model directory"):
        TrainConfig(target=str(tmp_path / "missing"), out=str(tmp_path / "o"))
    small = tmp_path / "small"
    small.mkdir()
    cfg = json.loads((tiny_target / "config.json").read_text())
    (small / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 2}))
    with pytest.raises(ValueError, match="at least 4 layers"):
        check_target(small)
    (small / "config.json").write_text(json.dumps({**cfg, "model_type": "gpt2"}))
    with pytest.raises(ValueError, match="unsupported model_type"):
        check_target(small)
    (small / "config.json").write_text(json.dumps({**cfg, "model_type": "qwen3"}))
    assert check_target(small).qk_norm  # taken: the head is a Llama layer whatever the target's attention


class _quiet:
    def __init__(self, *args, **kwargs):
        pass

    def update(self, n=1):
        pass

    def set_postfix(self, **kwargs):
        pass

    def close(self):
        pass
