"""``tandem up --draft-kinds``: the flag's parsing, the commands built for each kind, and which kind the
launcher adds or stops when a planner resizes the draft pool."""

from __future__ import annotations

import itertools
from collections import Counter
from pathlib import Path

import pytest

import deploy.launcher as launcher_module
from deploy.cli import build_parser, stack_config
from deploy.draft_kinds import DraftKind, format_draft_kinds, kind_to_add, parse_draft_kinds, pick_victims
from deploy.launcher import Launcher
from deploy.stack import StackConfig, component_names, plan
from planner.__main__ import parse_args as planner_args, planner_config
from planner.messages import ScaleRequest
from workers.draft.__main__ import draft_config, parse_args as draft_args
from workers.target.__main__ import build_parser as target_parser
from workers.target.__main__ import target_config

pytestmark = pytest.mark.unit

HERE = str(Path(__file__).parent)  # a directory that exists, for head and model paths


def up(*argv: str) -> StackConfig:
    return stack_config(build_parser().parse_args(["up", *argv]))


def components(config: StackConfig) -> dict:
    ports = {name: 1000 + i for i, name in enumerate(component_names(config))}
    ports["frontend"] = 8000
    return {c.name: c for c in plan(config, HERE, ports)}


# --- the flag --------------------------------------------------------------------------------------


def test_kinds_parse_with_paths_and_counts_and_print_back():
    kinds = parse_draft_kinds("suffix:1, eagle3=/heads/a:2,ngram")
    assert kinds == (DraftKind("suffix"), DraftKind("eagle3", "/heads/a", 2), DraftKind("ngram"))
    assert [k.label for k in kinds] == ["suffix", "eagle3=/heads/a", "ngram"]
    assert parse_draft_kinds(format_draft_kinds(kinds)) == kinds
    # a ':' inside a path is the path's, not a count
    assert parse_draft_kinds("eagle3=C:/heads/a") == (DraftKind("eagle3", "C:/heads/a"),)
    assert parse_draft_kinds("eagle3=C:/heads/a:3") == (DraftKind("eagle3", "C:/heads/a", 3),)


@pytest.mark.parametrize("text, message", [
    ("lookahead:1", "method must be one of"),
    ("suffix:0", "count of at least 1"),
    ("suffix=/x:1", "suffix takes no model"),
    ("eagle3=:1", "needs a path"),
    ("suffix:1,,ngram", "an empty kind"),
    ("suffix:1,suffix:2", "suffix named twice"),
])
def test_bad_kinds_are_one_clear_error(text, message):
    with pytest.raises(ValueError, match=message):
        parse_draft_kinds(text)


@pytest.mark.parametrize("argv, message", [
    (["--draft-kinds", "suffix:1", "--drafts", "2"], "drop --draft-method, --draft-model and --drafts"),
    (["--draft-kinds", "suffix:1", "--draft-method", "ngram"], "drop --draft-method"),
    (["--draft-kinds", "suffix:1", "--speculative-config", '{"method": "ngram"}'], "drop --draft-method"),
    (["--mock", "--draft-kinds", "suffix:1"], "--mock runs no draft workers"),
    (["--model", "/m", "--draft-kinds", "suffix:1,eagle3:1"], "eagle3 needs a draft head directory"),
    (["--model", "/m", "--draft-kinds", "ngram:1,eagle3=/h:1", "--speculative-config",
      '{"suffix_decoding_max_tree_depth": 8}'], "no --draft-kinds kind is suffix"),
])
def test_kinds_and_the_one_kind_flags_do_not_mix(argv, message):
    with pytest.raises(ValueError, match=message):
        up(*argv)


# --- the commands built ----------------------------------------------------------------------------


def test_each_draft_worker_gets_its_kinds_method_path_and_keys():
    config = up("--model", HERE, "--draft-kinds", f"suffix:1,eagle3={HERE}:2", "--speculative-config",
                '{"suffix_decoding_max_tree_depth": 8, "num_speculative_tokens": 3}')
    assert (config.num_drafts, config.draft_method) == (3, "suffix")
    comps = components(config)
    assert [n for n in comps if n.startswith("draft")] == ["draft-0", "draft-1", "draft-2"]
    suffix = draft_config(draft_args(list(comps["draft-0"].args)))
    assert (suffix.method, suffix.spec.suffix_decoding_max_tree_depth) == ("suffix", 8)
    assert comps["draft-0"].draft_kind == "suffix" and "--eagle-model" not in comps["draft-0"].args
    for name in ("draft-1", "draft-2"):
        head = draft_config(draft_args(list(comps[name].args)))
        assert (head.method, head.eagle_model, head.target_model) == ("eagle3", HERE, HERE)
        assert "suffix_decoding_max_tree_depth" not in " ".join(comps[name].args)  # the suffix kind's key only
        assert comps[name].draft_kind == f"eagle3={HERE}"
    # the targets keep hidden states: one kind of this stack reads them
    target = target_config(target_parser().parse_args(list(comps["target-0"].args)), Path(HERE))
    assert target.spec.hidden_layers == "auto" and target.spec.num_speculative_tokens == 3
    # stacks of kinds that read none keep none, as with one kind
    plain = components(up("--model", HERE, "--draft-kinds", "suffix:1,ngram:1"))
    assert '"hidden_layers": "none"' in " ".join(plain["target-0"].args)


def test_an_eagle3_kind_without_a_path_runs_the_demo_models_bundled_head():
    from workers.demo_model import demo_head_dir

    config = up("--draft-kinds", "suffix,eagle3")
    assert config.kinds == (DraftKind("suffix"), DraftKind("eagle3", str(demo_head_dir())))


def test_one_kind_stacks_are_planned_as_before():
    config = up("--model", HERE, "--draft-method", "ngram", "--drafts", "2")
    assert config.kinds == (DraftKind("ngram", None, 2),) and not config.draft_kinds
    assert [c.draft_kind for c in components(config).values() if c.kind == "draft"] == ["ngram", "ngram"]
    # a stack started without drafts can still be given some, of its method
    assert up("--model", HERE, "--draft-method", "ngram", "--drafts", "0").kinds == (DraftKind("ngram"),)
    assert up("--mock").kinds == () and up("--model", HERE, "--draft-method", "none").kinds == ()


def test_the_planner_of_a_stack_of_kinds_sizes_the_whole_draft_pool():
    config = up("--model", HERE, "--draft-kinds", "suffix:2,ngram:3", "--planner", "--planner-args", "--itl-p90 50ms")
    bounds = planner_config(planner_args(list(components(config)["planner"].args))).bounds["draft"]
    assert (bounds.low, bounds.high) == (1, 5)


# --- which kind a resized pool adds and stops ------------------------------------------------------


def test_the_kind_furthest_below_its_share_is_added_first_among_equals_the_first():
    kinds = (DraftKind("suffix"), DraftKind("eagle3", "/h", 2))
    running = Counter({"suffix": 1, "eagle3=/h": 2})
    added = []
    for _ in range(4):
        kind = kind_to_add(kinds, running)
        running[kind.label] += 1
        added.append(kind.method)
    assert added == ["suffix", "eagle3", "eagle3", "suffix"]  # 1:2 kept: 2:2, 2:3, 2:4, 3:4
    # a kind that lost its workers is made up first
    assert kind_to_add(kinds, Counter({"eagle3=/h": 2})).method == "suffix"
    assert kind_to_add(kinds, Counter({"suffix": 3})).method == "eagle3"


def test_victims_follow_the_planner_but_a_kinds_last_worker_goes_last():
    active = [("draft-0", "suffix"), ("draft-1", "eagle3"), ("draft-2", "eagle3"), ("draft-3", "suffix")]
    rank = {"draft-0": 0}.get
    assert pick_victims(active, 1, lambda n: rank(n, 9)) == ["draft-0"]
    # draft-3 is then the last suffix: an eagle3 draft goes next, the newest; with one left of four, a
    # kind's last must go too: the newest
    assert pick_victims(active, 2, lambda n: rank(n, 9)) == ["draft-0", "draft-2"]
    assert pick_victims(active, 3, lambda n: rank(n, 9)) == ["draft-0", "draft-2", "draft-3"]
    # without kinds (targets): the planner's order, then the newest
    plain = [("t-0", ""), ("t-1", ""), ("t-2", "")]
    assert pick_victims(plain, 2, lambda n: {"t-0": 0}.get(n, 9)) == ["t-0", "t-2"]


class _Child:
    """A child process that is never started (the launcher's bookkeeping is what is tested)."""

    pids = itertools.count(1000)

    def __init__(self, name, argv, env=None, **_):
        self.name, self.argv, self.pid, self.expected_exit = name, argv, next(self.pids), False

    def start(self):
        return self

    def alive(self):
        return not self.expected_exit


def test_the_launcher_adds_and_stops_drafts_by_kind(monkeypatch):
    monkeypatch.setattr(launcher_module, "Child", _Child)
    monkeypatch.setattr(launcher_module, "stop_tiers", lambda tiers, timeout: None)
    config = StackConfig(model=HERE, draft_kinds=(DraftKind("suffix"), DraftKind("eagle3", HERE, 2)), planner=True,
                         planner_args=("--itl-p90", "50ms"))
    launcher = Launcher(config)
    launcher._model_path = HERE
    launcher._components = plan(config, HERE, {n: 9000 + i for i, n in enumerate(component_names(config))})
    launcher._children = {c.name: _Child(c.name, c.argv()) for c in launcher._components}
    reply = launcher.scale(ScaleRequest("draft", 5))
    assert reply.started == ["draft-3", "draft-4"] and not reply.error
    methods = {c.name: draft_args(list(c.args)).method for c in launcher._components if c.kind == "draft"}
    assert methods == {"draft-0": "suffix", "draft-1": "eagle3", "draft-2": "eagle3", "draft-3": "suffix",
                       "draft-4": "eagle3"}
    # the planner would rather lose draft-0; then draft-3 is the last suffix and stays
    reply = launcher.scale(ScaleRequest("draft", 2, [launcher._children["draft-0"].pid]))
    assert reply.stopping == ["draft-0", "draft-4", "draft-2"]
    assert [(p.pool, p.replicas) for p in reply.pools if p.pool == "draft"] == [("draft", 2)]
