"""What ``tandem up --planner`` / ``--prefill-workers`` plan, and what the launcher refuses to scale."""

from __future__ import annotations

import pytest

from deploy.cli import build_parser, stack_config
from deploy.launcher import Launcher
from deploy.stack import StackConfig, component_names, plan, worker_component
from planner.__main__ import parse_args as planner_args, planner_config
from planner.messages import ScaleRequest
from workers.target.__main__ import parse_args as target_args

pytestmark = pytest.mark.unit


def planned(cfg: StackConfig):
    ports = {n: 9000 + i for i, n in enumerate(component_names(cfg))}
    return {c.name: c for c in plan(cfg, cfg.model, ports)}, ports


def test_the_planner_component_gets_the_launcher_connector_the_frontend_and_the_users_flags_last():
    cfg = StackConfig(mock=True, targets=2, planner=True, planner_args=("--itl-p90", "40ms", "--max-targets", "6"))
    comps, ports = planned(cfg)
    assert list(comps)[-1] == "planner"
    args = planner_args(list(comps["planner"].args))
    config = planner_config(args)
    assert args.connector == "launcher" and config.frontends == (f"http://127.0.0.1:{ports['frontend']}",)
    assert config.bounds["target"].high == 6  # the user's flag wins over the stack's default of 4
    assert config.bounds["draft"].high == 0 and config.bounds["prefill"].high == 0  # a mock stack has neither


def test_prefill_workers_run_the_target_module_with_role_prefill_and_targets_become_decode():
    cfg = StackConfig(model="/m", drafts=1, draft_method="ngram", prefill_workers=2, planner=True,
                      planner_args=("--ttft-p90", "1s"))
    comps, _ = planned(cfg)
    for name, role in (("prefill-0", "prefill"), ("prefill-1", "prefill"), ("target-0", "decode")):
        args = target_args(list(comps[name].args))
        assert args.role == role and args.model == "/m", name
    config = planner_config(planner_args(list(comps["planner"].args)))
    assert config.bounds["prefill"].low == 1 and config.bounds["draft"].low == 1
    # a worker added later is planned exactly like the first ones
    extra = worker_component(cfg, "/m", "prefill", 5, 9999)
    assert extra.name == "prefill-5" and list(extra.args[-4:]) == ["--role", "prefill", "--drain-timeout", "30"]


def test_bad_stack_flags_are_one_clear_error():
    with pytest.raises(ValueError, match="mock worker has no prefill role"):
        StackConfig(mock=True, prefill_workers=1)
    with pytest.raises(ValueError, match="applies with --planner"):
        StackConfig(mock=True, planner_args=("--itl-p90", "1s"))
    args = build_parser().parse_args(["up", "--mock", "--planner", "--planner-args", "--itl-p90 40ms --max-targets 0"])
    with pytest.raises(ValueError, match="--planner-args: pool bounds"):
        stack_config(args)


@pytest.mark.parametrize("request_, error", [
    (ScaleRequest("gpu", 2), "unknown pool 'gpu'"),
    (ScaleRequest("draft", 2), "runs no draft workers"),
    (ScaleRequest("prefill", 1), "no prefill pool"),
    (ScaleRequest("target", 0), "at least one target"),
    (ScaleRequest("target", 500), "at most 64"),
])
def test_the_launcher_refuses_what_the_stack_cannot_do(request_, error):
    launcher = Launcher(StackConfig(mock=True, planner=True, planner_args=("--itl-p90", "1s")))
    reply = launcher.scale(request_)
    assert error in reply.error
    assert [(p.pool, p.replicas) for p in reply.pools] == [("prefill", 0), ("target", 0), ("draft", 0)]
