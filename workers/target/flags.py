"""The target worker's engine flags, defined once: ``python -m workers.target`` adds them to its
parser and ``tandem up`` passes them through to its target (and prefill) workers
(:class:`runtime.flags.SharedFlag`). Light to import: no torch."""

from __future__ import annotations

from runtime.flags import SharedFlag

DTYPES = ("auto", "float32", "bfloat16", "float16")

MAX_MODEL_LEN = SharedFlag(("--max-model-len",), dict(
    type=int, default=None, help="context length, prompt and output (default: the model's, capped by what the KV "
                                 "cache holds)"))
KV_CACHE_GB = SharedFlag(("--kv-cache-gb",), dict(
    type=float, default=1.0, help="KV cache size in GiB when --num-blocks is unset (on CUDA with "
                                  "--gpu-memory-utilization, that decides instead)"))
GPU_MEMORY_UTILIZATION = SharedFlag(("--gpu-memory-utilization",), dict(
    type=float, default=None,
    help="on CUDA, the fraction of the device's memory this worker may use (0-1], as vLLM's: the KV cache "
         "gets what is left of it after the weights, the activations of the largest step and the CUDA graphs "
         "(default: unset, --kv-cache-gb decides); it does nothing on a CPU or with --num-blocks: the worker "
         "warns at start and its metrics do not report it"))
DTYPE = SharedFlag(("--dtype",), dict(
    default="auto", choices=DTYPES,
    help="weights and KV cache: float32, bfloat16, float16; auto = bfloat16 on CUDA, float32 on CPU"))
MAX_NUM_SEQS = SharedFlag(("--max-num-seqs",), dict(type=int, default=64, help="most sequences in a batch"))
SCHEDULING_POLICIES = ("fcfs", "priority")
SCHEDULING_POLICY = SharedFlag(("--scheduling-policy",), dict(
    default="fcfs", choices=SCHEDULING_POLICIES,
    help="as vLLM's: fcfs (arrival order), or priority: requests run in order of their 'priority' field (lower "
         "first, then arrival), a higher-priority arrival preempts the lowest-priority running request when the "
         "batch or the KV cache is full, and freed KV blocks of lower-priority requests are evicted first"))

# KV cache tiers below the device pool (workers/engine/kv_tiers.py)
KV_OFFLOAD_CONFIG = SharedFlag(("--kv-offload-config",), dict(
    default=None, metavar="JSON",
    help="KV cache tiers below the device pool as JSON (or @FILE), so a prefix evicted there loads back instead of "
         "being recomputed: host_gb (GiB of host memory, pinned on CUDA; 0: off, the default), disk_dir (a "
         "directory for a disk tier below the host tier: one checksummed file per block, named by its chained "
         "hash; several targets of the same model may share it), disk_gb (the most GiB kept there, oldest "
         "blocks go first; 16)"))

# LoRA adapters (workers/engine/lora.py)
MAX_LORAS = SharedFlag(("--max-loras",), dict(
    type=int, default=None, help="LoRA adapter slots: how many different adapters one batch may run (0: no "
                                 "adapters; default: one per --lora-modules adapter, else 0); idle slots are reused "
                                 "least recently used first"))
MAX_LORA_RANK = SharedFlag(("--max-lora-rank",), dict(
    type=int, default=16, help="the largest LoRA rank an adapter may have"))
LORA_MODULES = SharedFlag(("--lora-modules",), dict(
    nargs="*", default=[], metavar="NAME=PATH",
    help="PEFT LoRA adapters to load at start; a request names one in its model field (more are loaded at run "
         "time with POST /v1/load_lora_adapter)"))

# Quantized weights (workers/engine/quant.py)
GGUF_QUANTIZED = SharedFlag(("--gguf-quantized",), dict(
    action="store_true",
    help="with a .gguf --model: keep its Q4_1 layer projections in the file's 4-bit blocks (dequantized per "
         "matmul) instead of float tensors; the demo SmolLM2's projections take 66 MB instead of 425 MB"))

# Mixtures of experts (workers/engine/moe.py)
ENABLE_EXPERT_PARALLEL = SharedFlag(("--enable-expert-parallel",), dict(
    action="store_true",
    help="as vLLM's: with --tensor-parallel-size N, shard a mixture of experts' experts over the N ranks (each "
         "holds num_experts/N whole experts; num_experts must divide by N) instead of slicing every expert; "
         "attention stays tensor-parallel (it does nothing at size 1 or on a dense model: the worker says so)"))


def max_loras(given: int | None, lora_modules: int) -> int:
    """``--max-loras`` as given, else one slot per adapter of ``--lora-modules``."""
    return lora_modules if given is None else given


def gpu_memory_utilization_ignored(given: float | None, device_type: str, num_blocks: int | None) -> str | None:
    """Why ``--gpu-memory-utilization`` does nothing on this worker (None: not given, or in force).
    It sizes the KV cache on CUDA alone, and only when ``--num-blocks`` does not."""
    if given is None:
        return None
    if device_type != "cuda":
        return (f"--gpu-memory-utilization {given:g} does nothing on a {device_type.upper()}: --kv-cache-gb sizes the "
                f"KV cache; the metrics report no gpu_memory_utilization")
    if num_blocks is not None:
        return (f"--gpu-memory-utilization {given:g} does nothing with --num-blocks {num_blocks}, which sizes the KV "
                f"cache; the metrics report no gpu_memory_utilization")
    return None


ENGINE_FLAGS = (MAX_MODEL_LEN, KV_CACHE_GB, GPU_MEMORY_UTILIZATION, DTYPE, MAX_NUM_SEQS, SCHEDULING_POLICY,
                KV_OFFLOAD_CONFIG, MAX_LORAS, MAX_LORA_RANK, LORA_MODULES, GGUF_QUANTIZED,
                ENABLE_EXPERT_PARALLEL)
