"""How big an engine's KV cache is, how long a sequence may be, and which CUDA graphs it captures.

A block holds ``block_size`` tokens of KV for every layer and, when a draft reads hidden states, the
same tokens' rows of the offered layers (:class:`.hidden.HiddenStore`). The cache gets
``kv_cache_bytes`` (CPU, or no utilization given), else what ``gpu_memory_utilization`` of the
device leaves after this worker's weights, the largest step's activations and the graphs' pool
(:mod:`.memory`); ``num_blocks`` wins over both.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from .cuda_graphs import GraphConfig
from .hidden import HiddenStore
from .memory import ALLOCATOR_SLACK, GIB, DeviceMemory, kv_cache_bytes, step_activation_bytes
from .model import DecoderModel
from .model_runner import ModelRunner
from .moe_config import step_intermediate

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    """Engine limits. ``num_blocks`` None: as many as ``kv_cache_bytes`` holds."""

    block_size: int = 16
    num_blocks: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 512
    max_model_len: int | None = None
    kv_cache_bytes: int = 1 << 30
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True  # on CUDA with Triton kernels: decode/verify steps replay captured graphs
    cuda_graph_max_batch: int | None = None  # largest graphed batch (None: max_num_seqs)
    # graphs for every verify length 2..γ+1 (False: γ+1 only, shorter verifies padded to it)
    cuda_graph_every_length: bool = True
    # launch step N+1 from step N's tokens on the device; N's host bookkeeping runs one step behind
    async_scheduling: bool = False
    # CUDA: the share of the device this engine may use; the KV cache gets the rest after weights,
    # activations and graphs (:mod:`.memory`). None, or on the CPU: kv_cache_bytes. num_blocks wins.
    gpu_memory_utilization: float | None = None
    # vLLM's --scheduling-policy: "fcfs", or "priority" (admission, preemption and prefix-cache eviction
    # by each request's priority, lower first; see .scheduler)
    scheduling_policy: str = "fcfs"

    def __post_init__(self):
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks <= 0:
            raise ValueError(f"num_blocks must be positive, got {self.num_blocks}")
        if self.max_num_seqs <= 0 or self.max_num_batched_tokens <= 0:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be positive")
        if self.max_model_len is not None and self.max_model_len <= 0:
            raise ValueError(f"max_model_len must be positive, got {self.max_model_len}")
        if self.kv_cache_bytes <= 0:
            raise ValueError("kv_cache_bytes must be positive")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be fcfs or priority, got {self.scheduling_policy!r}")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch <= 0:
            raise ValueError(f"cuda_graph_max_batch must be positive, got {self.cuda_graph_max_batch}")
        if self.gpu_memory_utilization is not None and not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")


@dataclass(frozen=True)
class CachePlan:
    num_blocks: int
    block_bytes: int  # KV and hidden rows of one block
    max_model_len: int


def plan_cache(model: DecoderModel, config: EngineConfig, num_hidden_layers: int, num_speculative_tokens: int) -> CachePlan:
    """The cache for ``model`` under ``config`` keeping
    ``num_hidden_layers`` layers' hidden rows, verifying up to ``num_speculative_tokens`` draft tokens a sequence."""
    cfg = model.cfg
    # sliding-window layers attend to their window only (workers.engine.attention): no cap at the window
    max_len = min(config.max_model_len or cfg.max_position_embeddings, model.max_positions)
    param = next(model.parameters())
    slot_bytes = HiddenStore.bytes_per_slot(num_hidden_layers, cfg.hidden_size, param.element_size())
    block_bytes = ModelRunner.bytes_per_block(model, config.block_size) + slot_bytes * config.block_size
    kv_bytes = config.kv_cache_bytes
    if config.num_blocks is None and config.gpu_memory_utilization is not None:
        kv_bytes = _kv_bytes_for_utilization(model, config, block_bytes, num_speculative_tokens)
    num_blocks = config.num_blocks or max(1, kv_bytes // block_bytes)
    if num_blocks * config.block_size < max_len:
        if config.max_model_len is not None:
            raise ValueError(f"{num_blocks} blocks of {config.block_size} cannot hold max_model_len={max_len}")
        max_len = num_blocks * config.block_size
    return CachePlan(num_blocks, block_bytes, max_len)


def _kv_bytes_for_utilization(model: DecoderModel, config: EngineConfig, block_bytes: int, num_speculative_tokens: int) -> int:
    """The KV cache's bytes under ``gpu_memory_utilization`` (CUDA; the CPU keeps kv_cache_bytes)."""
    param = next(model.parameters())
    if not param.is_cuda:
        log.debug("--gpu-memory-utilization applies on CUDA: on the CPU the KV cache takes --kv-cache-gb "
                  "(%.2f GiB)", config.kv_cache_bytes / GIB)
        return config.kv_cache_bytes
    cfg = model.cfg
    inter = step_intermediate(cfg.intermediate_size, cfg.hidden_size, cfg.moe)  # experts: per-token rows and logits
    shape = dict(hidden_size=cfg.hidden_size, intermediate_size=inter,
                 q_size=cfg.num_heads * cfg.head_dim, kv_size=cfg.num_kv_heads * cfg.head_dim,
                 vocab_size=cfg.vocab_size, itemsize=param.element_size())
    rows = min(config.max_num_batched_tokens, config.max_num_seqs * (num_speculative_tokens + 1))
    reserve = step_activation_bytes(config.max_num_batched_tokens, rows, **shape) + ALLOCATOR_SLACK
    if config.cuda_graphs and model.static_capable:  # the graphs' pool (the largest graphed step) and
        graphed = (config.cuda_graph_max_batch or config.max_num_seqs) * (num_speculative_tokens + 1)  # their scratch block
        reserve += step_activation_bytes(graphed, graphed, **shape) + block_bytes
    torch.cuda.synchronize(param.device)
    free, total = torch.cuda.mem_get_info(param.device)
    memory = DeviceMemory(total, free, torch.cuda.memory_reserved(param.device))
    kv = kv_cache_bytes(memory, config.gpu_memory_utilization, reserve)
    log.info("KV cache %.2f GiB from --gpu-memory-utilization %g of %.2f GiB: this worker holds %.2f GiB "
             "(weights), keeps %.2f GiB for activations and graphs; %.2f GiB free", kv / GIB,
             config.gpu_memory_utilization, total / GIB, memory.held / GIB, reserve / GIB, free / GIB)
    return kv


def log_device_memory(model: DecoderModel, config: EngineConfig) -> None:
    """After the cache is allocated and the graphs captured, what the device holds (CUDA, utilization given)."""
    param = next(model.parameters())
    if config.num_blocks is None and config.gpu_memory_utilization is not None and param.is_cuda:
        torch.cuda.synchronize(param.device)
        free, total = torch.cuda.mem_get_info(param.device)
        log.info("device memory with the KV cache allocated and the graphs captured: this worker's allocator "
                 "holds %.2f GiB, %.2f GiB of %.2f GiB free (--gpu-memory-utilization %g: %.2f GiB)",
                 torch.cuda.memory_reserved(param.device) / GIB, free / GIB, total / GIB,
                 config.gpu_memory_utilization, config.gpu_memory_utilization * total / GIB)


def graph_config(model: DecoderModel, config: EngineConfig, hidden_layers: tuple[int, ...], num_speculative_tokens: int) -> GraphConfig | None:
    """CUDA graphs for decode and verify steps (CUDA, tensor-only attention), captured at start-up
    with the hidden layers the engine keeps, so that no draft worker causes a recapture."""
    if not (config.cuda_graphs and next(model.parameters()).is_cuda and model.static_capable):
        return None
    lens = tuple(range(1, num_speculative_tokens + 2)) if config.cuda_graph_every_length else (1, num_speculative_tokens + 1)
    return GraphConfig(config.cuda_graph_max_batch or config.max_num_seqs, lens if num_speculative_tokens else (1,),
                       tuple(sorted(set(hidden_layers))), trees=num_speculative_tokens > 1)
