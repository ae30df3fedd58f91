"""The docs speak the current flags: every ``--speculative-config`` key is documented in
docs/speculative.md, and no doc uses a flag that was retired into a JSON-valued flag (commit 11deaa7:
the target's and the draft's ``RETIRED_FLAGS``, the runtime's ``RETIRED_RUNTIME_FLAGS``).

docs/benchmarks.md is left out on purpose: it records the command lines each measurement was taken
with, and says near its top how the retired spellings map to the new ones."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from runtime.config import RETIRED_RUNTIME_FLAGS
from workers.speculation.spec_config import SpeculativeConfig

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
SPECULATIVE = ROOT / "docs" / "speculative.md"
# every doc but the historical record (docs/gpu/ holds GPU run logs: not matched by the glob)
DOCS = [p for p in sorted((ROOT / "docs").glob("*.md")) if p.name != "benchmarks.md"] + [
    ROOT / "README.md", ROOT / "k8s" / "README.md"]
# retired on a worker but still flags elsewhere: tandem up's (and the target's γ, the mock's)
STILL_FLAGS = {"--num-speculative-tokens", "--speculative-eagle-topk", "--speculative-num-steps",
               "--no-load-aware-speculation"}


def retired_flags() -> set[str]:
    from workers.draft.__main__ import RETIRED_FLAGS as DRAFT_RETIRED
    from workers.target.__main__ import LOAD_INTERVAL_RETIRED
    from workers.target.__main__ import RETIRED_FLAGS as TARGET_RETIRED

    every = set(TARGET_RETIRED) | set(LOAD_INTERVAL_RETIRED) | set(DRAFT_RETIRED) | set(RETIRED_RUNTIME_FLAGS)
    return every - STILL_FLAGS


def test_every_speculative_config_key_is_in_the_speculative_docs():
    text = SPECULATIVE.read_text()
    missing = [key for key in SpeculativeConfig.model_fields if f"`{key}`" not in text]
    assert not missing, f"docs/speculative.md does not document {missing}"


def test_the_still_valid_flags_are_still_flags():
    """STILL_FLAGS lists only flags some parser still takes (else they belong in the check below)."""
    from deploy.cli import build_parser

    taken = {s for action in build_parser().subcommands["up"].options for s in action.option_strings}
    assert STILL_FLAGS <= taken


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_doc_uses_a_retired_flag(doc):
    flags = sorted(retired_flags(), key=len, reverse=True)
    # a whole flag: not inside a longer one (--hidden-layers is not --hidden-layers-x, nor x--hidden-layers)
    pattern = re.compile(r"(?<![\w-])(" + "|".join(map(re.escape, flags)) + r")(?![\w-])")
    hits = [f"{doc.name}:{n}: {m.group(1)}" for n, line in enumerate(doc.read_text().splitlines(), 1)
            for m in pattern.finditer(line)]
    assert not hits, "retired flags (see the RETIRED_FLAGS tables for their keys):\n" + "\n".join(hits)
