"""Quantized checkpoints: weight memory, logits error and decode speed per format (CPU demo model, or
an 8B-shaped model on a GPU with ``--gpu``).

Usage: .venv/bin/python bench/quant_bench.py [--group 64] [--new-tokens 32] [--threads 1]
       python bench/quant_bench.py --gpu [--layers 8] [--steps 64] [--out DIR]   (CUDA; bench/gpu_check.sh part quant)

CPU: the demo SmolLM2-135M is written as FP8 (compressed-tensors, per tensor and per channel, by the
``compressed-tensors`` library) and INT4 (AWQ GEMM and GPTQ v1 layouts, min-max quantized by
``tests/support/quant.py``; group ``--group``: the model's 576-wide projections take no group of
128). Each is loaded by the engine with its projections kept quantized. Reported per format:
the bytes of all weights (``workers.engine.quant.weight_bytes``: embeddings and norms included),
the largest logit difference against the format's dequantized reference (what the engine must
match: float rounding) and against the float32 model (what quantization costs), top-1 agreement
with float32 over the prompt positions, and greedy decode tokens/s at batch 1 and 16, float32 in
the same run. On CPU the quantized formats dequantize every matmul: they save memory, not time.
The row "fp8 per channel, scaled_mm" runs the FP8 checkpoint through ``torch._scaled_mm`` with FP8
activations (per token), as CUDA does: its reference column is the dequantizing path's logits.
The row "gguf Q4_1 kept quantized" loads the demo's own GGUF file with ``gguf_quantized=True``: the
projections keep the file's Q4_1 blocks; its reference is the float32 model, which is that file
dequantized on load (the embedding, Q8_0 in the file, is dequantized in both).

GPU (``--gpu``): a random-weight Llama-3.1-8B-shaped model (hidden 4096, intermediate 14336, 32/8
heads, vocab 128256; ``--layers`` of its 32 layers, default 8 so that the three engines build and
run in about a minute), bf16, built as ``bench/gpu_bench.py`` builds it; then quantized in memory
(``workers.engine.quant.quantize_in_place``, which makes exactly what the checkpoint writers and the
loader make, tests/unit/workers/engine/test_quant.py) to FP8 per channel (``torch._scaled_mm``,
per-token FP8 activations) and INT4 AWQ g128 (the Triton dequant-GEMM). Each served by the engine
with CUDA graphs as it serves (decode steps replayed); reported: weight GiB (all weights, and the
projections alone), decode tok/s at batch 1 and 16 with the ratio to bf16 from the same run, the
bytes a decode step reads over measured copy bandwidth (roofline share), and the last prompt
token's logits against bf16 (top-1 agreement over 16 prompts, max |Δ| over the logits' max |·|).
The LM head (128256 × 4096, 1.05 GB) stays bf16 in every format and is read every step: with 8 of 32
layers it is a quarter of bf16's bytes per step and over half of INT4's, so the speedups here
understate the full model's (``--layers 32`` for that, about four times longer).
"""

from __future__ import annotations

import argparse
import gc
import random
import sys
import tempfile
import time
import traceback
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


def last_logits(model, prompts: list[list[int]]):
    """Each prompt's last-token logits [B, V] (float32), one eager prefill."""
    import torch

    from workers.engine.attention import AttentionMetadata, allocate_kv_cache

    cfg = model.cfg
    device = model.lm_head.weight.device
    per_seq = [-(-len(p) // 16) for p in prompts]
    starts = [sum(per_seq[:i]) for i in range(len(prompts))]
    tables = [list(range(s, s + n)) for s, n in zip(starts, per_seq)]
    caches = allocate_kv_cache(cfg.num_layers, sum(per_seq), 16, cfg.num_kv_heads, cfg.head_dim,
                               torch.bfloat16, device)
    lens = [len(p) for p in prompts]
    meta = AttentionMetadata.build(lens, lens, tables, 16, device)
    ids = torch.tensor([t for p in prompts for t in p], device=device)
    pos = torch.tensor([i for p in prompts for i in range(len(p))], device=device)
    last = torch.tensor([sum(lens[: i + 1]) - 1 for i in range(len(lens))], device=device)
    with torch.inference_mode():
        return model(ids, pos, meta, caches, logits_indices=last).logits.float()


def projection_bytes(model) -> int:
    """Bytes of the layers' projections (quantized: with their scales and zeros)."""
    from workers.engine.quant import PROJECTIONS

    total = 0
    for layer in model.model.layers:
        for proj, (parent, _) in PROJECTIONS.items():
            linear = getattr(getattr(layer, parent), proj)
            w = linear.weight
            total += linear.quant.nbytes() if linear.quant is not None else w.numel() * w.element_size()
    return total


def gpu_format(args, cfg, fmt: str, probe, reference, bandwidth: float, kv_per_token: int, rows: list):
    """One format's row (appended to ``rows``); returns the bf16 reference logits."""
    import json

    import torch

    from bench.gpu_bench import decode_throughput, random_model
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.quant import quantize_in_place, use_kernel, weight_bytes

    t0 = time.perf_counter()
    model = random_model(cfg, max_positions=2048, seed=0)
    kernels = {"cuBLAS bf16": 4 * cfg.num_layers}
    if fmt != "bf16":
        kernels = quantize_in_place(model, "fp8" if fmt == "fp8" else "awq", group=128)
    torch.cuda.empty_cache()
    mem = weight_bytes(model)
    embed = model.model.embed_tokens.weight
    read = mem["total"] - embed.numel() * embed.element_size()  # a decode step gathers B embedding rows
    logits = last_logits(model, probe)
    if reference is None:
        reference, top1, vs_bf16, vs_dense = logits, 1.0, 0.0, 0.0
    else:
        top1 = (logits.argmax(-1) == reference.argmax(-1)).float().mean().item()
        vs_bf16 = ((logits - reference).abs().max() / reference.abs().max()).item()
        use_kernel(model, "dense")  # the dequantizing path: what the kernels must reproduce
        dense = last_logits(model, probe)
        use_kernel(model, "auto")
        vs_dense = ((logits - dense).abs().max() / dense.abs().max()).item()
    engine = Engine(model, EngineConfig(block_size=16, max_num_seqs=16, max_num_batched_tokens=4096,
                                        max_model_len=1024, kv_cache_bytes=2 << 30), eos_token_ids=())
    row = {"format": fmt, "kernels": kernels, "weights_gib": mem["total"] / 2**30,
           "projections_gib": projection_bytes(model) / 2**30, "top1_vs_bf16": top1, "vs_bf16": vs_bf16,
           "vs_dequantized": vs_dense,
           "graphs": len(engine.runner.graphs.graphs) if engine.runner.graphs is not None else 0}
    for b in (1, 16):
        d = decode_throughput(engine, b, args.prompt_len, args.steps, cfg.vocab_size)
        step_bytes = read + b * (d["mean_context"] + 1) * kv_per_token
        row[f"b{b}"] = d["tokens_per_s"]
        row[f"b{b}_graphed"] = d["graphed_steps"] == d["steps"]
        row[f"b{b}_roofline"] = d["tokens_per_s"] / (b / (step_bytes / bandwidth))
    row["seconds"] = time.perf_counter() - t0
    rows.append(row)
    print(json.dumps(row), flush=True)
    return reference


def kernel_times(cfg, batches=(1, 16), reps: int = 20) -> list[dict]:
    """Microseconds per projection matmul at each decode batch size, from CUDA graphs of ``reps``
    calls (launch overhead out): bf16 ``F.linear``, FP8 ``torch._scaled_mm`` (with the activations'
    quantization), INT4 Triton, on the four projection shapes of one layer."""
    import torch
    import torch.nn.functional as F

    from workers.engine.quant import quantize_weight

    shapes = {"qkv": (cfg.q_size + 2 * cfg.kv_size, cfg.hidden_size), "o": (cfg.hidden_size, cfg.q_size),
              "gate_up": (2 * cfg.intermediate_size, cfg.hidden_size), "down": (cfg.hidden_size, cfg.intermediate_size)}
    gen = torch.Generator(device="cuda").manual_seed(3)
    rows = []
    for name, (n, k) in shapes.items():
        w = torch.empty(n, k, device="cuda", dtype=torch.bfloat16).normal_(0, 0.02, generator=gen)
        fp8, int4 = quantize_weight(w, "fp8"), quantize_weight(w, "awq", 128)
        int4.kernels()
        fp8.kernel, int4.kernel = "scaled_mm", "triton"
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            row = {"proj": name, "n": n, "k": k, "m": m}
            for label, fn in (("bf16", lambda: F.linear(x, w)), ("fp8", lambda: fp8.linear(x, None)),
                              ("int4", lambda: int4.linear(x, None))):
                for _ in range(3):
                    fn()
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    for _ in range(reps):
                        fn()
                graph.replay()
                torch.cuda.synchronize()
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                for _ in range(5):
                    graph.replay()
                end.record()
                end.synchronize()
                row[label] = start.elapsed_time(end) * 1e3 / (5 * reps)
            rows.append(row)
        del w, fp8, int4
    return rows


def gpu_main(args) -> None:
    """The 8B-shaped bf16 / FP8 / INT4 decode comparison (see the module docstring)."""
    import json

    import torch

    from bench.gpu_bench import llama8b_config, measure_bandwidth, prompts

    if not torch.cuda.is_available():
        sys.exit("quant_bench --gpu needs a CUDA GPU")
    started = time.perf_counter()
    cfg = llama8b_config(args.layers)
    bandwidth = measure_bandwidth(gib=1.0, iters=10)
    probe = prompts(16, 64, cfg.vocab_size, seed=7)
    kv_per_token = 2 * cfg.num_layers * cfg.kv_size * 2
    rows, reference, failed = [], None, []
    for fmt in ("bf16", "fp8", "int4"):
        try:
            reference = gpu_format(args, cfg, fmt, probe, reference, bandwidth, kv_per_token, rows)
        except Exception:  # one format failing (a kernel the device refuses) keeps the others' rows
            traceback.print_exc()
            failed.append(fmt)
        gc.collect()  # the engine and its graphs hold the device memory the next format needs
        torch.cuda.empty_cache()
    kernels = []
    try:
        kernels = kernel_times(cfg)
    except Exception:  # the engine table above stands without it
        traceback.print_exc()
        failed.append("kernel timings")
    if not rows:
        sys.exit(f"quant_bench --gpu: every format failed: {failed}")
    lines = [f"Device: {torch.cuda.get_device_name()}; torch {torch.__version__}; Llama-3.1-8B shape, "
             f"{args.layers} of 32 layers, random weights; copy bandwidth {bandwidth / 1e9:.0f} GB/s; "
             f"{args.steps} decode steps per batch after a {args.prompt_len}-token prompt; CUDA graphs",
             "", "| format | kernels | weights GiB | projections GiB | tok/s b1 | vs bf16 | of roofline b1 "
             "| tok/s b16 | vs bf16 | of roofline b16 | max abs Δ logits vs its dequantized path | vs bf16 "
             "| top-1 = bf16 |",
             "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    base = rows[0]
    for r in rows:
        graphed = "" if r["b1_graphed"] and r["b16_graphed"] else " (not all steps graphed)"
        kernels_used = ", ".join(f"{k} ×{v}" for k, v in r["kernels"].items())
        lines.append(f"| {r['format']} | {kernels_used}{graphed} | {r['weights_gib']:.2f} | {r['projections_gib']:.2f} "
                     f"| {r['b1']:.0f} | {r['b1'] / base['b1']:.2f}× | {r['b1_roofline']:.2f} | {r['b16']:.0f} "
                     f"| {r['b16'] / base['b16']:.2f}× | {r['b16_roofline']:.2f} | {r['vs_dequantized']:.4f} "
                     f"| {r['vs_bf16']:.3f} | {r['top1_vs_bf16']:.2f} |")
    lines.append("Logit differences are max |Δ| over the 16 probe prompts' last-token logits, divided by the "
                 "reference's max |logit|; random weights give flat logits: top-1 against bf16 is a weak signal.")
    if kernels:
        lines += ["", "One projection's matmul, µs per call (CUDA graph of 20 calls; bf16 / FP8 / INT4 g128 weights):",
                  "",
                  "| projection | N × K | batch | bf16 µs | fp8 µs | fp8 / bf16 | int4 µs | int4 / bf16 |",
                  "|---|---|---:|---:|---:|---:|---:|---:|"]
        for r in kernels:
            lines.append(f"| {r['proj']} | {r['n']} × {r['k']} | {r['m']} | {r['bf16']:.1f} | {r['fp8']:.1f} "
                         f"| {r['fp8'] / r['bf16']:.2f} | {r['int4']:.1f} | {r['int4'] / r['bf16']:.2f} |")
    if failed:
        lines.append(f"FAILED (traceback above): {', '.join(failed)}")
    lines.append(f"\n{time.perf_counter() - started:.0f} s in all")
    text = "\n".join(lines)
    print(text)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "quant_bench.md").write_text(text + "\n")
        (out / "quant_bench.json").write_text(json.dumps(rows, indent=1))
    if failed:
        sys.exit(1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--group", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--gpu", action="store_true", help="the 8B-shaped bf16 / FP8 / INT4 decode comparison on CUDA")
    parser.add_argument("--layers", type=int, default=8, help="--gpu: layers of the 8B shape (of 32)")
    parser.add_argument("--steps", type=int, default=64, help="--gpu: decode steps timed per batch size")
    parser.add_argument("--prompt-len", type=int, default=128, help="--gpu: prompt tokens per request")
    parser.add_argument("--out", default="", help="--gpu: folder for quant_bench.md and .json")
    args = parser.parse_args()
    if args.gpu:
        gpu_main(args)
        return
    import torch
    import transformers as tf

    from tests.support.quant import read_fp8_reference, write_fp8, write_int4
    from workers.demo_model import demo_model_dir, gguf_path
    from workers.engine.quant import use_kernel, weight_bytes
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
        formats["fp8 per channel, scaled_mm"] = (tmp / "fp8-channel", "dense")
        for method in ("awq", "gptq"):
            ref = write_int4(hf(), tmp / method, method, group=args.group)
            formats[f"int4 {method} g{args.group}"] = (tmp / method, ref)
        formats["gguf Q4_1 kept quantized"] = (gguf_path(), "float32")
        for name, (path, ref) in formats.items():
            print(f"{name} ...", file=sys.stderr, flush=True)
            dtype = torch.bfloat16 if name == "bfloat16" else torch.float32
            model = load_model(path, dtype=dtype, gguf_quantized=name.startswith("gguf"))
            if ref == "dense":  # FP8 activations through torch._scaled_mm, against the dequantizing path
                want = logits(model, prompt).float()
                use_kernel(model, "scaled_mm")
            mem = weight_bytes(model)["total"]
            ours = logits(model, prompt).float()
            if ref is not None:
                if ref == "float32":  # the demo's float32 weights are the GGUF dequantized on load
                    want = full
                elif ref != "dense":
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
