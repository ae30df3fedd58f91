"""Quantized checkpoints of the demo model: weight memory, logits error and CPU decode speed per format.

Usage: .venv/bin/python bench/quant_bench.py [--group 64] [--new-tokens 32] [--threads 1]

The demo SmolLM2-135M is written as FP8 (compressed-tensors, per tensor and per channel, by the
``compressed-tensors`` library) and INT4 (AWQ GEMM and GPTQ v1 layouts, min-max quantized by
``tests/support/quant.py``; group ``--group``: the model's 576-wide projections take no group of
128). Each is loaded by the engine with its projections kept quantized. Reported per format:
the bytes of all weights (``workers.engine.quant.weight_bytes``: embeddings and norms included),
the largest logit difference against the format's dequantized reference (what the engine must
match: float rounding) and against the float32 model (what quantization costs), top-1 agreement
with float32 over the prompt positions, and greedy decode tokens/s at batch 1 and 16, float32 in
the same run. On CPU the quantized formats dequantize every matmul: they save memory, not time.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def decode_rate(model, prompts: list[list[int]], new_tokens: int) -> float:
    from runtime.messages import SamplingParams
    from workers.engine.engine import Engine, EngineConfig

    engine = Engine(model, EngineConfig(block_size=16, num_blocks=1024, max_num_seqs=16), eos_token_ids=())
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    start = time.perf_counter()
    engine.generate({f"r{i}": p for i, p in enumerate(prompts)}, params)
    return len(prompts) * new_tokens / (time.perf_counter() - start)


def logits(model, prompt: list[int]):
    import torch

    from workers.engine.attention import AttentionMetadata, allocate_kv_cache

    cfg = model.cfg
    blocks = -(-len(prompt) // 16)
    dtype = next(model.parameters()).dtype
    caches = allocate_kv_cache(cfg.num_layers, blocks, 16, cfg.num_kv_heads, cfg.head_dim, dtype, "cpu")
    meta = AttentionMetadata.build([len(prompt)], [len(prompt)], [list(range(blocks))], 16, torch.device("cpu"))
    with torch.inference_mode():
        return model(torch.tensor(prompt), torch.arange(len(prompt)), meta, caches).logits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    import torch
    import transformers as tf

    from tests.support.quant import read_fp8_reference, write_fp8, write_int4
    from workers.demo_model import demo_model_dir
    from workers.engine.quant import weight_bytes
    from workers.engine.weights import load_model

    torch.set_num_threads(args.threads)
    base = demo_model_dir()
    rng = random.Random(0)
    prompt = [rng.randrange(3, 49152) for _ in range(48)]
    prompts = [[rng.randrange(3, 49152) for _ in range(rng.randrange(24, 48))] for _ in range(16)]

    def hf(path=base):
        return tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()

    with torch.inference_mode():
        full = hf()(torch.tensor([prompt])).logits[0]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        formats = {"float32": (base, None), "bfloat16": (base, None)}
        for strategy in ("tensor", "channel"):
            path = write_fp8(hf(), tmp / f"fp8-{strategy}", strategy)
            formats[f"fp8 per {strategy}"] = (path, read_fp8_reference(path))
        for method in ("awq", "gptq"):
            ref = write_int4(hf(), tmp / method, method, group=args.group)
            formats[f"int4 {method} g{args.group}"] = (tmp / method, ref)
        for name, (path, ref) in formats.items():
            dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
            model = load_model(path, dtype=dtype)
            mem = weight_bytes(model)["total"]
            ours = logits(model, prompt).float()
            if ref is not None:
                with torch.inference_mode():
                    want = ref(torch.tensor([prompt])).logits[0]
                vs_ref = f"{(ours - want).abs().max().item():.1e}"
            else:
                vs_ref = "-"
            vs_full = (ours - full).abs().max().item()
            top1 = (ours.argmax(-1) == full.argmax(-1)).float().mean().item()
            one = max(decode_rate(model, prompts[:1], args.new_tokens) for _ in range(2))
            many = max(decode_rate(model, prompts, args.new_tokens) for _ in range(2))
            rows.append((name, mem, vs_ref, vs_full, top1, one, many))
    print(f"SmolLM2-135M, CPU, {args.threads} thread(s), {args.new_tokens} greedy tokens per request, best of 2")
    print("| format | weights MiB | vs float32 | max abs Δ logits vs its dequantized reference | "
          "max abs Δ vs float32 | top-1 = float32 | tok/s batch 1 | tok/s batch 16 |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|")
    base_mem, base_one, base_many = rows[0][1], rows[0][5], rows[0][6]
    for name, mem, vs_ref, vs_full, top1, one, many in rows:
        print(f"| {name} | {mem / 2**20:.1f} | {mem / base_mem:.2f} | {vs_ref} | {vs_full:.3f} | {top1:.2f} | "
              f"{one:.1f} ({one / base_one:.2f}) | {many:.1f} ({many / base_many:.2f}) |")


if __name__ == "__main__":
    main()
