"""Mixture-of-experts decode cost: an MoE model against a dense model with the same active parameters
(CPU), or a Qwen3-30B-A3B-shaped MoE's tokens/s and memory-roofline share (``--gpu``).

Usage: .venv/bin/python bench/moe_bench.py [--threads 1] [--steps 20] [--repeats 3]
       python bench/moe_bench.py --gpu [--layers 48] [--steps 32]       (CUDA)

A *decode step* is one forward pass of the engine's model over B sequences, one new token each, every
sequence with ``--context`` tokens already cached (the paged KV cache and attention of a real
step), logits for every row. Weights are seeded random; nothing is downloaded.

CPU: a ``qwen3_moe``-shaped model (hidden 512, 4 layers, 8/4 heads of 64, 16 experts of 384, top-2,
vocabulary 8192: 49.3 M parameters, 16.3 M active per token) against a dense ``qwen3`` with the same
attention and one MLP of 2 × 384 = 768 (the same active parameters, less the 8 K-parameter routers).
Reported at batch 1 and 16 (each model timed ``--repeats`` times, alternating, the best median kept:
the machine is shared): ms per step, tokens/s, the ratio, and how many experts a step runs per
layer. At batch 1 the MoE reads what the dense model reads (its top-2 experts) plus the router; at
16 tokens it runs about 14 of its 16 experts per layer, so it reads about 7× the dense model's MLP
weights, each expert a small matmul over the few rows routed to it: the cost of sparsity on a
memory-bound CPU, and of the per-expert loop (``workers.engine.moe``: one host read per layer, one
gather, two matmuls and one ``index_add_`` per expert with tokens).

GPU (``--gpu``): the Qwen3-30B-A3B shape (hidden 2048, 48 layers, 32/4 heads of 128, 128 experts
of 768, top-8, vocabulary 151936; ``--layers`` to cut it), bf16, random weights made on the device.
Reported at batch 1, 16 and 64, for each expert path (the per-expert loop and the grouped Triton
kernels of ``workers.engine.triton_moe``, switched per layer; attention and the rest eager torch, no
CUDA graphs): tokens/s, and the fraction of the memory roofline: the bytes a step must read
(attention, norms, router, embedding row, LM head, and the experts the step's tokens were routed
to: counted in a probe step) over the step's time, against the device's measured copy bandwidth.
Then one sparse layer's experts alone, loop against kernels on the same routed batch: µs per call,
the speed-up, the largest difference of their outputs, and the kernels' share of the roofline (the
routed experts' weights over the call's time).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def build(cfg_dict: dict, device: str, dtype, max_positions: int):
    """Our model with seeded random weights (std 0.02; norms at 1), built straight on ``device``."""
    import torch

    from workers.engine.config import ModelConfig
    from workers.engine.model import DecoderModel

    cfg = ModelConfig.from_dict(cfg_dict)
    with torch.device("meta"):
        model = DecoderModel(cfg, max_positions)
    model.to(dtype)  # on the meta device: the weights are made in ``dtype`` (no float32 copy of 30 B parameters)
    model.to_empty(device=device)
    model.reset_buffers()
    gen = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=gen)
    return model.eval()


def decode_step_time(model, batch: int, context: int, steps: int, block_size: int = 16) -> float:
    """Seconds per decode step over ``batch`` sequences of ``context`` cached tokens (median of ``steps``)."""
    import torch

    from workers.engine.attention import AttentionMetadata, allocate_kv_cache

    cfg, device = model.cfg, next(model.parameters()).device
    per_seq = -(-(context + steps + 1) // block_size)
    kv = allocate_kv_cache(cfg.num_layers, batch * per_seq, block_size, model.num_local_kv_heads, cfg.head_dim,
                           next(model.parameters()).dtype, device)
    tables = [list(range(b * per_seq, (b + 1) * per_seq)) for b in range(batch)]
    gen = torch.Generator().manual_seed(1)
    times = []
    with torch.inference_mode():
        prompt = torch.randint(0, cfg.vocab_size, (batch * context,), generator=gen).to(device)
        meta = AttentionMetadata.build([context] * batch, [context] * batch, tables, block_size, device)
        model(prompt, torch.arange(context).repeat(batch).to(device), meta, kv)
        for i in range(steps + 2):  # two warm-up steps
            n = context + i + 1
            ids = torch.randint(0, cfg.vocab_size, (batch,), generator=gen).to(device)
            meta = AttentionMetadata.build([1] * batch, [n] * batch, tables, block_size, device)
            if device.type == "cuda":
                torch.cuda.synchronize()
            start = time.perf_counter()
            model(ids, torch.full((batch,), n - 1, device=device), meta, kv)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if i >= 2:
                times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def experts_run(model, batch: int) -> float:
    """Mean experts per sparse layer that a step over ``batch`` random tokens runs."""
    import torch

    from workers.engine.attention import AttentionMetadata, allocate_kv_cache
    from workers.engine.moe import Experts

    counts = []

    def hook(module, args, _out):
        counts.append(int(torch.unique(args[1]).numel()))

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, Experts)]
    cfg, device = model.cfg, next(model.parameters()).device
    kv = allocate_kv_cache(cfg.num_layers, batch, 16, model.num_local_kv_heads, cfg.head_dim,
                           next(model.parameters()).dtype, device)
    with torch.inference_mode():
        ids = torch.randint(0, cfg.vocab_size, (batch,), generator=torch.Generator().manual_seed(2)).to(device)
        meta = AttentionMetadata.build([1] * batch, [1] * batch, [[b] for b in range(batch)], 16, device)
        model(ids, torch.zeros(batch, dtype=torch.long, device=device), meta, kv)
    for h in handles:
        h.remove()
    return sum(counts) / max(1, len(counts))


def params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def active_params(model, experts_per_layer: float) -> float:
    """Parameters a step reads: everything but the experts it does not run (the embedding counted whole)."""
    from workers.engine.moe import Experts

    total = params(model)
    for m in model.modules():
        if isinstance(m, Experts):
            per_expert = (m.gate_up_proj.numel() + m.down_proj.numel()) / m.count
            total -= per_expert * (m.count - experts_per_layer)
    return total


def cpu(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    common = dict(vocab_size=8192, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                  head_dim=64, rms_norm_eps=1e-6, max_position_embeddings=4096, tie_word_embeddings=False)
    moe = build({**common, "model_type": "qwen3_moe", "intermediate_size": 768, "moe_intermediate_size": 384,
                 "num_experts": 16, "num_experts_per_tok": 2, "norm_topk_prob": True}, "cpu", torch.float32, 1024)
    dense = build({**common, "model_type": "qwen3", "intermediate_size": 768}, "cpu", torch.float32, 1024)
    print(f"MoE: {params(moe) / 1e6:.1f} M parameters, {active_params(moe, 2) / 1e6:.1f} M active per token; "
          f"dense: {params(dense) / 1e6:.1f} M; torch threads {args.threads}, context {args.context}, "
          f"median of {args.steps} steps")
    print(f"{'batch':>5} | {'dense ms/step':>13} | {'MoE ms/step':>11} | {'MoE / dense':>11} | "
          f"{'dense tok/s':>11} | {'MoE tok/s':>9} | experts run / layer")
    for batch in args.batches:  # alternating runs, the best median of each: a shared machine's load comes and goes
        d, m = float("inf"), float("inf")
        for _ in range(args.repeats):
            d = min(d, decode_step_time(dense, batch, args.context, args.steps))
            m = min(m, decode_step_time(moe, batch, args.context, args.steps))
        print(f"{batch:>5} | {d * 1e3:>13.2f} | {m * 1e3:>11.2f} | {m / d:>10.2f}× | {batch / d:>11.0f} | "
              f"{batch / m:>9.0f} | {experts_run(moe, batch):.1f} of 16")


def copy_bandwidth() -> float:
    """Measured device copy bandwidth, bytes/s (read + write of a 1 GiB buffer)."""
    import torch

    x = torch.empty(1 << 29, dtype=torch.bfloat16, device="cuda")
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * x.element_size() * 10 / (time.perf_counter() - start)


def set_expert_path(model, fused: bool) -> None:
    """Every sparse layer's experts through the grouped kernels (``fused``) or the per-expert loop."""
    from workers.engine.moe import SparseMoe

    for m in model.modules():
        if isinstance(m, SparseMoe):
            m.fused = fused


def expert_layer(model, batch: int, steps: int) -> tuple[float, float, float, int]:
    """One sparse layer's experts on ``batch`` random routed tokens: (loop s, kernels s, max |difference|,
    bytes of the experts the tokens were routed to), each time the median of ``steps`` calls."""
    import torch

    from workers.engine.moe import SparseMoe, route

    layer = next(m for m in model.modules() if isinstance(m, SparseMoe))
    ex = layer.experts
    device = ex.gate_up_proj.device
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(batch, model.cfg.hidden_size, generator=gen).to(device, ex.gate_up_proj.dtype)
    weights, ids = route(layer.gate(x), layer.moe)
    per_expert = (ex.gate_up_proj[0].numel() + ex.down_proj[0].numel()) * ex.gate_up_proj.element_size()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def timed(fn) -> float:
        times = []
        for i in range(steps + 3):
            sync()
            start = time.perf_counter()
            fn()
            sync()
            if i >= 3:  # three warm-up calls (the kernels compile on the first)
                times.append(time.perf_counter() - start)
        return sorted(times)[len(times) // 2]

    with torch.inference_mode():
        diff = (ex(x, ids, weights).float() - ex.forward_fused(x, ids, weights).float()).abs().max().item()
        loop = timed(lambda: ex(x, ids, weights))
        fused = timed(lambda: ex.forward_fused(x, ids, weights))
    return loop, fused, diff, int(torch.unique(ids).numel()) * per_expert


def gpu(args) -> None:
    import torch

    if not torch.cuda.is_available():
        raise SystemExit("--gpu needs CUDA")
    shape = {"model_type": "qwen3_moe", "vocab_size": 151936, "hidden_size": 2048, "num_hidden_layers": args.layers,
             "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128, "intermediate_size": 6144,
             "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
             "rms_norm_eps": 1e-6, "max_position_embeddings": 40960, "tie_word_embeddings": False}
    model = build(shape, "cuda", torch.bfloat16, 4096)
    bandwidth = copy_bandwidth()
    size = params(model) * 2
    print(f"Qwen3-30B-A3B shape, {args.layers} layers: {params(model) / 1e9:.2f} B parameters ({size / 2**30:.1f} GiB "
          f"bf16); copy bandwidth {bandwidth / 1e12:.2f} TB/s; context {args.context}")
    print(f"{'batch':>5} | {'experts':>7} | {'ms/step':>8} | {'tok/s':>8} | experts / layer | {'GB read/step':>12} | "
          f"roofline")
    for batch in args.gpu_batches:
        set_expert_path(model, False)  # the probe counts experts in the loop's forward
        run = experts_run(model, batch)
        read = active_params(model, run) * 2 - (model.cfg.vocab_size - batch) * model.cfg.hidden_size * 2
        for path in ("loop", "fused"):
            set_expert_path(model, path == "fused")
            step = decode_step_time(model, batch, args.context, args.steps)
            print(f"{batch:>5} | {path:>7} | {step * 1e3:>8.2f} | {batch / step:>8.0f} | {run:>11.1f} of 128 | "
                  f"{read / 1e9:>12.2f} | {read / step / bandwidth:>7.0%}")
    set_expert_path(model, False)
    print()
    print("one layer's experts, loop against the grouped kernels (the same routed tokens)")
    print(f"{'batch':>5} | {'loop µs':>8} | {'fused µs':>8} | speed-up | max diff | {'MB read':>7} | fused roofline")
    for batch in args.gpu_batches:
        loop, fused, diff, read = expert_layer(model, batch, args.steps)
        print(f"{batch:>5} | {loop * 1e6:>8.0f} | {fused * 1e6:>8.0f} | {loop / fused:>7.2f}× | {diff:>8.1e} | "
              f"{read / 1e6:>7.1f} | {read / fused / bandwidth:>7.0%}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", action="store_true", help="the Qwen3-30B-A3B shape on CUDA")
    parser.add_argument("--threads", type=int, default=1, help="CPU: torch threads")
    parser.add_argument("--steps", type=int, default=20, help="decode steps timed per batch size (median)")
    parser.add_argument("--context", type=int, default=128, help="tokens cached per sequence")
    parser.add_argument("--repeats", type=int, default=3, help="CPU: alternating runs per model (the best median)")
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 16], help="CPU batch sizes")
    parser.add_argument("--gpu-batches", type=int, nargs="+", default=[1, 16, 64], help="GPU batch sizes")
    parser.add_argument("--layers", type=int, default=48, help="GPU: layers of the 48")
    args = parser.parse_args(argv)
    gpu(args) if args.gpu else cpu(args)


if __name__ == "__main__":
    main()
