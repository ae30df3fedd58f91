"""Target flags that depend on each other or on the machine: ``--lora-modules`` gives itself slots,
``--gpu-memory-utilization`` is reported only where it sized the KV cache."""

from __future__ import annotations

import pytest

from workers.engine.engine import Engine, EngineConfig
from workers.target.__main__ import parse_args, target_config
from workers.target.flags import gpu_memory_utilization_ignored
from workers.target.metrics import TargetCollector
from workers.target.worker import TargetWorker

pytestmark = pytest.mark.unit


@pytest.fixture
def adapters(tmp_path):
    for name in ("a", "b", "c"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "adapter_config.json").write_text("{}")
    return tmp_path


@pytest.mark.parametrize("extra, slots", [([], 3), (["--max-loras", "1"], 1), (["--max-loras", "5"], 5)])
def test_lora_modules_imply_one_slot_per_adapter_unless_max_loras_says_otherwise(adapters, extra, slots):
    modules = [f"{n}={adapters / n}" for n in ("a", "b", "c")]
    cfg = target_config(parse_args(["--lora-modules", *modules, *extra]), adapters)
    assert cfg.lora.max_loras == slots and [name for name, _ in cfg.lora.modules] == ["a", "b", "c"]


def test_without_adapters_there_are_no_slots_unless_asked(adapters):
    assert target_config(parse_args([]), adapters).lora.max_loras == 0
    assert target_config(parse_args(["--max-loras", "2"]), adapters).lora.max_loras == 2  # for adapters loaded later


def test_lora_modules_with_max_loras_zero_is_refused(adapters):
    with pytest.raises(ValueError, match="--max-loras"):
        target_config(parse_args(["--lora-modules", f"a={adapters / 'a'}", "--max-loras", "0"]), adapters)


def test_gpu_memory_utilization_is_ignored_on_a_cpu_and_under_num_blocks():
    assert gpu_memory_utilization_ignored(None, "cpu", None) is None
    assert gpu_memory_utilization_ignored(0.5, "cuda", None) is None  # in force
    assert "on a CPU" in gpu_memory_utilization_ignored(0.5, "cpu", None)
    assert "--num-blocks 64" in gpu_memory_utilization_ignored(0.5, "cuda", 64)


def config_labels(engine: Engine) -> dict[str, dict[str, str]]:
    worker = TargetWorker(engine, "w1", None, "tiny")
    return {m.name: m.samples[0].labels for m in TargetCollector(worker, "tiny").collect()
            if m.name in ("tandem_target_engine_config", "vllm:cache_config_info")}


@pytest.mark.parametrize("num_blocks", [None, 64])
def test_metrics_do_not_report_a_gpu_memory_utilization_that_did_nothing(model, num_blocks):
    """On this CPU the flag sizes nothing, so neither config metric may say it is in force."""
    engine = Engine(model, EngineConfig(num_blocks=num_blocks, kv_cache_bytes=1 << 20, gpu_memory_utilization=0.5))
    assert engine.runner.device.type == "cpu"
    labels = config_labels(engine)
    assert set(labels) == {"tandem_target_engine_config", "vllm:cache_config_info"}
    assert all(found["gpu_memory_utilization"] == "" for found in labels.values())


def test_on_cuda_without_num_blocks_the_metrics_report_it_in_force():
    from types import SimpleNamespace

    from workers.target.metrics import utilization_in_force

    def engine(device: str, num_blocks: int | None, given: float | None = 0.5):
        return SimpleNamespace(config=SimpleNamespace(gpu_memory_utilization=given, num_blocks=num_blocks),
                               runner=SimpleNamespace(device=SimpleNamespace(type=device)))

    assert utilization_in_force(engine("cuda", None)) == "0.5"
    assert utilization_in_force(engine("cuda", 64)) == utilization_in_force(engine("cpu", None)) == ""
    assert utilization_in_force(engine("cuda", None, None)) == ""


def test_a_retired_flag_and_its_variable_stop_the_worker_but_the_load_interval_variable_is_read(monkeypatch, capsys):
    from runtime.config import load_interval

    with pytest.raises(SystemExit):
        parse_args(["--spec-seam", "sync"])
    assert "--spec-seam was retired: use --speculative-config '{\"seam\": \"sync\"}'" in capsys.readouterr().err
    monkeypatch.setenv("TANDEM_HIDDEN_PLANE", "shm")
    with pytest.raises(SystemExit):
        parse_args([])
    assert "TANDEM_HIDDEN_PLANE (--hidden-plane) was retired" in capsys.readouterr().err
    monkeypatch.delenv("TANDEM_HIDDEN_PLANE")
    monkeypatch.setenv("TANDEM_LOAD_INTERVAL", "0.2")  # --load-interval's new home: read, not refused
    parse_args([])
    assert load_interval() == 0.2
    monkeypatch.setenv("TANDEM_NO_LOAD_AWARE_SPECULATION", "1")  # tandem up's flag, in a shared environment
    parse_args([])
