"""What torch's CPU threading costs a small model's steps: a plain decode step and a verify step of
the tiny target under each OpenMP wait setting, and the greedy argmax over a vocabulary.

Usage: .venv/bin/python bench/cpu_threads_bench.py [--steps 200] [--threads 2] [--argmax]

The engine is ``bench/served_bench.py``'s tiny target (a random 2-layer Llama, hidden 64, the demo
vocabulary), greedy, batch 1, built with the target worker's config. Each setting runs in a fresh
process, since OpenMP reads its environment once when torch loads:

- ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` (the target worker's default until 2026-11-26);
- ``spin``: ``GOMP_SPINCOUNT=10000`` (the target worker's default now, :mod:`workers.openmp`);
- ``spin-two-threads``: the same, with the engine built on one thread and stepped on another, as
  the target worker did before (two OpenMP teams);
- ``active``: ``OMP_WAIT_POLICY=ACTIVE``;
- ``one-thread``: one intra-op thread, ``passive``.

Per setting: the median wall time of a plain step (no proposal), and of a verify step whose 4
drafted tokens are the target's own greedy continuation (all accepted), over ``--steps`` steps of
one request each. ``--argmax`` adds torch's argmax against :func:`workers.engine.sampling.argmax_rows`
over 1, 5, 8 and 40 rows of 49,152 scores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

SETTINGS = {
    "passive": ({"OMP_WAIT_POLICY": "PASSIVE"}, False, None),
    "spin": ({"GOMP_SPINCOUNT": "10000"}, False, None),
    "spin-two-threads": ({"GOMP_SPINCOUNT": "10000"}, True, None),
    "active": ({"OMP_WAIT_POLICY": "ACTIVE"}, False, None),
    "one-thread": ({"OMP_WAIT_POLICY": "PASSIVE"}, False, 1),
}
DRAFTED = 4


def measure(steps: int, threads: int, two_threads: bool) -> dict:
    """Child mode: plain and verify step times of the tiny target, in ms."""
    from concurrent.futures import ThreadPoolExecutor

    from bench.served_bench import tiny_target
    from runtime.messages import SamplingParams
    from workers.engine.build import build_engine
    from workers.speculation.payloads import DraftOutput
    from workers.engine.target_config import TargetConfig

    cfg = TargetConfig(model=str(tiny_target()), served_model_name="bench", threads=threads,
                       spec={"hidden_layers": "none", "load_aware": False})
    engine = build_engine(cfg, "bench")  # on this thread; stepped here too unless two_threads
    prompt = list(range(1000, 1020))
    params = SamplingParams(temperature=0, max_tokens=steps * (DRAFTED + 1) + 10, ignore_eos=True)
    ref = engine.generate({"ref": prompt}, params)["ref"]

    def run(verify: bool) -> float:
        rid = f"{'verify' if verify else 'plain'}-{time.perf_counter()}"
        engine.add_request(rid, prompt, params)
        engine.spec.draft_id = "bench"
        times = []
        for _ in range(steps):
            proposals = {}
            for r in engine.draft_inputs((), None):
                done = len(engine.seqs[r.seq_id].token_ids) - len(prompt)
                tokens = ref[done : done + DRAFTED] if verify else []
                proposals[r.seq_id] = DraftOutput(r.seq_id, r.round, tokens, [], [])
            started = time.perf_counter()
            engine.step(proposals)
            times.append(time.perf_counter() - started)
        engine.abort(rid)
        engine.step({})
        return 1e3 * statistics.median(times[10:])

    def both() -> dict:
        both = [(run(False), run(True)) for _ in range(2)]  # the second pair, warm
        return {"plain_ms": both[1][0], "verify_ms": both[1][1]}

    if two_threads:
        with ThreadPoolExecutor(1) as other:
            return other.submit(both).result()
    return both()


def argmax_table() -> list[dict]:
    import torch

    from workers.engine.sampling import argmax_rows

    def timed(fn, n: int = 300) -> float:
        for _ in range(20):
            fn()
        started = time.perf_counter()
        for _ in range(n):
            fn()
        return 1e6 * (time.perf_counter() - started) / n

    out = []
    for rows in (1, 5, 8, 40):
        x = torch.randn(rows, 49152)
        out.append({"rows": rows, "torch_us": timed(lambda: x.argmax(-1)), "blocked_us": timed(lambda: argmax_rows(x))})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--argmax", action="store_true", help="also time the greedy argmax")
    ap.add_argument("--child", nargs=2, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        threads, two = int(args.child[0]), args.child[1] == "1"
        print(json.dumps(measure(args.steps, threads, two)))
        return
    base = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    print("| setting | plain step ms | verify step ms (4 drafted, accepted) |\n|---|---|---|")
    for name, (env, two, threads) in SETTINGS.items():
        out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps),
                              "--child", str(threads or args.threads), "1" if two else "0"],
                             env={**base, **env}, capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"| {name} | {r['plain_ms']:.2f} | {r['verify_ms']:.2f} |", flush=True)
    if args.argmax:
        import torch

        torch.set_num_threads(args.threads)
        print("\n| rows | torch argmax µs | blocked µs |\n|---|---|---|")
        for r in argmax_table():
            print(f"| {r['rows']} | {r['torch_us']:.0f} | {r['blocked_us']:.0f} |")


if __name__ == "__main__":
    main()
