"""``tandem up``'s engine and frontend flags: one definition with the worker's parser, passed on
exactly as given; ``--served-model-name`` with several names; ``--speculative-config``; the banner."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from deploy.cli import build_parser, stack_config
from deploy.launcher import CPU_SPECULATION_NOTE, banner
from deploy.stack import component_names, plan
from frontend.__main__ import build_parser as frontend_parser
from frontend.__main__ import build_config
from frontend.flags import FRONTEND_FLAGS
from workers.draft.__main__ import draft_config, parse_args as draft_args
from workers.target.__main__ import build_parser as target_parser
from workers.target.__main__ import target_config
from workers.speculation.spec_config import speculative_config
from workers.target.flags import ENGINE_FLAGS

pytestmark = pytest.mark.unit

MUST_SHOW = ["--max-model-len", "2048", "--dtype", "float32", "--gpu-memory-utilization", "0.5",
             "--served-model-name", "a", "b"]


def up(*argv: str):
    return stack_config(build_parser().parse_args(["up", *argv]))


def components(config):
    ports = {name: 1000 + i for i, name in enumerate(component_names(config))}
    ports["frontend"] = 8000
    return {c.name: c for c in plan(config, "/m" if not config.mock else None, ports)}


def action(parser: argparse.ArgumentParser, flag: str) -> argparse.Action:
    return next(a for a in parser.options if flag in a.option_strings)


@pytest.mark.parametrize("flag", ENGINE_FLAGS + FRONTEND_FLAGS, ids=lambda f: f.flag)
def test_the_launcher_and_the_worker_share_one_definition(flag):
    owner = target_parser() if flag in ENGINE_FLAGS else frontend_parser()
    ours, theirs = action(build_parser().subcommands["up"], flag.flag), action(owner, flag.flag)
    assert ours.option_strings == theirs.option_strings
    assert (ours.type, ours.choices, ours.nargs, type(ours)) == (theirs.type, theirs.choices, theirs.nargs, type(theirs))
    assert ours.plain_help.startswith(theirs.plain_help)  # the owner's words, then whom it is passed to
    assert ours.default is None and ours.env_var == theirs.env_var  # unset unless given: the owner's default holds


def test_the_issues_command_reaches_the_target_as_given_and_its_parser_reads_it():
    config = up("--model", "/m", "--draft-method", "none", *MUST_SHOW, "--kv-cache-gb", "0.25", "--max-num-seqs", "8")
    target = components(config)["target-0"]
    args = target_parser().parse_args(list(target.args))
    assert (args.max_model_len, args.dtype, args.gpu_memory_utilization, args.kv_cache_gb, args.max_num_seqs) == \
        (2048, "float32", 0.5, 0.25, 8)
    assert args.served_model_name == ["a", "b"]
    cfg = target_config(args, Path(__file__).parent)  # a directory that exists, for --model
    assert (cfg.served_model_name, cfg.served_model_aliases, cfg.gpu_memory_utilization) == ("a", ("b",), 0.5)


def test_flags_not_given_are_not_passed_so_the_workers_defaults_hold():
    target = components(up("--model", "/m", "--draft-method", "none"))["target-0"]
    for flag in ENGINE_FLAGS:
        assert flag.flag not in target.args
    frontend = components(up("--mock"))["frontend"]
    assert not any(flag.flag in frontend.args for flag in FRONTEND_FLAGS)


def test_prefill_workers_get_the_engine_flags_and_drafts_the_first_name():
    config = up("--model", "/m", "--draft-method", "ngram", "--prefill-workers", "1", *MUST_SHOW)
    comps = components(config)
    assert "--max-model-len" in comps["prefill-0"].args and "--dtype" in comps["prefill-0"].args
    draft = comps["draft-0"]
    assert "--max-model-len" not in draft.args
    assert draft_config(draft_args(list(draft.args))).model_name == "a"


def test_mock_targets_take_the_context_length_and_refuse_model_only_flags():
    mock = components(up("--mock", "--max-model-len", "512", "--served-model-name", "a", "b"))["target-0"]
    assert list(mock.args[:3]) == ["--served-model-name", "a", "b"] and "512" in mock.args
    with pytest.raises(ValueError, match=r"--dtype, --gpu-memory-utilization apply to model targets, not --mock"):
        up("--mock", "--dtype", "float32", "--gpu-memory-utilization", "0.5")


def test_port_is_an_alias_of_http_port():
    assert up("--mock", "--port", "9123").http_port == 9123
    assert frontend_parser().parse_args(["--port", "9123"]).http_port == 9123


def test_api_keys_reach_the_frontend_in_its_environment_not_its_command_line():
    frontend = components(up("--mock", "--api-key", "k1", "--api-key", "k2"))["frontend"]
    assert dict(frontend.env) == {"TANDEM_API_KEY": "k1,k2"}
    assert "k1" not in " ".join(frontend.args)


def test_tool_call_parser_passes_through_and_an_unknown_one_lists_the_known(capsys):
    frontend = components(up("--mock", "--tool-call-parser", "mistral", "--enable-auto-tool-choice"))["frontend"]
    args = frontend_parser().parse_args(list(frontend.args))
    assert build_config(args).tool_call_parser == "mistral" and args.enable_auto_tool_choice
    with pytest.raises(SystemExit):
        build_parser().parse_args(["up", "--tool-call-parser", "qwen25"])
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "hermes" in err and "mistral" in err and "llama3_json" in err


# --- --speculative-config ------------------------------------------------------------------------


def test_vllms_eagle3_config_maps_onto_the_draft_flags():
    config = up("--model", "/m", "--speculative-config",
                '{"method": "eagle3", "model": "/heads/e3", "num_speculative_tokens": 3}')
    assert (config.draft_method, config.draft_model, config.num_speculative_tokens) == ("eagle3", "/heads/e3", 3)
    draft = components(config)["draft-0"]
    assert draft_args(list(draft.args)).method == "eagle3"
    assert "--eagle-model" in draft.args and "/heads/e3" in draft.args


def test_draft_only_keys_without_draft_workers_are_an_error():
    for extra in (["--drafts", "0"], ["--mock"]):
        with pytest.raises(ValueError, match="prompt_lookup_max are the draft workers' keys"):
            up("--model", "/m", *extra, "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 3}')


def test_one_config_reaches_the_target_and_the_draft_each_reading_its_keys():
    config = up("--model", "/m", "--speculative-config",
                '{"method": "ngram", "num_speculative_tokens": 5, "prompt_lookup_max": 3, "prompt_lookup_min": 2, '
                '"propose_timeout": 1.5}')
    draft = draft_config(draft_args(list(components(config)["draft-0"].args)))
    assert (draft.method, draft.spec.prompt_lookup_max, draft.spec.prompt_lookup_min) == ("ngram", 3, 2)
    target = target_config(target_parser().parse_args(list(components(config)["target-0"].args)), Path(__file__).parent)
    assert (target.spec.num_speculative_tokens, target.spec.propose_timeout) == (5, 1.5)
    assert target.spec.hidden_layers == "none"  # no draft of this stack reads hidden states


def test_a_gamma_above_the_drafts_cap_raises_the_cap():
    config = up("--model", "/m", "--draft-method", "ngram", "--num-speculative-tokens", "20")
    draft = draft_config(draft_args(list(components(config)["draft-0"].args)))
    assert draft.spec.max_num_speculative_tokens == 20


@pytest.mark.parametrize("method", ["eagle", "eagle3", "ngram", "medusa", "mlp_speculator", "draft_model", "suffix"])
def test_every_vllm_method_name_is_read(method):
    text = '{"method": "%s", "model": "/x"}' % method if method not in ("ngram", "suffix") else '{"method": "%s"}' % method
    assert speculative_config(text).draft_method == method


@pytest.mark.parametrize("text,message", [
    ('{"method": "eagle3", "model": "/h", "acceptance_method": "typical"}', "'acceptance_method' unknown key"),
    ('{"method": "lookahead"}', "'method' must be one of"),
    ('{"method": "ngram", "num_speculative_tokens": "x"}', "'num_speculative_tokens' Input should be a valid integer"),
    ('{"method": "eagle3", "model": "/h", "prompt_lookup_max": 3}', "apply to method ngram"),
    ('{"method": "eagle", "model": "/h", "draft_tensor_parallel_size": 2}', "'draft_tensor_parallel_size'"),
    ("[1, 2]", "must be a JSON object"),
    ("{method: eagle3}", "is not JSON"),
])
def test_a_bad_config_is_an_error_naming_the_key(text, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace("[", r"\[")):
        up("--model", "/m", "--speculative-config", text)


def test_without_a_method_vllms_guess_from_the_model_name():
    assert speculative_config('{"model": "yuhuili/EAGLE3-LLaMA3.1-Instruct-8B"}').draft_method == "eagle3"
    assert speculative_config('{"model": "yuhuili/EAGLE-LLaMA3-Instruct-8B"}').draft_method == "eagle"
    assert speculative_config('{"model": "/models/llama-68m"}').draft_method == "draft_model"
    assert up("--model", "/m", "--speculative-config", '{"num_speculative_tokens": 3}').draft_method == "ngram"


def test_a_flag_that_disagrees_with_the_config_is_an_error():
    with pytest.raises(ValueError, match="--draft-method ngram disagrees with --speculative-config's 'eagle3'"):
        up("--model", "/m", "--draft-method", "ngram", "--speculative-config", '{"method": "eagle3", "model": "/h"}')
    with pytest.raises(ValueError, match="--num-speculative-tokens 4 disagrees"):
        up("--model", "/m", "--num-speculative-tokens", "4", "--speculative-config", '{"num_speculative_tokens": 3}')
    same = up("--model", "/m", "--num-speculative-tokens", "3", "--speculative-config",
              '{"method": "ngram", "num_speculative_tokens": 3}')
    assert same.num_speculative_tokens == 3


# --- the banner ----------------------------------------------------------------------------------


ENV = {"TANDEM_ETCD": "http://127.0.0.1:1", "TANDEM_NATS": "nats://127.0.0.1:2", "TANDEM_NAMESPACE": "t"}


def test_the_banners_curl_sends_the_key_when_one_is_required():
    text = banner(up("--mock", "--api-key", "k1"), None, "http://127.0.0.1:8000", ENV)
    assert '-H "Authorization: Bearer $TANDEM_API_KEY"' in text
    assert "Authorization" not in banner(up("--mock"), None, "http://127.0.0.1:8000", ENV)


def test_the_banner_names_every_served_name(monkeypatch):
    text = banner(up("--mock", "--served-model-name", "a", "b"), None, "http://127.0.0.1:8000", ENV)
    assert "(model 'a', also served as 'b')" in text and "--served-model-name a b" in text


def test_the_banner_points_at_each_targets_vllm_metrics():
    """vllm: names are on each target's health port, not on the frontend's /metrics: the banner says where."""
    urls = {"target-0": "http://127.0.0.1:4100/metrics", "target-1": "http://127.0.0.1:4101/metrics"}
    text = banner(up("--model", "/m", "--draft-method", "none", "--targets", "2"), "/m", "http://127.0.0.1:8000", ENV,
                  urls)
    assert "vLLM's engine metrics (vllm:*) are each target's, not on http://127.0.0.1:8000/metrics" in text
    for port, name in ((4100, "target-0"), (4101, "target-1")):
        assert f"  http://127.0.0.1:{port}/metrics  ({name})" in text
    assert "vllm:" not in banner(up("--mock"), None, "http://127.0.0.1:8000", ENV, urls)  # the mock has none


def test_the_cpu_note_says_what_was_measured():
    """A verify step costs about a plain one on this CPU (docs/benchmarks.md): the note must not say k steps."""
    assert "k plain steps" not in CPU_SPECULATION_NOTE
    assert "1.02x and 1.13x" in CPU_SPECULATION_NOTE and "docs/benchmarks.md" in CPU_SPECULATION_NOTE


def test_the_banner_says_why_a_cpu_decodes_plainly(monkeypatch):
    import deploy.launcher as launcher

    config = up("--model", "/m", "--draft-method", "ngram")
    monkeypatch.setattr(launcher, "gpu_visible", lambda: False)
    assert CPU_SPECULATION_NOTE in banner(config, "/m", "http://x", ENV)
    monkeypatch.setattr(launcher, "gpu_visible", lambda: True)
    assert CPU_SPECULATION_NOTE not in banner(config, "/m", "http://x", ENV)
    monkeypatch.setattr(launcher, "gpu_visible", lambda: False)
    assert CPU_SPECULATION_NOTE not in banner(up("--mock"), None, "http://x", ENV)


def test_a_converted_demo_model_starts_without_a_conversion_line(tmp_path, monkeypatch, caplog):
    import deploy.launcher as launcher
    from workers import demo_model

    monkeypatch.setenv("TANDEM_CACHE", str(tmp_path))
    ready = tmp_path / demo_model.MODEL_DIR
    ready.mkdir()
    (ready / ".complete").write_text(demo_model._FORMAT)

    def no_child(*args, **kwargs):
        raise AssertionError("a converted model needs no python -m workers.demo_model")

    monkeypatch.setattr(launcher.subprocess, "run", no_child)
    with caplog.at_level("INFO"):
        assert launcher.resolve_demo_model() == str(ready)
    assert "demo model" not in caplog.text
