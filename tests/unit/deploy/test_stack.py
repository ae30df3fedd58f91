"""The launcher's plan: config validation, which components start with which flags, the CLI's flags."""

from __future__ import annotations

import json

import pytest

from deploy.cli import build_parser, stack_config
from deploy.stack import StackConfig, component_names, plan

pytestmark = pytest.mark.unit


def ports_for(config: StackConfig) -> dict[str, int]:
    return {name: 9000 + i for i, name in enumerate(component_names(config))}


@pytest.mark.parametrize("kwargs,message", [
    ({"draft_method": "lookahead"}, "draft_method"),
    ({"draft_method": "medusa", "model": "/m"}, "--draft-model PATH \\(a draft head directory\\)"),
    ({"router_mode": "kv2"}, "router_mode"),
    ({"targets": 0}, "targets"),
    ({"drafts": -1}, "drafts"),
    ({"num_speculative_tokens": -2}, "num_speculative_tokens"),
    ({"http_port": 70000}, "http_port"),
    ({"mock_token_latency_ms": 5.0}, "only applies with --mock"),
    ({"mock": True, "mock_token_latency_ms": -1.0}, "mock_token_latency_ms"),
    ({"draft_method": "draft_model"}, "--draft-model"),
    ({"draft_method": "eagle", "drafts": 2}, "--draft-model"),
    ({"model": "/m", "draft_method": "eagle3"}, "--draft-model PATH \\(a draft head directory\\)"),
    ({"draft_method": "ngram", "draft_model": "/h"}, "--draft-model applies to"),
    ({"draft_method": "suffix", "draft_model": "/h"}, "not --draft-method suffix"),
    ({"draft_method": "none", "drafts": 1}, "--draft-method none"),
    ({"mock": True, "drafts": 1}, "no draft workers"),
    ({"draft_device": "gpu"}, "--draft-device"),
    ({"draft_device": "cuda:x"}, "--draft-device"),
    ({"draft_dtype": "int8"}, "--draft-dtype"),
])
def test_bad_configs_raise_value_error_naming_the_problem(kwargs, message):
    with pytest.raises(ValueError, match=message):
        StackConfig(**kwargs)


def test_draft_defaults():
    from workers.demo_model import demo_head_dir

    demo = StackConfig()  # the demo model speculates with its bundled EAGLE-3 head
    assert (demo.draft_method, demo.draft_model, demo.num_drafts) == ("eagle3", str(demo_head_dir()), 1)
    assert StackConfig(draft_method="eagle3").draft_model == str(demo_head_dir())
    assert StackConfig(draft_method="ngram").draft_model is None
    other = StackConfig(model="/m")  # no head for other models: prompt lookup
    assert (other.draft_method, other.draft_model) == ("ngram", None)
    assert StackConfig(mock=True).draft_method == "ngram"
    assert StackConfig(mock=True).num_drafts == 0
    assert StackConfig(draft_method="none").num_drafts == 0
    assert StackConfig(draft_method="eagle", drafts=0).num_drafts == 0  # no drafts: no head needed
    assert StackConfig(drafts=3).num_drafts == 3


def test_model_names():
    assert StackConfig(mock=True).model_name(None) == "mock"
    assert StackConfig().model_name("/cache/smollm2") == "SmolLM2-135M-Instruct"  # the bundled demo
    assert StackConfig(model="/models/Llama-3.1-8B/").model_name("/models/Llama-3.1-8B/") == "Llama-3.1-8B"
    assert StackConfig(model="/m", served_model_name="llama").model_name("/m") == "llama"


def test_mock_plan():
    cfg = StackConfig(mock=True, targets=2, mock_token_latency_ms=0, num_speculative_tokens=3)
    ports = ports_for(cfg)
    comps = plan(cfg, None, ports)
    assert [c.name for c in comps] == ["target-0", "target-1", "frontend"]
    t0 = comps[0]
    assert t0.module == "workers.mock" and not t0.gpu
    assert t0.argv("py") == ["py", "-m", "workers.mock", "--served-model-name", "mock", "--health-port", str(ports["target-0"]),
                             "--token-latency-ms", "0", "--num-speculative-tokens", "3", "--drain-timeout", "30"]
    assert comps[-1].args == ("--http-port", str(ports["frontend"]), "--host", "127.0.0.1", "--router-mode", "kv",
                              "--drain-timeout", "30")
    assert comps[-1].health_port == ports["frontend"]
    assert plan(cfg, None, ports, http_fd=7)[-1].args[-4:] == ("--http-fd", "7", "--drain-timeout", "30")


def test_real_plan_with_router_targets_and_drafts():
    cfg = StackConfig(model="/m/target", draft_method="draft_model", draft_model="/m/draft", drafts=2,
                      router_mode="round_robin", standalone_router=True, num_speculative_tokens=5)
    comps = plan(cfg, "/m/target", ports_for(cfg))
    assert [c.name for c in comps] == ["router", "draft-0", "draft-1", "target-0", "frontend"]
    router, draft, target = comps[0], comps[1], comps[3]
    assert router.args[2:4] == ("--router-mode", "round_robin")
    assert target.module == "workers.target" and target.gpu
    assert target.args[:4] == ("--model", "/m/target", "--served-model-name", "target")
    assert draft.module == "workers.draft" and draft.gpu
    args = list(draft.args)
    assert args[args.index("--draft-method") + 1] == "draft_model" and args[args.index("--draft-model") + 1] == "/m/draft"
    assert "--num-speculative-tokens" not in args  # γ is the target's; the draft drafts what a round asks
    assert target.args[target.args.index("--num-speculative-tokens") + 1] == "5"
    assert args[args.index("--served-model-name") + 1] == "target"
    assert len({c.health_port for c in comps}) == len(comps)


def test_tree_flags_reach_the_draft_workers():
    cfg = StackConfig(model="/m/target", draft_method="eagle3", draft_model="/m/head", num_speculative_tokens=8,
                      speculative_eagle_topk=4, speculative_num_steps=3)
    for worker in plan(cfg, "/m/target", ports_for(cfg)):
        if worker.kind in ("draft", "target"):  # one --speculative-config, each worker reading its keys
            args = list(worker.args)
            keys = json.loads(args[args.index("--speculative-config") + 1])
            assert (keys["eagle_topk"], keys["num_steps"]) == (4, 3)
    with pytest.raises(ValueError, match="speculative_eagle_topk"):
        StackConfig(speculative_eagle_topk=0)


def test_no_model_path_leaves_the_target_on_its_default_model():
    cfg = StackConfig(drafts=0)
    [target, _] = plan(cfg, None, ports_for(cfg))
    assert "--model" not in target.args and target.args[:2] == ("--served-model-name", "SmolLM2-135M-Instruct")


@pytest.mark.parametrize("method", ["eagle3", "eagle"])
def test_head_methods_get_the_head_and_the_target(method):
    """EAGLE heads read the target's embedding and LM head: the draft gets both paths."""
    cfg = StackConfig(model="/m/target", draft_method=method, draft_model="/h")
    draft = next(c for c in plan(cfg, "/m/target", ports_for(cfg)) if c.kind == "draft")
    args = list(draft.args)
    assert args[args.index("--draft-method") + 1] == method
    assert args[args.index("--eagle-model") + 1] == "/h" and args[args.index("--target-model") + 1] == "/m/target"
    assert "--draft-model" not in args


@pytest.mark.parametrize("method,placed", [("eagle3", True), ("medusa", True), ("draft_model", True),
                                           ("ngram", False), ("suffix", False)])
def test_model_based_drafts_are_placed_on_the_device_asked_for(method, placed):
    """Draft workers get --device/--dtype when they have a model to place (auto: the GPU when one is
    visible, bfloat16 there)."""
    head = method not in ("ngram", "suffix")
    cfg = StackConfig(model="/m/target", draft_method=method, draft_model="/h" if head else None,
                      draft_device="cuda:1", draft_dtype="float16")
    draft = next(c for c in plan(cfg, "/m/target", ports_for(cfg)) if c.kind == "draft")
    args = list(draft.args)
    if placed:
        assert args[args.index("--device") + 1] == "cuda:1" and args[args.index("--dtype") + 1] == "float16"
    else:
        assert "--device" not in args and "--dtype" not in args
    default = StackConfig()  # the demo: EAGLE-3
    draft = next(c for c in plan(default, None, ports_for(default)) if c.kind == "draft")
    assert draft.args[draft.args.index("--device") + 1] == "auto"
    cli = stack_config(build_parser().parse_args(["up", "--draft-device", "cpu", "--draft-dtype", "bfloat16"]))
    assert (cli.draft_device, cli.draft_dtype) == ("cpu", "bfloat16")


def test_ray_drafts_take_the_gpu_their_actor_reserves():
    from deploy.ray_launcher import RayOptions, draft_placement

    options = RayOptions(etcd_url="http://e:2379", nats_url="nats://n:4222")
    assert draft_placement(StackConfig(), options).draft_device == "cuda"
    assert draft_placement(StackConfig(draft_device="cpu"), options).draft_device == "cpu"  # asked for
    no_gpus = RayOptions(etcd_url="http://e:2379", nats_url="nats://n:4222", gpus_per_worker=0)
    assert draft_placement(StackConfig(), no_gpus).draft_device == "auto"


def test_cli_flags_and_defaults():
    args = build_parser().parse_args(["up"])
    cfg = stack_config(args)
    assert (cfg.http_port, cfg.draft_method, cfg.router_mode, cfg.targets, cfg.mock, cfg.model) == \
        (8000, "eagle3", "kv", 1, False, None)
    args = build_parser().parse_args([
        "up", "--model", "/m", "--served-model-name", "n", "--draft-method", "eagle", "--draft-model", "/h",
        "--num-speculative-tokens", "4", "--targets", "2", "--drafts", "3", "--router-mode", "random",
        "--http-port", "9000", "--etcd-port", "1234", "--nats-port", "1235"])
    cfg = stack_config(args)
    assert (cfg.model, cfg.served_model_name, cfg.draft_method, cfg.draft_model, cfg.num_speculative_tokens,
            cfg.targets, cfg.drafts, cfg.router_mode, cfg.http_port) == ("/m", "n", "eagle", "/h", 4, 2, 3, "random", 9000)
    assert (args.etcd_port, args.nats_port) == (1234, 1235)
    mock = stack_config(build_parser().parse_args(["up", "--mock", "--mock-token-latency-ms", "0"]))
    assert mock.mock and mock.mock_token_latency_ms == 0


def test_ray_up_needs_etcd_and_nats(monkeypatch):
    monkeypatch.delenv("TANDEM_ETCD", raising=False)
    monkeypatch.delenv("TANDEM_NATS", raising=False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["ray", "up", "--mock"])
    args = build_parser().parse_args(["ray", "up", "--mock", "--etcd", "http://e:2379", "--nats", "nats://n:4222"])
    assert (args.address, args.gpus_per_worker) == ("auto", 1.0)


@pytest.mark.parametrize("kwargs,message", [
    ({"etcd_url": "127.0.0.1:2379"}, "etcd_url"),
    ({"nats_url": "http://n:4222"}, "nats_url"),
    ({"gpus_per_worker": -1}, ">= 0"),
    ({"startup_timeout": 0}, "startup_timeout"),
])
def test_ray_options_are_validated(kwargs, message):
    from deploy.ray_launcher import RayOptions

    with pytest.raises(ValueError, match=message):
        RayOptions(**kwargs)


@pytest.mark.parametrize("kwargs,message", [({"etcd_port": -1}, "etcd_port"), ({"startup_timeout": -5}, "startup_timeout")])
def test_local_options_are_validated(kwargs, message):
    from deploy.launcher import LocalOptions

    with pytest.raises(ValueError, match=message):
        LocalOptions(**kwargs)


def test_tandem_console_script_points_at_the_cli():
    from importlib.metadata import entry_points

    from deploy.cli import main

    [script] = entry_points(group="console_scripts", name="tandem")
    assert script.value == "deploy.cli:main" and script.load() is main
