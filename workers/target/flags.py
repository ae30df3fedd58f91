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
         "(default: unset, --kv-cache-gb decides); on the CPU --kv-cache-gb decides and a log line says so"))
DTYPE = SharedFlag(("--dtype",), dict(
    default="auto", choices=DTYPES,
    help="weights and KV cache: float32, bfloat16, float16; auto = bfloat16 on CUDA, float32 on CPU"))
MAX_NUM_SEQS = SharedFlag(("--max-num-seqs",), dict(type=int, default=64, help="most sequences in a batch"))

ENGINE_FLAGS = (MAX_MODEL_LEN, KV_CACHE_GB, GPU_MEMORY_UTILIZATION, DTYPE, MAX_NUM_SEQS)
