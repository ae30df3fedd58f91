"""The target worker's configuration: one typed, nested, frozen model, built once with keywords from
the worker's flags (``workers/target/__main__.py``) and read by the engine's builder
(:func:`workers.engine.build.build_engine`) and the worker.

The flat fields are the engine's (model, cache, batch, kernels, parallelism); the groups are the
JSON-valued flags (vLLM's style): ``spec`` is ``--speculative-config`` (the one schema the draft and
``tandem up`` read too), ``kv_offload`` is ``--kv-offload-config``, ``kv_transfer`` is
``--kv-transfer-config``; ``lora`` gathers vLLM's three LoRA flags. Validation is pydantic's (field
constraints) plus the checks across fields below, each one line naming the flag or key at fault.
Light to import: pydantic only (the model's ``config.json`` is read, not loaded).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

from pydantic import Field, field_validator, model_validator

from runtime.settings import Group
from workers.speculation.spec_config import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")


class KvOffload(Group):
    """``--kv-offload-config``: KV cache tiers below the device pool (workers/engine/kv_tiers.py)."""

    host_gb: float = Field(0.0, ge=0)  # host memory (pinned on CUDA) for evicted blocks (0: no tiers)
    disk_dir: str | None = None  # a disk tier below the host tier: one checksummed file per block
    disk_gb: float = Field(16.0, gt=0)  # the most this worker keeps in disk_dir (oldest blocks go first)

    @model_validator(mode="after")
    def _disk_needs_host(self) -> KvOffload:
        if self.disk_dir and not self.host_gb:
            raise ValueError("'disk_dir' needs a host tier ('host_gb' > 0): disk blocks load through it")
        return self


class KvTransfer(Group):
    """``--kv-transfer-config``: prefill/decode disaggregation's timings (``--role`` picks the role)."""

    transfer_timeout: float = Field(5.0, gt=0)  # decode: the most seconds a KV pull may take, then prefill here
    handoff_ttl: float = Field(30.0, gt=0)  # prefill: seconds handed-off blocks wait for their decode worker

    @model_validator(mode="after")
    def _pull_before_reuse(self) -> KvTransfer:
        if self.transfer_timeout >= self.handoff_ttl:
            raise ValueError("'transfer_timeout' must be shorter than 'handoff_ttl' (a pull must end before the "
                             "prefill worker may reuse the blocks)")
        return self


class Lora(Group):
    """vLLM's LoRA flags: adapter slots in a batch, the largest rank, adapters loaded at start."""

    max_loras: int = Field(0, ge=0)
    max_lora_rank: int = Field(16, gt=0)
    modules: tuple[tuple[str, str], ...] = ()  # (name, path)

    @model_validator(mode="after")
    def _slots(self) -> Lora:
        if self.modules and not self.max_loras:
            raise ValueError("--lora-modules needs adapter slots: leave out --max-loras 0 (one slot per adapter is "
                             "the default) or give --max-loras N")
        for name, path in self.modules:
            if not name or not (Path(path) / "adapter_config.json").is_file():
                raise ValueError(f"--lora-modules {name}={path}: no adapter_config.json there")
        return self


class TargetConfig(Group):
    """Everything the target service needs besides the runtime flags."""

    model: str
    served_model_name: str = Field(min_length=1)
    served_model_aliases: tuple[str, ...] = ()  # more names clients may pass as "model" (the card lists them)
    # the KV cache
    block_size: int = Field(16, gt=0)
    num_blocks: int | None = Field(None, gt=0)
    kv_cache_gb: float = Field(1.0, gt=0)
    gpu_memory_utilization: float | None = Field(None, gt=0, le=1)  # CUDA: the device share (None: kv_cache_gb)
    enable_prefix_caching: bool = True
    # the batch
    max_num_seqs: int = Field(64, gt=0)
    max_num_batched_tokens: int = Field(512, gt=0)
    max_model_len: int | None = Field(None, gt=0)
    scheduling_policy: Literal["fcfs", "priority"] = "fcfs"  # vLLM's: priority = each request's field, lower first
    async_scheduling: bool = False  # launch each plain step before the previous one's tokens reach the host
    # kernels and placement
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    device: str = "auto"
    threads: int | None = Field(None, gt=0)
    attention: Literal["auto", "torch", "triton"] = "auto"
    cuda_graphs: bool = True
    gguf_quantized: bool = False  # a .gguf model's Q4_1 projections stay in the file's blocks
    tensor_parallel_size: int = Field(1, ge=1)
    tensor_parallel_timeout: float = Field(60.0, gt=0)  # the most seconds a collective waits for another rank
    enable_expert_parallel: bool = False  # a mixture of experts' experts sharded over the tensor-parallel ranks
    # the service
    load_interval: float = Field(0.5, gt=0)  # seconds between load events
    role: Literal["aggregated", "prefill", "decode"] = "aggregated"
    # the groups
    spec: SpeculativeConfig = SpeculativeConfig()
    kv_offload: KvOffload = KvOffload()
    kv_transfer: KvTransfer = KvTransfer()
    lora: Lora = Lora()

    @field_validator("model")
    @classmethod
    def _model_exists(cls, model: str) -> str:
        if not Path(model).exists():
            raise ValueError(f"--model {model} does not exist")
        return model

    @field_validator("served_model_aliases")
    @classmethod
    def _aliases(cls, names: tuple[str, ...]) -> tuple[str, ...]:
        if any(not name for name in names):
            raise ValueError("the served model names must not be empty")
        return names

    @field_validator("device")
    @classmethod
    def _device(cls, device: str) -> str:
        if device != "auto" and not (device == "cpu" or device.startswith("cuda")):
            raise ValueError(f"--device must be auto, cpu or cuda[:N], got {device}")
        return device

    @model_validator(mode="after")
    def _together(self) -> TargetConfig:
        if self.attention == "triton" and self.device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError("--attention triton needs --device cuda (or TRITON_INTERPRET=1 to run it slowly on CPU)")
        self._check_shardable()
        if self.role != "aggregated" and self.tensor_parallel_size > 1:
            raise ValueError("--role prefill/decode does not combine with --tensor-parallel-size > 1 yet")
        if self.kv_offload.host_gb and (self.tensor_parallel_size > 1 or not self.enable_prefix_caching):
            raise ValueError("--kv-offload-config's host tier needs prefix caching and no tensor parallelism")
        if self.gguf_quantized and (not self.model.endswith(".gguf") or self.tensor_parallel_size > 1):
            raise ValueError("--gguf-quantized needs a .gguf --model and --tensor-parallel-size 1")
        if self.lora.max_loras and (self.tensor_parallel_size > 1 or self.role != "aggregated"):
            raise ValueError("LoRA adapters (--max-loras, --lora-modules) do not combine with "
                             "--tensor-parallel-size > 1 or --role prefill/decode yet")
        return self

    def _check_shardable(self) -> None:
        """The model is one the engine serves (its config.json parses: family, rope, experts' router),
        and its heads, sizes and experts split over the ranks (a model directory's config; a GGUF file
        is checked when it loads)."""
        from workers.engine.config import ModelConfig
        from workers.engine.parallel import split_heads, split_range

        if not (Path(self.model) / "config.json").exists():
            return
        cfg = ModelConfig.from_dir(self.model)
        size = self.tensor_parallel_size
        for rank in range(size if size > 1 else 0):
            split_heads(cfg.num_heads, cfg.num_kv_heads, rank, size)
            split_range(cfg.intermediate_size, rank, size)
            if cfg.moe is not None and self.enable_expert_parallel:
                cfg.moe.local_experts(rank, size)
            elif cfg.moe is not None:
                split_range(cfg.moe.intermediate_size, rank, size)
