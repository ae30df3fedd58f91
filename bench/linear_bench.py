"""CPU linear layers at decode shapes: torch's default matmul against the engine's ``Linear``.

Usage: .venv/bin/python bench/linear_bench.py [--rows 1,2,5,16,64] [--threads 2]

For each weight shape of SmolLM2-135M (random weights, float32) and each number of rows (1 per
sequence per decode step, γ+1 for a verify step, 16 for a batch of 16) it times ``F.linear``
(torch's default CPU path, MKL sgemm — what transformers runs) and ``workers.engine.layers.Linear``
(oneDNN over weights packed once), in the same process. The second table runs a whole model's
worth of distinct weights in order, so that they stream from memory as in a real decode step.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# (name, out_features, in_features, times per step) for SmolLM2-135M: 30 layers + LM head
SHAPES = [("qkv", 960, 576, 30), ("o", 576, 576, 30), ("gate_up", 3072, 576, 30), ("down", 576, 1536, 30),
          ("lm_head", 49152, 576, 1)]


def time_us(fn, reps: int) -> float:
    for _ in range(5):
        fn()
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - start) / reps * 1e6)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,2,5,16,64")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import torch
    import torch.nn.functional as F

    from workers.engine.layers import Linear

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    print("One weight per shape, timed alone (it stays in cache between calls):\n")
    print("| weight (out × in) | rows | torch `F.linear` µs | engine `Linear` µs | speedup |")
    print("|---|---|---|---|---|")
    for name, out_f, in_f, _ in SHAPES:
        layer = Linear(in_f, out_f, bias=False)
        with torch.inference_mode():
            for r in rows:
                x = torch.randn(r, in_f)
                torch.testing.assert_close(layer(x), F.linear(x, layer.weight), rtol=1e-4, atol=1e-3)
                reps = max(3, int(20_000 / (out_f * in_f / 1e5 * (1 + r / 8))))
                base = time_us(lambda: F.linear(x, layer.weight), reps)
                ours = time_us(lambda: layer(x), reps)
                print(f"| {name} {out_f} × {in_f} | {r} | {base:.0f} | {ours:.0f} | {base / ours:.2f}× |")

    # A whole model's worth of distinct weights, in order: they stream from memory as in a real step.
    model = [Linear(in_f, out_f, bias=False) for _, out_f, in_f, n in SHAPES for _ in range(n)]
    print("\nAll matmuls of one SmolLM2 step (30 layers' distinct weights + the LM head, 134M weights):\n")
    print("| rows | torch ms | engine ms | speedup | engine ms / engine ms at 1 row |")
    print("|---|---|---|---|---|")
    one = None
    with torch.inference_mode():
        for r in rows:
            xs = {in_f: torch.randn(r, in_f) for _, _, in_f, _ in SHAPES}
            base = time_us(lambda: [F.linear(xs[m.in_features], m.weight) for m in model], 3) / 1e3
            ours = time_us(lambda: [m(xs[m.in_features]) for m in model], 3) / 1e3
            one = one or ours
            print(f"| {r} | {base:.1f} | {ours:.1f} | {base / ours:.2f}× | {ours / one:.2f} |")


if __name__ == "__main__":
    main()
