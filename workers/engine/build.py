"""Building a target's engine: device, dtype, kernels, tensor parallelism, weights, LoRA slots, KV
tiers and the grammar backend, from the target service's config.

``cfg`` is :class:`workers.engine.target_config.TargetConfig`, built once from the worker's flags.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from workers.engine.target_config import TargetConfig

log = logging.getLogger(__name__)


def build_engine(cfg: TargetConfig, worker_id: str):
    """Load the model and build the engine (blocking: call off the event loop)."""
    import torch

    from runtime.errors import StartupError
    from runtime.grammar_tokenizer import TokenizerMismatch
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.grammar import GrammarBackend
    from workers.engine.memory import NoMemoryForCache
    from workers.engine.weights import load_model

    size = cfg.tensor_parallel_size
    threads = cfg.threads or max(1, (os.cpu_count() or 1) // size)
    torch.set_num_threads(threads)
    device = cfg.device if cfg.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.startswith("cuda")
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if cuda else "float32")
    attention_fn = None
    triton = cfg.attention == "triton" or (cfg.attention == "auto" and cuda)
    if triton:
        from workers.engine.triton_attention import paged_attention_triton as attention_fn
    max_len = cfg.max_model_len
    log.info("target model on %s in %s (%s kernels)%s", device, dtype, "triton" if triton else "torch",
             f", tensor-parallel over {size} ranks" if size > 1 else "")
    followers = None
    if size > 1:
        from workers.engine.followers import load_sharded, rank_device

        if cuda and torch.cuda.device_count() <= int(rank_device(device, size - 1).split(":")[1]):
            raise StartupError(f"--tensor-parallel-size {size} from {device} needs more CUDA devices than the "
                             f"{torch.cuda.device_count()} visible")
        try:
            model, followers = load_sharded(cfg.model, size, dtype=dtype, device=device, threads=threads,
                                            attention="triton" if triton else "torch", fused=triton and cuda,
                                            max_positions=max_len, timeout=cfg.tensor_parallel_timeout,
                                            expert_parallel=cfg.enable_expert_parallel)
        except RuntimeError as exc:  # a rank that could not start or load: its own log says why
            raise StartupError(f"tensor parallelism over {size} ranks: {exc}") from None
    else:
        model = load_model(cfg.model, dtype=getattr(torch, dtype), device=device, max_positions=max_len,
                           attention_fn=attention_fn, fused=triton and cuda, gguf_quantized=cfg.gguf_quantized)
    if cfg.enable_expert_parallel and (size == 1 or model.cfg.moe is None):
        log.warning("--enable-expert-parallel does nothing here: %s", "the model has no experts"
                    if model.cfg.moe is None else "--tensor-parallel-size is 1 (every expert is on the one rank)")
    elif cfg.enable_expert_parallel:
        log.info("expert parallelism: %d experts, %d per rank", model.cfg.moe.num_experts,
                 model.cfg.moe.num_experts // size)
    lora = None
    if cfg.lora.max_loras:
        from workers.engine.lora import LoraManager

        lora = LoraManager(model, cfg.lora.max_loras, cfg.lora.max_lora_rank)
    engine_cfg = EngineConfig(block_size=cfg.block_size, num_blocks=cfg.num_blocks, max_num_seqs=cfg.max_num_seqs,
                              max_num_batched_tokens=cfg.max_num_batched_tokens, max_model_len=max_len,
                              kv_cache_bytes=int(cfg.kv_cache_gb * (1 << 30)),
                              gpu_memory_utilization=cfg.gpu_memory_utilization,
                              enable_prefix_caching=cfg.enable_prefix_caching, cuda_graphs=cfg.cuda_graphs,
                              async_scheduling=cfg.async_scheduling, scheduling_policy=cfg.scheduling_policy)
    try:
        spec = cfg.spec
        tree_topk, tree_depth = spec.tree
        engine = Engine(model, engine_cfg, worker_id, num_speculative_tokens=spec.num_speculative_tokens,
                        hidden_layers=offered_layers(spec.hidden_layers, model.cfg.num_layers),
                        adaptive=spec.adaptive, tree_topk=tree_topk, tree_depth=tree_depth,
                        load_aware=spec.load_aware, followers=followers, lora=lora)
    except NoMemoryForCache as exc:  # one line, not a traceback
        if followers is not None:
            followers.close()
        raise StartupError(str(exc)) from None
    except BaseException:
        if followers is not None:
            followers.close()
        raise
    offload = cfg.kv_offload
    if offload.host_gb:
        from workers.engine.kv_tiers import build_tiers, weights_fingerprint

        # disk-tier files are shared only by targets computing the same KV: same served name, same
        # weight files, same kernels' view of them (Q4_1 blocks kept or dequantized)
        model_id = (cfg.served_model_name, weights_fingerprint(cfg.model), cfg.gguf_quantized)
        engine.attach_tiers(build_tiers(engine, int(offload.host_gb * (1 << 30)), offload.disk_dir,
                                        int(offload.disk_gb * (1 << 30)), repr(model_id)))
    for name, path in cfg.lora.modules:
        engine.load_lora(name, path)
    model_path = Path(cfg.model)
    engine.grammars = GrammarBackend.for_model_dir(model_path.parent if model_path.suffix == ".gguf" else model_path,
                                                   engine.vocab_size, sorted(engine.eos_token_ids))
    if engine.grammars is not None:
        try:  # now, not on the first constrained request: a tokenizer llguidance misreads stops the start
            engine.grammars.tokenizer()
        except TokenizerMismatch as exc:
            if followers is not None:
                followers.close()
            raise StartupError(str(exc)) from None
    return engine


def offered_layers(spec: str, num_layers: int) -> tuple[int, ...]:
    """The hidden layers a target offers draft workers, from ``--speculative-config``'s hidden_layers."""
    if spec == "none":
        return ()
    if spec == "auto":
        eagle3 = (2, num_layers // 2, num_layers - 3) if num_layers >= 4 else ()
        return tuple(sorted({*eagle3, num_layers}))
    layers = tuple(sorted({int(x) for x in spec.split(",")}))
    if any(not 0 <= k <= num_layers for k in layers):
        raise ValueError(f"--speculative-config: 'hidden_layers' must be in [0, {num_layers}], got {list(layers)}")
    return layers
