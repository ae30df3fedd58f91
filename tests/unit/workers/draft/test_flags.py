"""The draft worker's flags (issue #55): few, each documented, its method knobs in --speculative-config
and its online distillation's in --distill-config, the retired flags pointing to where they went."""

from __future__ import annotations

import json
import re

import pytest

from runtime.config import EnvParser, add_runtime_args
from workers.draft.__main__ import RETIRED_FLAGS, build_parser, draft_config, main, make_proposer, parse_args
from workers.draft.config import DistillSettings
from workers.draft.ngram import NgramProposer
from workers.speculation.spec_config import SpeculativeConfig


def option_names(parser: EnvParser) -> set[str]:
    """Each option by its first spelling, help left out."""
    return {action.option_strings[0] for action in parser.options if action.option_strings[0] not in ("-h", "--help")}


def runtime_names() -> set[str]:
    parser = EnvParser(prog="x")
    add_runtime_args(parser)
    return option_names(parser)


def config(*argv: str):
    return draft_config(parse_args(list(argv)))


def test_the_draft_worker_has_at_most_40_flags_31_of_its_own():
    every = option_names(build_parser())
    own = every - runtime_names()
    assert len(own) <= 31, sorted(own)
    assert len(every) <= 40, sorted(every)


def test_every_flag_is_documented_and_the_cap_is_no_longer_called_gamma():
    parser = build_parser()
    for action in parser.options:
        assert (getattr(action, "plain_help", None) or action.help or "").strip(), action.option_strings
    spellings = {s for action in parser.options for s in action.option_strings}
    assert "--num-speculative-tokens" not in spellings and "--max-speculative-tokens" not in spellings
    assert {"--speculative-config", "--distill-config", "--online-distill"} <= spellings


@pytest.mark.parametrize("flag", sorted(RETIRED_FLAGS))
def test_a_retired_flag_is_one_line_naming_where_it_went(flag, capsys):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--method", "ngram", flag, "3"])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{flag} was retired: use " in err and "unrecognized" not in err
    # the suggestion names a key that exists
    group, _, example = RETIRED_FLAGS[flag].partition(" ")
    key = re.match(r"""'\{"(\w+)": """, example).group(1)
    assert key in (SpeculativeConfig if group == "--speculative-config" else DistillSettings).model_fields


def test_a_retired_flag_with_equals_is_caught_too(capsys):
    with pytest.raises(SystemExit):
        parse_args(["--ngram-max=3"])
    assert "--ngram-max was retired: use --speculative-config '{\"prompt_lookup_max\": N}'" in capsys.readouterr().err


def test_speculative_config_keys_reach_the_ngram_drafter():
    cfg = config("--method", "ngram", "--speculative-config",
                 '{"prompt_lookup_min": 2, "prompt_lookup_max": 3, "eagle_topk": 2, "max_num_speculative_tokens": 7}')
    proposer = make_proposer(cfg)
    assert isinstance(proposer, NgramProposer)
    assert (proposer.min_n, proposer.max_n, proposer.tree_topk) == (2, 3, 2)
    assert cfg.spec.max_num_speculative_tokens == 7 and (cfg.tree_topk, cfg.tree_depth) == (2, 0)


def test_defaults_and_the_targets_keys_are_ignored():
    cfg = config()
    assert cfg.method == "ngram" and cfg.spec.max_num_speculative_tokens == 16 and (cfg.tree_topk, cfg.tree_depth) == (1, 0)
    assert cfg.spec.overlap and cfg.spec.stage_alternatives == 1 and not cfg.spec.eagle_pipelined
    # tandem up hands one JSON to both workers: the target's keys (γ among them) change nothing here
    shared = config("--speculative-config", '{"num_speculative_tokens": 3, "seam": "sync", "propose_timeout": 1}')
    assert shared.spec.max_num_speculative_tokens == 16 and shared.method == "ngram"
    assert make_proposer(shared).max_n == 4


def test_a_file_holds_the_config_too(tmp_path):
    path = tmp_path / "spec.json"
    path.write_text('{"method": "suffix", "suffix_decoding_max_tree_depth": 12, "overlap": false}')
    cfg = config("--speculative-config", f"@{path}")
    assert cfg.method == "suffix" and not cfg.spec.overlap and make_proposer(cfg).config.max_depth == 12


def test_method_and_model_keys_mean_the_flags(tmp_path):
    assert config("--speculative-config", '{"method": "suffix"}').method == "suffix"
    assert config("--draft-method", "suffix", "--speculative-config", '{"method": "suffix"}').method == "suffix"
    draft = tmp_path / "draft"
    draft.mkdir()
    cfg = config("--speculative-config", json.dumps({"method": "draft_model", "model": str(draft)}))
    assert (cfg.method, cfg.draft_model) == ("draft_model", str(draft))
    head = tmp_path / "my-eagle3-head"
    head.mkdir()
    cfg = config("--device", "cpu", "--speculative-config", json.dumps({"model": str(head)}))  # vLLM's guess
    assert (cfg.method, cfg.eagle_model) == ("eagle3", str(head))
    cfg = config("--draft-method", "medusa", "--device", "cpu", "--speculative-config", json.dumps({"model": str(head)}))
    assert (cfg.method, cfg.eagle_model) == ("medusa", str(head))


@pytest.mark.parametrize("argv,message", [
    (["--draft-method", "suffix", "--speculative-config", '{"method": "ngram"}'],
     "--draft-method suffix disagrees with --speculative-config's 'method' 'ngram'"),
    (["--method", "eagle3", "--eagle-model", "A", "--speculative-config", '{"model": "B"}'],
     "--eagle-model A disagrees with --speculative-config's 'model' 'B'"),
    (["--speculative-config", '{"method": "ngram", "model": "M"}'], "'model' is a draft model or head: method ngram"),
    (["--speculative-config", '{"model": "/nonexistent/m"}'], "--speculative-config's 'model' /nonexistent/m does not"),
    (["--speculative-config", '{"prompt_lookup_max": 0}'], "--speculative-config: 'prompt_lookup_max' Input should be"),
    (["--speculative-config", '{"ngram_max": 3}'], "--speculative-config: 'ngram_max' unknown key"),
    (["--speculative-config", '{"prompt_lookup_min": 5}'], "'prompt_lookup_min' must not exceed 'prompt_lookup_max'"),
    (["--speculative-config", "[1]"], "--speculative-config must be a JSON object"),
    (["--method", "oracle", "--speculative-config", '{"oracle_file": "/nonexistent/refs.json"}'],
     "--speculative-config's 'oracle_file' /nonexistent/refs.json does not exist"),
    (["--distill-config", '{"lr": 0.1}'], "--distill-config's 'lr' tunes --online-distill: give --online-distill too"),
    (["--method", "eagle3", "--online-distill", "--distill-config", '{"share": 1.5}'],
     "--distill-config: 'share' Input should be less than or equal to 1"),
    (["--distill-config", '{"steps": 3}'], "--distill-config: 'steps' unknown key"),
    (["--online-distill"], "they need --draft-method eagle3"),
    (["--distill-config", '{"follow": "."}'], "they need --draft-method eagle3"),
])
def test_bad_configs_are_one_line_naming_the_flag_and_key(argv, message):
    with pytest.raises(ValueError) as exc:
        config(*argv)
    assert message in str(exc.value) and "\n" not in str(exc.value)


def test_the_worker_exits_with_that_line(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--draft-method", "suffix", "--speculative-config", '{"method": "ngram"}'])
    assert str(exc.value.code) == ("python -m workers.draft: --draft-method suffix disagrees with "
                                   "--speculative-config's 'method' 'ngram'")


def test_distill_config_reaches_the_trainers_settings(tmp_path):
    head, target = tmp_path / "head", tmp_path / "target"
    head.mkdir()
    target.mkdir()
    base = ["--method", "eagle3", "--eagle-model", str(head), "--target-model", str(target), "--device", "cpu"]
    cfg = config(*base, "--online-distill", "--distill-config",
                 json.dumps({"share": 1, "lr": 3e-3, "min_tokens": 256, "eval_every": 4, "dir": str(tmp_path)}))
    trainer = cfg.distill_config("cpu")
    assert (trainer.share, trainer.lr, trainer.min_tokens, trainer.eval_every, trainer.out_dir) == (
        1, 3e-3, 256, 4, str(tmp_path))
    assert (trainer.head_dir, trainer.target_dir) == (str(head), str(target))
    follow = config(*base, "--distill-config", json.dumps({"follow": str(tmp_path)}))  # no --online-distill
    assert follow.distill.follow == str(tmp_path) and not follow.online_distill
    assert config().distill == DistillSettings()


def test_a_retired_flags_environment_variable_is_refused_too(capsys, monkeypatch):
    monkeypatch.setenv("TANDEM_EAGLE_PIPELINED", "1")
    with pytest.raises(SystemExit) as exc:
        parse_args([])
    assert exc.value.code == 2
    assert ("TANDEM_EAGLE_PIPELINED (--eagle-pipelined) was retired: use --speculative-config "
            "'{\"eagle_pipelined\": true}' (or TANDEM_SPECULATIVE_CONFIG with that JSON)") in capsys.readouterr().err
    monkeypatch.delenv("TANDEM_EAGLE_PIPELINED")
    # the target worker's and tandem up's γ, in an environment they share, is not the draft's business
    monkeypatch.setenv("TANDEM_NUM_SPECULATIVE_TOKENS", "3")
    assert parse_args([]).speculative_config is None


def test_the_speculative_config_reads_from_the_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_SPECULATIVE_CONFIG", '{"prompt_lookup_max": 2}')
    assert config().spec.prompt_lookup_max == 2
