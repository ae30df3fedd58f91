"""Token trees against chains at the same verify budget: accepted length and speed, in one run.

Usage: .venv/bin/python bench/tree_bench.py HEAD_DIR [--prompt-set generator|natural] [--prompts 8] [--max-tokens 48]
       [--budgets 2,4,6,8,12,16] [--trees 4:4,8:8] [--ngram] [--batch 1] [--temperature 0] [--adaptive]
       [--out docs/tree_budget.svg]

In one process (CPU, float32): the demo target (SmolLM2-135M) with the trained EAGLE-3 head HEAD_DIR
(``tandem train-draft``), on held-out prompts: ``generator`` (the default) = the train-draft
generator under a seed no training run uses; ``natural`` = the first ``--prompts`` hand-written chat
prompts of ``bench/prompts/natural_chat.jsonl`` (replies run to ``--max-tokens`` either way). For
every node budget N (draft tokens the target verifies per pass) it runs the chain (γ = N, top-k 1)
and a tree per ``--trees`` shape K:D (top-k K, depth ``min(N, D)``, the N best nodes), γ fixed (no
adaptation; ``--adaptive``: the target's default adaptive γ and tree budgets, N the cap), with plain
decoding re-measured before every row so each speedup is a side-by-side ratio. Every output must
equal plain decoding token for token (greedy; ``--temperature T`` samples instead, seeded per
request, and the equal column counts nothing: sampled outputs agree with plain decoding in
distribution, which the χ² tests check). ``--ngram`` adds prompt-lookup rows (chain vs trie of
every earlier occurrence). Prints a markdown table; ``--out`` plots accepted length against the node
budget.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def run(engine, proposer, prompts: dict[str, list[int]], params, batch: int) -> tuple[dict, float]:
    """Generate every prompt, ``batch`` requests in flight at a time; (outputs, seconds)."""
    out: dict[str, list[int]] = {rid: [] for rid in prompts}
    items = list(prompts.items())
    started = time.perf_counter()
    for i in range(0, len(items), batch):
        for rid, tokens in items[i : i + batch]:
            engine.add_request(rid, tokens, params)
        while engine.has_work():
            inputs = engine.draft_inputs() if proposer is not None else []
            proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
            for rid, delta in engine.step(proposals) if proposer is not None else engine.step():
                out[rid].extend(delta.token_ids)
            if proposer is not None:
                proposer.verified(engine.take_verdicts())
                proposer.release(engine.take_released())
    return out, time.perf_counter() - started


def write_svg(path: Path, series: dict[str, list[tuple[int, float]]]) -> None:
    """Accepted length (tokens per verify pass) against the node budget, one line per setup."""
    width, height, pad = 560, 340, 50
    xs = [x for pts in series.values() for x, _ in pts]
    ys = [y for pts in series.values() for _, y in pts]
    x_max, y_max = max(xs), max(ys) * 1.1

    def xy(x: float, y: float) -> tuple[float, float]:
        return pad + (x / x_max) * (width - 2 * pad), height - pad - (y - 1) / (y_max - 1) * (height - 2 * pad)

    colors = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b"]
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<line x1="{pad}" y1="{height - pad}" x2="{width - pad}" y2="{height - pad}" stroke="black"/>',
             f'<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{height - pad}" stroke="black"/>',
             f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">node budget (draft tokens verified per pass)</text>',
             f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">'
             f'accepted length (tokens per pass)</text>']
    for x in sorted(set(xs)):
        px, _ = xy(x, 1)
        parts.append(f'<text x="{px}" y="{height - pad + 16}" text-anchor="middle">{x}</text>')
    for i in range(5):
        y = 1 + (y_max - 1) * i / 4
        _, py = xy(0, y)
        parts.append(f'<text x="{pad - 6}" y="{py + 4}" text-anchor="end">{y:.2f}</text>')
    for (name, pts), color in zip(series.items(), colors):
        pts = sorted(pts)
        line = " ".join(f"{xy(x, y)[0]:.1f},{xy(x, y)[1]:.1f}" for x, y in pts)
        parts.append(f'<polyline points="{line}" fill="none" stroke="{color}" stroke-width="2"/>')
        for x, y in pts:
            px, py = xy(x, y)
            parts.append(f'<circle cx="{px:.1f}" cy="{py:.1f}" r="3" fill="{color}"/>')
        idx = list(series).index(name)
        parts.append(f'<text x="{pad + 10}" y="{pad + 14 * idx}" fill="{color}">{name}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("head")
    ap.add_argument("--prompt-set", choices=["generator", "natural"], default="generator")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--budgets", type=lambda s: [int(x) for x in s.split(",")], default=[2, 4, 6, 8, 12, 16])
    ap.add_argument("--trees", default="4:4", help="tree shapes top-k:depth, comma separated")
    ap.add_argument("--ngram", action="store_true", help="also prompt-lookup chains and tries")
    ap.add_argument("--batch", type=int, default=1, help="requests in flight")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0, help="0: greedy (outputs compared)")
    ap.add_argument("--adaptive", action="store_true", help="adaptive γ / node budgets (the target's default)")
    ap.add_argument("--out", default=None, help="SVG of accepted length against the node budget")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from bench.natural import natural_prompt_ids
    from runtime.messages import SamplingParams
    from runtime.spec_stats import mean_accepted_length
    from workers.demo_model import demo_model_dir
    from workers.draft.eagle import load_eagle, load_target_parts
    from workers.draft.eagle_proposer import EagleProposer
    from workers.draft.ngram import NgramProposer
    from workers.draft.train.prompts import held_out_prompts
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model

    torch.set_num_threads(args.threads)
    target = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(target)
    if args.prompt_set == "natural":
        prompts = {f"n{i}": p for i, p in enumerate(natural_prompt_ids(tok, args.prompts))}
    else:
        prompts = held_out_prompts(tok, args.prompts)
    model = load_model(target)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, ignore_eos=True, seed=0)
    cfg = EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=max(8, args.batch))
    embed, lm_head, target_cfg = load_target_parts(target)
    head, layers = load_eagle(args.head, embed, lm_head, target_cfg, 2048)
    want, _ = run(Engine(model, cfg), None, prompts, params, args.batch)  # warm-up and the reference
    total = sum(len(v) for v in want.values())

    shapes = [tuple(int(x) for x in shape.split(":")) for shape in args.trees.split(",")]
    setups = []  # (method, shape, budget, proposer factory, hidden layers)
    for n in args.budgets:
        setups.append(("eagle3", "chain", n, lambda: EagleProposer(head, layers, 2048, 16), layers))
        for k, d in shapes:
            setups.append(("eagle3", f"tree top-{k} depth {d}", n,
                           lambda n=n, k=k, d=d: EagleProposer(head, layers, 2048, 16, tree_topk=k,
                                                               tree_depth=min(n, d)), layers))
        if args.ngram:
            setups.append(("ngram", "chain", n, lambda: NgramProposer(1, 4), []))
            for k, d in shapes:
                setups.append(("ngram", f"tree top-{k}", n,
                               lambda k=k: NgramProposer(1, 4, tree_topk=k), []))
    mode = "greedy" if args.temperature == 0 else f"temperature {args.temperature}"
    print(f"{len(prompts)} held-out {args.prompt_set} prompts x {args.max_tokens} tokens, {mode}, {args.batch} in flight, "
          f"{args.threads} threads\n")
    print("| draft | shape | node budget | accepted length | tokens/s | plain tokens/s (just before) | speedup | equal |")
    print("|---|---|---|---|---|---|---|---|")
    series: dict[str, list[tuple[int, float]]] = {}
    for method, shape, n, factory, hidden in setups:
        _, plain_s = run(Engine(model, cfg), None, prompts, params, args.batch)
        engine = Engine(model, cfg, num_speculative_tokens=n, hidden_layers=tuple(hidden), adaptive=args.adaptive)
        got, seconds = run(engine, factory(), prompts, params, args.batch)
        c = engine.counters.get("")
        length = (mean_accepted_length(c.num_accepted_tokens, c.num_drafts) if c else None) or 1.0
        equal = f"{sum(got[k] == want[k] for k in prompts)}/{len(prompts)}" if args.temperature == 0 else "-"
        series.setdefault(f"{method} {shape}", []).append((n, length))
        print(f"| {method} | {shape} | {n} | {length:.2f} | {total / seconds:.1f} | {total / plain_s:.1f} | "
              f"{plain_s / seconds:.2f}x | {equal} |", flush=True)
    if args.out:
        write_svg(Path(args.out), series)
        print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()
