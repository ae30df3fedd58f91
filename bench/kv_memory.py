"""Device memory of the target engine on CUDA: what CUDA graphs hold beyond the KV cache, and what
``--gpu-memory-utilization`` sizes the cache to against what the worker then holds.

Usage (on a CUDA machine): python bench/kv_memory.py [--utilization 0.05] [--max-num-seqs 8]

Model: a random 2-layer Llama (hidden 64, vocab 256, bf16; weights of a few KiB, so every byte the
allocator holds is the cache, the graphs' pools and cuBLAS workspaces). Printed, one line each:

- graphs off / on: the allocator's bytes after building an engine with a fixed cache (200,000
  blocks), its KV bytes, and the difference (what the captured graphs hold);
- utilization: the share asked for, the KV cache it sized, what the allocator holds with the
  cache allocated and the graphs captured, and its peak while a full batch (``--max-num-seqs``
  requests, 200-token prompts, 32 new tokens) is served: the peak must stay within the share.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.messages import SamplingParams  # noqa: E402
from tests.unit.workers.engine.helpers import tiny_hf_model  # noqa: E402
from workers.engine.engine import Engine, EngineConfig  # noqa: E402
from workers.engine.weights import load_model  # noqa: E402

GIB = 1 << 30


def kv_bytes(engine: Engine) -> int:
    return sum(k.numel() * k.element_size() + v.numel() * v.element_size() for k, v in engine.runner.kv_caches)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--utilization", type=float, default=0.05)
    ap.add_argument("--max-num-seqs", type=int, default=8)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kv_memory: needs a CUDA device")
    path = Path(tempfile.mkdtemp(prefix="kv-memory-"))
    tiny_hf_model("llama", path, layers=2, vocab=256)
    print(f"device {torch.cuda.get_device_name()}, {torch.cuda.mem_get_info()[1] / GIB:.2f} GiB")
    for graphs in (False, True):
        model = load_model(path, device="cuda", dtype=torch.bfloat16, fused=True)
        torch.cuda.synchronize()
        base = torch.cuda.memory_reserved()
        engine = Engine(model, EngineConfig(num_blocks=200_000, max_num_seqs=args.max_num_seqs, cuda_graphs=graphs),
                        eos_token_ids=())
        torch.cuda.synchronize()
        held, kv = torch.cuda.memory_reserved() - base, kv_bytes(engine)
        count = len(engine.runner.graphs.graphs) if engine.runner.graphs else 0
        print(f"graphs {'on ' if graphs else 'off'} ({count:2d} captured): allocator {held / GIB:.3f} GiB, "
              f"KV {kv / GIB:.3f} GiB, beyond the KV {(held - kv) / GIB:.3f} GiB")
        del engine, model
        torch.cuda.empty_cache()
    model = load_model(path, device="cuda", dtype=torch.bfloat16, fused=True)
    total = torch.cuda.mem_get_info()[1]
    torch.cuda.reset_peak_memory_stats()
    engine = Engine(model, EngineConfig(max_num_seqs=args.max_num_seqs, gpu_memory_utilization=args.utilization),
                    eos_token_ids=())
    torch.cuda.synchronize()
    after = torch.cuda.memory_reserved()
    prompts = {f"r{i}": list(range(1 + i, 200 + i)) for i in range(args.max_num_seqs)}
    engine.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    peak, share = torch.cuda.max_memory_reserved(), args.utilization * total
    print(f"utilization {args.utilization:g}: share {share / GIB:.3f} GiB, KV {engine.kv_cache_bytes / GIB:.3f} GiB, "
          f"allocator with graphs {after / GIB:.3f} GiB, peak serving {peak / GIB:.3f} GiB "
          f"({'within' if peak <= share else 'OVER'} the share)")


if __name__ == "__main__":
    main()
