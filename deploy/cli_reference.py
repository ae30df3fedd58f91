"""docs/cli.md, generated from the argument parsers themselves (a test keeps the file current).

Usage: python -m deploy.cli_reference [--check]   (writes docs/cli.md; --check fails if it is stale)
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"

# (title, module with build_parser(), sub-command path within it)
COMMANDS = (
    ("tandem up", "deploy.cli", ("up",)),
    ("tandem train-draft", "deploy.cli", ("train-draft",)),
    ("tandem ray up", "deploy.cli", ("ray", "up")),
    ("python -m frontend", "frontend.__main__", ()),
    ("python -m router", "router.__main__", ()),
    ("python -m workers.target", "workers.target.__main__", ()),
    ("python -m workers.draft", "workers.draft.__main__", ()),
    ("python -m workers.mock", "workers.mock", ()),
)


def _sub(parser: argparse.ArgumentParser, path: tuple[str, ...]) -> argparse.ArgumentParser:
    for name in path:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser


def _row(action: argparse.Action) -> str | None:
    if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
        return None
    flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.dest}` (positional)"
    if action.choices:
        flags += " {" + ",".join(map(str, action.choices)) + "}"
    default = "" if action.default in (None, argparse.SUPPRESS, False) or isinstance(
        action, argparse._StoreTrueAction) else f"`{action.default}`"
    if action.help == argparse.SUPPRESS:
        return None
    text = getattr(action, "plain_help", action.help) or ""
    text = text.replace("%%", "%").replace("|", "\\|").replace("\n", " ")
    env = f"`{action.env_var}`" if getattr(action, "env_var", None) else ""
    return f"| {flags} | {default} | {env} | {text} |"


def render() -> str:
    """The reference as the parsers build it with no ``TANDEM_*`` variable set (defaults some read)."""
    saved = {k: os.environ.pop(k) for k in [k for k in os.environ if k.startswith("TANDEM_")]}
    try:
        return _render()
    finally:
        os.environ.update(saved)


def _render() -> str:
    lines = ["# Command-line reference", "",
             "Generated from the parsers by `python -m deploy.cli_reference`; "
             "`tests/unit/deploy/test_cli_reference.py` fails when it is stale.",
             "Every flag also reads the environment variable in its `env` column (`TANDEM_` and the flag's name); "
             "a flag on the command line wins. See [configuration.md](configuration.md).", ""]
    for title, module, path in COMMANDS:
        parser = _sub(importlib.import_module(module).build_parser(), path)
        lines += [f"## `{title}`", ""]
        if parser.description:
            lines += [parser.description.strip().split("\n")[0], ""]
        lines += ["| flag | default | env | what |", "|---|---|---|---|"]
        lines += [row for row in map(_row, parser._actions) if row]
        lines.append("")
    return "\n".join(lines)


def main() -> None:
    text = render()
    if "--check" in sys.argv[1:]:
        if not DOC.exists() or DOC.read_text() != text:
            sys.exit("docs/cli.md is stale: run python -m deploy.cli_reference")
        return
    DOC.write_text(text)
    print(f"wrote {DOC.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
