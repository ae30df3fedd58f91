"""Speculation across load: tokens/s, TTFT, ITL and request latency at concurrency 1 … 32, with
speculation off, fixed, adaptive, and the default (load-aware with the adaptive rule inside it), side
by side in one run.

Usage: .venv/bin/python bench/load_sweep.py [--concurrency 1,2,4,8,16,32] [--max-tokens 48] [--gamma N]
       [--modes off,default] [--draft eagle3|ngram|suffix] [--prompt-set natural|topics] [--repeats 4]
       [--per-slot 3] [--min-requests 12]
       [--out docs/load_sweep.svg]

The demo target (SmolLM2-135M) and a draft worker (default: the bundled EAGLE-3 head, ``make run``'s)
run as real processes over etcd, NATS and gRPC, one pair per mode in its own namespace (so every mode
has its own warm target): ``default`` runs the target with no speculation flags (``make run``'s
settings), ``adaptive`` ``--speculative-config '{"load_aware": false}'``, ``fixed`` that and
``"adaptive": false``; ``off`` is the default target with γ = 0 per request (its draft worker
sits idle). Prompts: ``natural`` = the hand-written chat prompts of ``bench/prompts/natural_chat.jsonl``
(not the train-draft generator's), ``topics`` = "Explain X in a short paragraph." for 16 topics. At
each concurrency c every mode in turn serves
max(3c, 12) chat requests (``--per-slot``, ``--min-requests``; greedy, ``--max-tokens`` each) with c
in flight, so a slow spell of this shared machine hits all modes alike; each concurrency runs
``--repeats`` rounds (4), the modes in a rotated order each round, and a mode's figure is its tokens
over its time summed over all rounds, relative to ``off``'s (the per-round ratios' min–max beside it shows the noise). Every output must equal the ``off`` output for the same prompt.
``--draft eagle3`` drafts with the bundled EAGLE-3 head instead of n-grams. ``off_again`` is ``off``
run a second time each round (an A/A control): its spread around 1.00 is the machine's noise floor.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.natural import natural_prompt_ids  # noqa: E402
from runtime import Runtime, RuntimeConfig  # noqa: E402
from runtime.messages import GenerateRequest, SamplingParams, TokenDelta  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, start_servers  # noqa: E402

TOPICS = ["the water cycle", "how vaccines work", "the history of the printing press", "compound interest",
          "why the sky is blue", "how a bill becomes law", "photosynthesis", "the rules of basketball",
          "how GPS finds your position", "the causes of the first world war", "how a CPU cache works",
          "what inflation is", "how bread rises", "the life cycle of a star", "how to write a cover letter",
          "how noise-cancelling headphones work"]
MODES = {"off": ("default", 0), "fixed": ("fixed", None), "adaptive": ("adaptive", None),
         "default": ("default", None), "load_aware": ("default", None),  # load_aware: the default's old name
         "off_again": ("default", 0)}  # an A/A control: "off" run twice, so the table shows the noise floor
TARGET_FLAGS = {"fixed": ["--speculative-config", '{"adaptive": false, "load_aware": false}'],
                "adaptive": ["--speculative-config", '{"load_aware": false}'], "default": []}


def chat_prompts(tok, prompt_set: str) -> list[list[int]]:
    """Token ids of the chat prompts of ``prompt_set`` (natural: hand-written; topics: one template)."""
    if prompt_set == "natural":
        return natural_prompt_ids(tok)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"Explain {t} in a short paragraph."}],
                                     add_generation_prompt=True, tokenize=False) for t in TOPICS]
    return [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]


async def serve(rt: Runtime, prompts: list[list[int]], concurrency: int, max_tokens: int, gamma: int | None) -> dict:
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=120)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    gate = asyncio.Semaphore(concurrency)
    ttft, itl, latency, outputs = [], [], [], {}
    spec = {"drafts": 0, "accepted": 0, "plain": {}}  # summed over the requests' usage.spec

    async def one(i: int, prompt: list[int]) -> None:
        async with gate:
            started = last = time.perf_counter()
            tokens: list[int] = []
            async for delta in await client.call(inst.instance_id, GenerateRequest(
                    prompt, params, num_speculative_tokens=gamma), TokenDelta):
                if delta.usage is not None and delta.usage.spec is not None:
                    u = delta.usage.spec
                    spec["drafts"] += u.num_drafts
                    spec["accepted"] += u.num_accepted_tokens
                    for why, n in u.plain_steps.items():
                        spec["plain"][why] = spec["plain"].get(why, 0) + n
                if not delta.token_ids:
                    continue
                now = time.perf_counter()
                if not tokens:
                    ttft.append(now - started)
                else:  # a delta of n tokens after a gap g: n tokens of g / n each
                    itl.extend([(now - last) / len(delta.token_ids)] * len(delta.token_ids))
                tokens.extend(delta.token_ids)
                last = now
            latency.append(time.perf_counter() - started)
            outputs[i] = tokens

    started = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - started
    pct = lambda xs, q: statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]  # noqa: E731
    tokens = sum(len(o) for o in outputs.values())
    return {"tokens": tokens, "wall": wall, "tokens_per_s": tokens / wall, "ttft_p50": statistics.median(ttft),
            "itl_p50": statistics.median(itl), "lat_p50": statistics.median(latency), "lat_p99": pct(latency, 99),
            "outputs": outputs, "spec": spec}


def draft_args(method: str, target: Path) -> list[str]:
    if method == "eagle3":  # the head that ships with the demo model
        from workers.demo_model import demo_head_dir

        return ["--method", "eagle3", "--eagle-model", str(demo_head_dir()), "--target-model", str(target)]
    return ["--method", method]


def write_svg(path: Path, levels: list[int], results: dict[str, list[float]]) -> None:
    """tokens/s relative to speculation off, per mode, against concurrency (log scale)."""
    import math

    width, height, pad = 560, 340, 55
    ys = [v for vals in results.values() for v in vals]
    y_lo, y_hi = min(ys + [1.0]) * 0.95, max(ys + [1.0]) * 1.05

    def xy(i: int, y: float) -> tuple[float, float]:
        x = pad + (math.log2(levels[i]) / max(math.log2(levels[-1]), 1)) * (width - 2 * pad)
        return x, height - pad - (y - y_lo) / (y_hi - y_lo) * (height - 2 * pad)

    colors = {"off": "#7f7f7f", "fixed": "#d62728", "adaptive": "#1f77b4", "default": "#2ca02c",
              "load_aware": "#2ca02c", "off_again": "#bcbd22"}
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
             f'font-size="12"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{width / 2}" y="{height - 12}" text-anchor="middle">concurrent requests</text>',
             f'<text x="14" y="{height / 2}" transform="rotate(-90 14 {height / 2})" text-anchor="middle">'
             f'tokens/s relative to speculation off</text>']
    for i, c in enumerate(levels):
        x, _ = xy(i, y_lo)
        parts.append(f'<text x="{x:.1f}" y="{height - pad + 16}" text-anchor="middle">{c}</text>')
    for k in range(5):
        y = y_lo + (y_hi - y_lo) * k / 4
        _, py = xy(0, y)
        parts.append(f'<text x="{pad - 6}" y="{py + 4:.1f}" text-anchor="end">{y:.2f}</text>')
        parts.append(f'<line x1="{pad}" y1="{py:.1f}" x2="{width - pad}" y2="{py:.1f}" stroke="#eee"/>')
    for n, (mode, vals) in enumerate(results.items()):
        pts = " ".join(f"{xy(i, v)[0]:.1f},{xy(i, v)[1]:.1f}" for i, v in enumerate(vals))
        color = colors.get(mode, "#000")
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts.append(f'<text x="{width - pad - 90}" y="{pad + 14 * n}" fill="{color}">{mode}</text>')
    parts.append("</svg>")
    path.write_text("\n".join(parts))


async def amain(args) -> None:
    from transformers import AutoTokenizer

    from workers.demo_model import demo_model_dir

    target = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(target)
    all_prompts = chat_prompts(tok, args.prompt_set)
    etcd, nats_server = start_servers()
    procs, runtimes = [], {}
    kinds = sorted({MODES[m][0] for m in args.modes})
    stack = contextlib.AsyncExitStack()
    try:
        for kind in kinds:
            env = env_for(etcd, nats_server, f"sweep-{kind}")
            procs.append(ManagedProcess("workers.target", [
                "--model", str(target), *(["--num-speculative-tokens", str(args.gamma)] if args.gamma else []),
                "--max-num-seqs", "64", *TARGET_FLAGS[kind]], env, name=f"target-{kind}").start())
            procs.append(ManagedProcess("workers.draft", draft_args(args.draft, target), env,
                                        name=f"draft-{kind}").start())
            cfg = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_server.url, namespace=f"sweep-{kind}",
                                handle_signals=False)
            runtimes[kind] = await stack.enter_async_context(Runtime.connect(cfg))
            drafts = await runtimes[kind].client("draft", "speculate")
            await drafts.wait_for_instances(1, timeout=120)
            await serve(runtimes[kind], all_prompts[:2], 2, 8, None)  # warm-up: opens the draft stream
        print(f"{args.draft} draft, γ = {args.gamma or 'the target default'}, {args.prompt_set} prompts, "
              f"{args.max_tokens} tokens per request, greedy\n", flush=True)
        print("| concurrency | mode | tokens/s (all rounds) | vs off (all rounds) | min–max over rounds | TTFT p50 (s) | "
              "ITL p50 (ms) | latency p50 (s) | p99 (s) |")
        print("|---|---|---|---|---|---|---|---|---|")
        relative: dict[str, list[float]] = {m: [] for m in args.modes}
        for c in args.concurrency:
            n = max(args.per_slot * c, args.min_requests)
            prompts = [all_prompts[i % len(all_prompts)] for i in range(n)]
            rounds: list[dict[str, dict]] = []
            for rep in range(args.repeats):
                rows = {}
                shift = rep % len(args.modes)
                for mode in args.modes[shift:] + args.modes[:shift]:  # rotated: no mode always runs first
                    kind, gamma = MODES[mode]
                    rows[mode] = await serve(runtimes[kind], prompts, c, args.max_tokens, gamma)
                base = rows["off"] if "off" in rows else rows[args.modes[0]]
                for mode, r in rows.items():
                    assert r["outputs"] == base["outputs"], f"{mode} output differs from speculation off at c={c}"
                    r["ratio"] = r["tokens_per_s"] / base["tokens_per_s"]
                rounds.append(rows)
                for mode, r in rows.items():  # what speculation did, for the log (stderr)
                    sp = r["spec"]
                    if sp["drafts"] or sp["plain"]:
                        why = ", ".join(f"{k} {v}" for k, v in sorted(sp["plain"].items(), key=lambda kv: -kv[1]))
                        print(f"  c={c} round {rep + 1} {mode}: {r['ratio']:.2f}x, {sp['drafts']} drafts, "
                              f"{sp['accepted']} accepted, plain steps: {why or 'none'}", file=sys.stderr, flush=True)
            base_mode = "off" if "off" in args.modes else args.modes[0]
            pooled = {m: sum(x[m]["tokens"] for x in rounds) / sum(x[m]["wall"] for x in rounds) for m in args.modes}
            for mode in args.modes:
                ratios = [rows[mode]["ratio"] for rows in rounds]
                relative[mode].append(pooled[mode] / pooled[base_mode])
                r = rounds[-1][mode]
                print(f"| {c} | {mode} | {pooled[mode]:.1f} | "
                      f"{relative[mode][-1]:.2f}x | {min(ratios):.2f}–{max(ratios):.2f} | {r['ttft_p50']:.2f} | "
                      f"{r['itl_p50'] * 1000:.0f} | {r['lat_p50']:.2f} | {r['lat_p99']:.2f} |", flush=True)
        if args.out:
            write_svg(Path(args.out), args.concurrency, relative)
            print(f"\nplot: {args.out}")
    finally:
        await stack.aclose()
        for p in procs:
            p.stop()
        etcd.stop()
        nats_server.stop()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", type=lambda s: [int(x) for x in s.split(",")], default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=0, help="the target's --num-speculative-tokens (0: its default)")
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["off", "default"],
                    help=f"comma list of {', '.join(MODES)}")
    ap.add_argument("--draft", default="eagle3",
                    help="draft method: eagle3 (the bundled head, make run's), ngram (no model), or suffix")
    ap.add_argument("--prompt-set", choices=["natural", "topics"], default="natural")
    ap.add_argument("--repeats", type=int, default=4,
                    help="rounds per concurrency, modes rotated; the ratio is over all rounds' tokens and time")
    ap.add_argument("--per-slot", type=int, default=3, help="requests per point: max(per-slot × c, min-requests)")
    ap.add_argument("--min-requests", type=int, default=12)
    ap.add_argument("--out", default=None, help="SVG: tokens/s relative to speculation off, per mode")
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    main()
