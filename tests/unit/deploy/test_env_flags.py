"""Every flag of every command has help, shows its default and reads ``TANDEM_<FLAG>``."""

import argparse
import importlib

import pytest

from deploy.cli_reference import COMMANDS, _sub
from runtime.config import SWITCHES, EnvParser, apply_env_defaults

pytestmark = pytest.mark.unit


def _parser(module, path):
    return _sub(importlib.import_module(module).build_parser(), path)


def _options(parser):
    return [a for a in parser.options if a.option_strings and a.kind != "help"]


def _env_value(action):
    """A value for the option's variable that differs from its default, and what it should parse to."""
    if action.kind in SWITCHES:
        return "true", action.const
    if action.choices is not None:
        choice = ([c for c in action.choices if c != action.default] or list(action.choices))[-1]
        return str(choice), choice
    if action.type is int:
        return "7", 7
    if action.type is float:
        return "0.5", 0.5
    if action.kind == "append" or action.nargs in ("+", "*"):
        return "a,b", ["a", "b"]
    return "env-value", "env-value"


@pytest.mark.parametrize("title,module,path", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_flag_has_help_default_and_env(title, module, path):
    parser = _parser(module, path)
    for action in _options(parser):
        flag = action.option_strings[0]
        assert action.plain_help.strip(), f"{title} {flag} has no help"
        assert action.env_var in action.help, f"{title} {flag}: help does not name {action.env_var}"
        if action.kind not in SWITCHES:
            assert "default" in action.help.lower(), f"{title} {flag}: help does not show its default"
    names = [a.env_var for a in _options(parser)]
    assert len(names) == len(set(names)), f"{title}: two flags share an environment variable"


@pytest.mark.parametrize("title,module,path", COMMANDS, ids=[c[0] for c in COMMANDS])
def test_every_flag_reads_its_environment_variable(title, module, path, monkeypatch):
    options = _options(_parser(module, path))
    expected = {}
    for action in options:
        raw, value = _env_value(action)
        monkeypatch.setenv(action.env_var, raw)
        expected[action.dest] = value
    args = _parser(module, path).parse_args([])  # required flags are satisfied by their variables
    for dest, value in expected.items():
        assert getattr(args, dest) == value, f"{title}: {dest}"


def test_command_line_beats_environment(monkeypatch):
    monkeypatch.setenv("TANDEM_NUM_SPECULATIVE_TOKENS", "9")
    parse = importlib.import_module("workers.target.__main__").parse_args
    assert parse([]).num_speculative_tokens == 9
    assert parse(["--num-speculative-tokens", "3"]).num_speculative_tokens == 3


def test_canonical_names_and_old_aliases():
    draft = importlib.import_module("workers.draft.__main__").parse_args
    mock = importlib.import_module("workers.mock").parse_args
    router = importlib.import_module("router.__main__").parse_args
    assert draft(["--served-model-name", "m"]).model_name == draft(["--model-name", "m"]).model_name == ["m"]
    for retired in ("--num-speculative-tokens", "--max-speculative-tokens"):  # γ is the target's: the draft's cap
        with pytest.raises(SystemExit):                                       # is max_num_speculative_tokens
            draft([retired, "5"])
    assert draft(["--draft-method", "suffix"]).method == draft(["--method", "suffix"]).method == "suffix"
    assert mock(["--served-model-name", "m"]).model_name == mock(["--model-name", "m"]).model_name == ["m"]
    assert mock(["--served-model-name", "a", "b"]).model_name == ["a", "b"]
    assert mock(["--max-model-len", "64"]).context_length == mock(["--context-length", "64"]).context_length == 64
    assert router(["--router-mode", "random"]).mode == router(["--mode", "random"]).mode == "random"


@pytest.mark.parametrize("name,raw", [("TANDEM_BLOCK_SIZE", "sixteen"), ("TANDEM_ROUTER_MODE", "fastest"),
                                      ("TANDEM_REMOTE_ROUTER", "maybe")])
def test_bad_environment_value_is_a_clear_error(name, raw, monkeypatch, capsys):
    monkeypatch.setenv(name, raw)
    module = "router.__main__" if name == "TANDEM_BLOCK_SIZE" else "frontend.__main__"
    with pytest.raises(SystemExit) as exc:
        importlib.import_module(module).build_parser()
    assert exc.value.code == 2
    assert f"{name}={raw!r}" in capsys.readouterr().err


def test_helper_on_a_parser_with_groups_and_sub_commands(capsys):
    parser = EnvParser(prog="p")
    parser.add_argument("--max-tokens", type=int, default=16, help="tokens")
    parser.add_argument_group("g").add_argument("--fast", action="store_true", help="go fast")
    sub = parser.add_subparsers(dest="cmd").add_parser("run")
    sub.add_argument("--tag", action="append", help="tags")
    apply_env_defaults(parser, {"TANDEM_MAX_TOKENS": "32", "TANDEM_FAST": "1", "TANDEM_TAG": "a,b"})
    args = parser.parse_args(["run"])
    assert (args.max_tokens, args.fast, args.tag) == (32, True, ["a", "b"])
    assert "TANDEM_MAX_TOKENS" in parser.format_help() and "TANDEM_TAG" in sub.format_help()
    with pytest.raises(SystemExit):
        parser.parse_args(["--max-tokens", "x"])
    assert capsys.readouterr().err.strip().endswith("(see p --help)")  # one line, no usage block


def test_a_plain_argparse_parser_is_refused():
    with pytest.raises(TypeError, match="EnvParser"):
        apply_env_defaults(argparse.ArgumentParser())


def test_tandem_up_uses_etcd_and_nats_from_the_environment(monkeypatch):
    from deploy.cli import build_parser

    monkeypatch.setenv("TANDEM_ETCD", "http://10.0.0.1:2379")
    monkeypatch.setenv("TANDEM_NATS", "nats://10.0.0.1:4222")
    args = build_parser().parse_args(["up", "--mock"])
    assert (args.etcd, args.nats) == ("http://10.0.0.1:2379", "nats://10.0.0.1:4222")


def test_tandem_up_starts_no_etcd_or_nats_when_given_them(monkeypatch):
    from deploy import launcher
    from deploy.stack import StackConfig

    started = []
    monkeypatch.setattr(launcher, "etcd_child", lambda *a, **k: started.append("etcd"))
    monkeypatch.setattr(launcher, "nats_child", lambda *a, **k: started.append("nats"))
    options = launcher.LocalOptions(etcd_url="http://10.0.0.1:2379", nats_url="nats://10.0.0.1:4222")
    urls = launcher.Launcher(StackConfig(mock=True), options)._start_infra()
    assert urls == ("http://10.0.0.1:2379", "nats://10.0.0.1:4222") and started == []
