"""What a verify step costs around the forward pass: the engine step with drafts, at batch 1 and 16.

Usage: .venv/bin/python bench/verify_bench.py [--repeats 30] [--vocab 49152]

A tiny random Llama with the demo model's vocabulary (so the forward pass is cheap and the work
that scales with batch × vocabulary — distributions, rejection sampling, commits — shows), γ = 4
chains from an oracle (the target's own greedy continuation with every third draft token wrong),
greedy and sampled (temperature 0.8) requests. Reports milliseconds per engine step (median of
``--repeats`` steps after warm-up) at batch 1 and 16. Runs on this tree's engine and on a tree
from before the one-step engine (``SpecEngine``), so the two can be timed side by side.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path.cwd()
sys.path.insert(0, str(ROOT))


def build(vocab: int):
    # bench/common.py beside this script (the tree timed, ROOT, may be one from before it existed)
    from common import random_decoder
    from workers.engine.engine import EngineConfig

    try:
        from workers.target.spec_engine import SpecEngine as Engine  # before the one-step engine
    except ImportError:
        from workers.engine.engine import Engine
    cfg = EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=32, max_num_batched_tokens=2048)
    return Engine(random_decoder(vocab, 1024), cfg, eos_token_ids=(), num_speculative_tokens=4, adaptive=False)


def measure(batch: int, temperature: float, vocab: int, repeats: int) -> float:
    import torch

    from runtime.messages import SamplingParams
    from workers.speculation.payloads import DraftOutput

    torch.set_num_threads(1)
    reference = build(vocab)
    params = SamplingParams(temperature=0, max_tokens=repeats * 5 + 40, ignore_eos=True)
    prompts = {f"r{i}": [(7 * i + j) % vocab for j in range(24)] for i in range(batch)}
    want = reference.generate(prompts, params)
    engine = build(vocab)
    run = SamplingParams(temperature=temperature, max_tokens=params.max_tokens, ignore_eos=True, seed=1)
    for rid, p in prompts.items():
        engine.add_request(rid, p, run)
    got = {rid: 0 for rid in prompts}
    times = []
    step = 0
    while engine.has_work() and len(times) < repeats + 5:
        proposals = {}
        for inp in engine.draft_inputs():
            done = got[inp.seq_id]
            draft = list(want[inp.seq_id][done : done + inp.num_speculative_tokens])
            if draft and step % 3 == 0:
                draft[-1] = (draft[-1] + 1) % vocab
            proposals[inp.seq_id] = DraftOutput(inp.seq_id, inp.round, draft)
        started = time.perf_counter()
        out = engine.step(proposals)
        elapsed = time.perf_counter() - started
        if proposals and len(proposals) == batch:
            times.append(elapsed)
        for rid, delta in out:
            got[rid] += len(delta.token_ids)
        engine.take_verdicts()
        step += 1
    return 1e3 * statistics.median(times[5:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    args = ap.parse_args()
    print("| batch | greedy ms/step | sampled ms/step |")
    print("|---|---|---|")
    for batch in (1, 16):
        greedy = measure(batch, 0.0, args.vocab, args.repeats)
        sampled = measure(batch, 0.8, args.vocab, args.repeats)
        print(f"| {batch} | {greedy:.2f} | {sampled:.2f} |", flush=True)


if __name__ == "__main__":
    main()
