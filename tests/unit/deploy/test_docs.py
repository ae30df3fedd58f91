"""The deployment docs say what the code does: the draft methods, how a target picks its draft (and that
it does: rendezvous hashing's spread and stability), the router's defaults, the compose example's
model reaching the workers, the tools that exist, no JetStream, no paths outside the repository."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from tests.unit.deploy.test_compose import COMPOSE, _interpolate
from workers.speculation.methods import METHODS

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
    from runtime.messages import InstanceRecord
    from workers.target.draft_pool import rendezvous_choice

    def draft(i: int) -> InstanceRecord:
        return InstanceRecord(instance_id=f"draft-{i}", namespace="t", component="draft", endpoint="speculate", subject="")

    targets = [f"target-{i}" for i in range(400)]
    four = {t: rendezvous_choice(t, [draft(i) for i in range(4)]).instance_id for t in targets}
    five = {t: rendezvous_choice(t, [draft(i) for i in range(5)]).instance_id for t in targets}
    assert all(70 <= list(four.values()).count(f"draft-{i}") <= 130 for i in range(4))  # even spread (~100 each)
    moved = {t for t in targets if four[t] != five[t]}
    assert all(five[t] == "draft-4" for t in moved) and 50 <= len(moved) <= 110  # only to the new draft, ~1/5
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
    # The example's own .env line, read as compose reads deploy/.env, sets the model the workers load.
    text = DEPLOYMENT.read_text()
    assert not re.search(r"TANDEM_MODEL=\S+ .*\\\n\s*docker compose|TANDEM_MODEL=\S+ docker compose", text)
    [printf] = re.findall(r"^printf '([^']*)' > \.env$", text, re.MULTILINE)
    dotenv = dict(line.split("=", 1) for line in printf.split("\\n") if line)
    target = _interpolate(yaml.safe_load(COMPOSE.read_text())["services"]["target"], dotenv)
    assert f"--model={dotenv['TANDEM_MODEL']}" in target["command"]


COMPLETION_ROUTES = ("/v1/chat/completions", "/v1/completions", "/v1/responses")


def test_every_doc_curl_to_a_completion_is_bounded():
    """A chat completion without max_tokens may run to the end of the context (minutes on a CPU): every
    curl the docs show against a completion route sets a bound."""
    found = 0
    for doc in [ROOT / "README.md", *DOCS]:
        # a command with its continuation lines (ending in a backslash)
        for command in re.findall(r"^\s*curl .*?(?:\\\n.*?)*$", doc.read_text(), re.MULTILINE):
            if any(route in command for route in COMPLETION_ROUTES):
                found += 1
                assert re.search(r'"max_(?:completion_|output_)?tokens"', command), f"{doc.name}: unbounded: {command}"
    assert found  # the README's quickstart at least


def test_the_lora_recipe_in_models_md_makes_a_random_adapter(tmp_path, monkeypatch):
    """docs/models.md's six lines, run as written (from the repository root, saving in a scratch
    directory): a PEFT adapter whose B matrices are not zero, so it changes the model's answers."""
    from workers.engine.lora import read_peft_adapter

    text = (ROOT / "docs" / "models.md").read_text()
    [recipe] = re.findall(r"A test adapter for the demo model.*?```python\n(.*?)```", text, re.DOTALL)
    assert len(recipe.strip().splitlines()) <= 6 and 'save_pretrained("my-adapter")' in recipe
    monkeypatch.chdir(ROOT)
    exec(recipe.replace('"my-adapter"', repr(str(tmp_path / "my-adapter"))), {})
    config, weights = read_peft_adapter(tmp_path / "my-adapter")
    assert config["r"] == 8 and sorted(config["target_modules"]) == ["q_proj", "v_proj"]
    b = [w for name, w in weights.items() if "lora_B" in name]
    assert b and all(w.abs().sum() > 0 for w in b)
