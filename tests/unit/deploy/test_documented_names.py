"""Every flag the docs give one of our commands exists in that command's parser, and every metric
the docs name is one the code exports (a renamed or removed one fails here, not in a user's shell
or dashboard)."""

from __future__ import annotations

import ast
import functools
import re

import pytest

from deploy.cli_reference import COMMANDS, _sub
from tests.unit.deploy.test_docs import DOCS, ROOT

pytestmark = pytest.mark.unit

HAND_WRITTEN = [*DOCS, ROOT / "README.md"]
SOURCES = [p for d in ("runtime", "router", "workers", "frontend", "planner", "deploy") for p in (ROOT / d).rglob("*.py")]
# a command as the docs write it -> its parser (title as in deploy.cli_reference.COMMANDS)
COMMAND = re.compile(r"(?<![\w-])(?<!-p )(?<!--profile )(tandem ray up|tandem up|tandem train-draft|python -m (?:frontend|router|workers\.target|"
                     r"workers\.draft|workers\.mock|planner))\b")
TITLES = {"tandem up": "tandem up", "tandem ray up": "tandem ray up", "tandem train-draft": "tandem train-draft"}
METRIC = re.compile(r"\b((?:vllm:|tandem_|dynamo_frontend_)[a-z0-9_]+[a-z0-9])(_?\*|_\.\.\.|_(?![a-z0-9]))?")
SUFFIXES = ("_total", "_bucket", "_count", "_sum", "_created")


def _flags_by_command() -> dict[str, set[str]]:
    import importlib

    out = {}
    for title, module, path in COMMANDS:
        parser = _sub(importlib.import_module(module).build_parser(), path)
        out[title] = {s for a in parser.options for s in a.option_strings}
    return out


def _command_lines(text: str):
    """(command, the words given it) for each command written in a code span or block; a line that
    ends in a backslash goes on."""
    text = re.sub(r"\\\n\s*", " ", text)
    for span in re.findall(r"```[a-z]*\n(.*?)```|`([^`\n]+)`", text, re.DOTALL):
        for line in "".join(span).splitlines():
            for match in COMMAND.finditer(line):
                rest = re.sub(r"'[^']*'|\"[^\"]*\"", "VALUE", line[match.end():])  # --planner-args '--itl-p90 ..'
                rest = re.split(r"[|;&#)]|\s(?:then|and)\s", rest)[0]
                yield match.group(1), rest.split()


def test_every_flag_given_to_a_command_in_the_docs_is_one_it_takes():
    flags = _flags_by_command()
    missing = []
    for doc in HAND_WRITTEN:
        for command, words in _command_lines(doc.read_text()):
            title = TITLES.get(command, command)
            for word in words:
                if COMMAND.match(word):
                    break
                flag = word.split("=")[0].strip("'\",")
                if flag.startswith("--") and len(flag) > 2 and flag not in flags[title]:
                    missing.append(f"{doc.name}: `{command} ... {flag}`")
    assert not missing, "documented flags the command does not take:\n" + "\n".join(sorted(set(missing)))


@functools.cache
def _exported_names() -> frozenset[str]:
    """Metric family names the code can export: whole names written as string literals, and each
    prefix a metrics module builds names from (``P = "tandem_frontend_"``, ``f"tandem_target_{name}"``)
    joined with the plain names in that module."""
    names: set[str] = set()
    for path in SOURCES:
        tree = ast.parse(path.read_text())
        literals = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        prefixes = {s for s in literals if re.fullmatch(r"(vllm:|tandem_|dynamo_frontend_)[a-z0-9_]*[_:]?", s)}
        for node in ast.walk(tree):  # f"tandem_target_{name}"
            if isinstance(node, ast.JoinedStr) and node.values and isinstance(node.values[0], ast.Constant):
                head = node.values[0].value
                if isinstance(head, str) and re.fullmatch(r"(vllm:|tandem_[a-z_]*_|dynamo_frontend_)", head):
                    prefixes.add(head)
        names |= {s for s in prefixes if not s.endswith(("_", ":"))}
        plain = {s for s in literals if re.fullmatch(r"[a-z][a-z0-9_]*", s)}
        names |= {p + s for p in prefixes if p.endswith(("_", ":")) for s in plain}
    return frozenset(names)


def test_every_metric_the_docs_name_is_exported():
    exported = _exported_names()
    missing = []
    for doc in HAND_WRITTEN:
        for name, wildcard in set(METRIC.findall(doc.read_text())):
            if wildcard:  # a family written as a prefix ("tandem_target_*")
                continue
            stem = next((name[: -len(s)] for s in SUFFIXES if name.endswith(s)), name)
            if name not in exported and stem not in exported:
                missing.append(f"{doc.name}: {name}")
    assert not missing, "documented metrics no code exports:\n" + "\n".join(sorted(missing))


def test_the_checks_catch_a_made_up_flag_and_metric():
    lines = list(_command_lines("run `tandem up --max-model-len 2048 --no-such-flag` and\n```bash\n"
                                "python -m workers.target \\\n  --model m --dtype float32\n```"))
    assert lines == [("tandem up", ["--max-model-len", "2048", "--no-such-flag"]),
                     ("python -m workers.target", ["--model", "m", "--dtype", "float32"])]
    flags = _flags_by_command()
    assert "--no-such-flag" not in flags["tandem up"] and "--max-model-len" in flags["tandem up"]
    exported = _exported_names()
    assert {"vllm:request_success", "vllm:num_preemptions", "tandem_target_engine_config",
            "dynamo_frontend_requests", "tandem_frontend_ignored_fields"} <= exported
    assert "vllm:request_successes" not in exported
