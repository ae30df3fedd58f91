"""The deployment docs say what the code does: the draft methods, how a target picks its draft, the
router's defaults, the tools that exist, no JetStream, no paths outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from workers.draft.methods import METHODS

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]
DEPLOYMENT = ROOT / "docs" / "deployment.md"
K8S_README = ROOT / "k8s" / "README.md"
# Hand-written docs (cli.md and configuration.md are generated from the parsers).
DOCS = sorted(p for p in (ROOT / "docs").glob("*.md") if p.name not in ("cli.md", "configuration.md")) + [K8S_README]


def test_the_draft_method_list_is_the_code_s():
    [listed] = re.findall(r"`--draft-method \{([a-z_,0-9]+)\}`", DEPLOYMENT.read_text())
    assert set(listed.split(",")) == set(METHODS) | {"none"}


def test_targets_pick_drafts_by_rendezvous_hashing_as_the_code_does():
    assert "Rendezvous hashing" in (ROOT / "workers" / "target" / "draft_client.py").read_text()
    for doc in (DEPLOYMENT, K8S_README):
        text = " ".join(doc.read_text().split())
        assert "rendezvous hashing" in text, doc.name
        assert not re.search(r"(chosen|picked) at random among|switches only when that draft goes away", text), doc.name


def test_the_router_mode_defaults_table_matches_the_parsers():
    import frontend.__main__ as frontend_main
    import router.__main__ as router_main
    from deploy.cli import build_parser

    table = dict(re.findall(r"^\| `([^`]+)`[^|]* \| `(kv|round_robin|random)`", DEPLOYMENT.read_text(), re.MULTILINE))
    assert table["python -m frontend"] == frontend_main.parse_args([]).router_mode
    assert table["python -m router"] == router_main.parse_args([]).mode
    assert table["tandem up"] == build_parser().parse_args(["up"]).router_mode


def test_every_entry_point_routes_kv_by_default():
    """One default everywhere: a frontend started by hand routes as the one `tandem up` starts."""
    import inspect

    import frontend.__main__ as frontend_main
    import router.__main__ as router_main
    from deploy.cli import build_parser
    from frontend.config import FrontendConfig
    from router.factory import create_router

    assert {frontend_main.parse_args([]).router_mode, router_main.parse_args([]).mode,
            build_parser().parse_args(["up"]).router_mode, FrontendConfig().router_mode,
            inspect.signature(create_router).parameters["mode"].default} == {"kv"}


def test_docs_name_tools_and_servers_as_installed():
    for doc in DOCS:
        text = doc.read_text()
        assert "huggingface-cli" not in text, f"{doc.name}: the installed hub ships `hf`"
        assert "jetstream" not in text.lower() or "no jetstream" in text.lower(), f"{doc.name}: no code uses JetStream"


def test_docs_cite_no_paths_outside_the_repository():
    for doc in DOCS:
        for line_no, line in enumerate(doc.read_text().splitlines(), 1):
            assert not re.search(r"(?<![\w.~$])/(work|root|tmp|home)/", line), f"{doc.name}:{line_no}: {line}"


def test_the_compose_example_keeps_the_model_across_commands():
    # A model set on one command line is gone on the next: `up --scale` then recreates the workers
    # with the default model. The docs put it in deploy/.env, which compose reads every time.
    text = DEPLOYMENT.read_text()
    assert not re.search(r"TANDEM_MODEL=\S+ .*\\\n\s*docker compose|TANDEM_MODEL=\S+ docker compose", text)
    assert ".env" in text
