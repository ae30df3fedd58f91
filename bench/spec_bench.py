"""Speculative-decoding benchmark: plain decoding, our disaggregated speculation, and transformers'
assisted generation on the same prompts, greedy, batch 1, in one run.

Usage: .venv/bin/python bench/spec_bench.py [--prompts 6] [--max-tokens 48] [--gamma 4] [--draft-layers 6]
       [--sweep 0,0.1,0.3,0.5,0.7] [--costed-sweep 0,0.1,0.3] [--cost 0.25] [--out docs/spec_sweep.svg]

Target: SmolLM2-135M-Instruct (the bundled demo). Draft: the same model truncated to its first
``--draft-layers`` layers (same tokenizer and LM head), built once into the cache; transformers'
``generate(assistant_model=...)`` uses the very same pair. Our target and draft run as separate
processes over real etcd, NATS and gRPC. A sweep with the oracle draft (the target's own greedy
continuation with a set error rate, c ≈ 0) traces achieved speedup against acceptance α, next to the
ideal (1 − α^(γ+1)) / ((1 − α)(γc + 1)). The same oracle with an emulated draft cost (``--cost`` of a
plain decode step per drafted token, spent as a sleep as if the draft ran on its own device) shows
what drafting ahead (overlap) buys against the no-overlap ideal.

Speedups are given end to end (tokens / request time, prefill included — what a client sees, and how
transformers is compared) and for the decode phase (tokens after the first / time from the first
token to the last), the phase the ideal formula models: speculation cannot speed up the prefill, so
with short outputs the end-to-end ratio sits below the ideal even when every round is perfect.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import Runtime, RuntimeConfig  # noqa: E402
from runtime.messages import GenerateRequest, SamplingParams, TokenDelta  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, start_servers  # noqa: E402

PROMPTS = [
    "Explain what a key-value cache is in a transformer, in three sentences.",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "List the planets of the solar system in order from the sun, one per line.",
    "What is speculative decoding? Answer briefly.",
    "Translate to French: The cat sits on the mat and looks at the garden.",
    "Give three tips for writing clear technical documentation.",
    "Summarise the rules of chess in a short paragraph.",
    "Write a haiku about distributed systems.",
]


# Prompts no training conversation of `tandem train-draft` uses (its generator's templates and topics
# differ): the set for rows with a trained head.
HELD_OUT_PROMPTS = [
    "Describe how a refrigerator keeps food cold.",
    "What should I pack for a weekend hiking trip in the mountains?",
    "Write a limerick about a forgetful robot.",
    "Explain the difference between weather and climate.",
    "Suggest a name and a slogan for a small neighbourhood bakery.",
    "How do I politely decline a meeting invitation? Give an example reply.",
    "What are the main causes of traffic congestion in big cities?",
    "Tell me how to make a cup of green tea properly.",
]


def ideal_speedup(alpha: float, gamma: int, c: float) -> float:
    if alpha >= 1.0:
        return (gamma + 1) / (gamma * c + 1)
    return (1 - alpha ** (gamma + 1)) / ((1 - alpha) * (gamma * c + 1))


def fit_alpha(mean_len: float, gamma: int) -> float:
    """The per-token acceptance α of the i.i.d. model behind the ideal formula, from the measured mean
    number of tokens a decode step yields: solves (1 − α^(γ+1)) / (1 − α) = mean_len by bisection.

    (Accepted / drafted tokens is not that α: drafts after the first rejection count as drafted but
    never had a chance, so it understates α and, put into the formula, understates the ideal.)
    """
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if sum(mid ** i for i in range(gamma + 1)) < mean_len:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def build_draft(target: Path, layers: int) -> Path:
    """The target truncated to its first ``layers`` layers, as a model directory (cached)."""
    from safetensors.torch import load_file, save_file

    from runtime.config import cache_dir

    out = cache_dir() / f"smollm2-135m-first{layers}"
    if (out / "model.safetensors").exists():
        return out
    out.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    state = {k: v for k, v in load_file(str(target / "model.safetensors")).items()
             if not k.startswith("model.layers.") or int(k.split(".")[2]) < layers}
    save_file(state, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    for f in target.iterdir():
        if f.name.startswith("tokenizer") or f.name.endswith(".jinja"):
            (out / f.name).write_bytes(f.read_bytes())
    return out


def measure_cost_ratio(target: Path, draft: Path, steps: int = 40) -> float:
    """c = draft decode time per token / target decode time per token (our engine, batch 1)."""
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model

    def per_token(path: Path) -> float:
        engine = Engine(load_model(path), EngineConfig(num_blocks=256))
        params = SamplingParams(temperature=0, max_tokens=steps, ignore_eos=True)
        engine.generate({"w": [1, 2, 3, 4]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
        t = time.perf_counter()
        engine.generate({"m": list(range(10, 40))}, params)
        return (time.perf_counter() - t) / steps

    return per_token(draft) / per_token(target)


async def run_requests(rt: Runtime, prompts: list[list[int]], max_tokens: int, gamma: int | None) -> dict:
    return (await run_interleaved(rt, prompts, max_tokens, [gamma]))[0]


async def run_interleaved(rt: Runtime, prompts: list[list[int]], max_tokens: int, gammas: list[int | None]) -> list[dict]:
    """Each prompt under each γ in turn (so that a slow spell of this shared machine hits all alike);
    one result per γ."""
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=120)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    acc = [{"outputs": [], "drafts": 0, "draft_tokens": 0, "accepted": 0, "elapsed": 0.0, "decode_tokens": 0,
            "decode_elapsed": 0.0} for _ in gammas]
    for prompt in prompts:
        for gamma, a in zip(gammas, acc):
            t = time.perf_counter()
            deltas, first_at = [], None
            async for delta in await client.call(inst.instance_id, GenerateRequest(prompt, params, num_speculative_tokens=gamma), TokenDelta):
                if first_at is None and delta.token_ids:
                    first_at, first_len = time.perf_counter(), len(delta.token_ids)
                deltas.append(delta)
            end = time.perf_counter()
            a["elapsed"] += end - t
            # after the first token: the phase the ideal formula models
            a["decode_elapsed"] += end - first_at
            a["outputs"].append([tok for d in deltas for tok in d.token_ids])
            a["decode_tokens"] += len(a["outputs"][-1]) - first_len
            spec = deltas[-1].usage.spec
            if spec is not None:
                a["drafts"] += spec.num_drafts
                a["draft_tokens"] += spec.num_draft_tokens
                a["accepted"] += spec.num_accepted_tokens
    results = []
    for gamma, a in zip(gammas, acc):
        total, decode, accepted = sum(len(o) for o in a["outputs"]), a["decode_tokens"], a["accepted"]
        # Tokens per decode step: a step that drafted nothing (e.g. no n-gram match) yields one token and
        # counts, as the formula assumes every step drafts γ tokens. Steps = decode tokens − accepted ones.
        mean_len = decode / (decode - accepted) if decode > accepted else 1.0
        results.append({"tokens_per_s": total / a["elapsed"], "decode_tokens_per_s": decode / a["decode_elapsed"],
                        "outputs": a["outputs"], "rate": accepted / a["draft_tokens"] if a["draft_tokens"] else 0.0,
                        "mean_len": mean_len, "alpha": fit_alpha(mean_len, gamma) if gamma else 0.0,
                        "drafts": a["drafts"]})
    return results


async def with_draft(rt: Runtime, env: dict, draft_args: list[str], prompts, max_tokens, gamma) -> dict:
    proc = ManagedProcess("workers.draft", draft_args, env, name="draft").start()
    try:
        drafts = await rt.client("draft", "speculate")
        await drafts.wait_for_instances(1, timeout=120)
        for _ in range(2):  # warm-up: the target opens its stream to this draft during the first
            await run_requests(rt, prompts[:1], 8, gamma)
        # Plain decoding (γ = 0, same target) interleaved with the speculative requests: this row's baseline.
        plain, spec = await run_interleaved(rt, prompts, max_tokens, [0, gamma])
        spec["plain"] = plain
        assert spec["outputs"] == plain["outputs"], "speculative output differs from plain decoding"
        return spec
    finally:
        proc.stop()
        drafts = await rt.client("draft", "speculate")
        await drafts.snapshot.wait_for(lambda items: not items, 30)


def transformers_baseline(target: Path, draft: Path, prompts, max_tokens: int, gamma: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32).eval()
    assistant = AutoModelForCausalLM.from_pretrained(draft, dtype=torch.float32).eval()
    # "assisted": γ fixed and no early stop, as our fixed-γ rows; "default": transformers' defaults (up to
    # 20 tokens, drafting stops early when the draft's confidence < 0.4), to set against our adaptive default.
    settings = {"assisted": (gamma, 0.0), "default": (20, 0.4)}
    names = ("plain", "assisted", "default")

    def generate(name: str, ids, tokens: int):
        extra = {}
        if name in settings:
            num, threshold = settings[name]
            assistant.generation_config.num_assistant_tokens = num
            assistant.generation_config.num_assistant_tokens_schedule = "constant"
            assistant.generation_config.assistant_confidence_threshold = threshold
            extra = {"assistant_model": assistant}
        return model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens,
                              min_new_tokens=tokens, do_sample=False, **extra)

    elapsed, total = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0)
    with torch.inference_mode():
        for name in names:
            generate(name, torch.tensor([prompts[0]]), 4)  # warm-up
        for prompt in prompts:  # the three settings interleaved, prompt by prompt
            ids = torch.tensor([prompt])
            for name in names:
                t = time.perf_counter()
                out = generate(name, ids, max_tokens)
                elapsed[name] += time.perf_counter() - t
                total[name] += out.shape[1] - ids.shape[1]
    return {name: total[name] / elapsed[name] for name in names}


def write_svg(path: Path, points: list[tuple[float, float]], gamma: int, c: float) -> None:
    """Achieved speedup vs α (dots) with the ideal curve for (γ, c) overlaid."""
    w, h, pad = 520, 340, 50
    ymax = max([ideal_speedup(1.0, gamma, c)] + [s for _, s in points]) * 1.1

    def xy(a: float, s: float) -> tuple[float, float]:
        return pad + a * (w - 2 * pad), h - pad - s / ymax * (h - 2 * pad)

    curve = " ".join("%.1f,%.1f" % xy(a / 100, ideal_speedup(a / 100, gamma, c)) for a in range(0, 101))
    dots = "".join('<circle cx="%.1f" cy="%.1f" r="4" fill="#d62728"/>' % xy(a, s) for a, s in points)
    ticks = "".join('<text x="%.1f" y="%d" font-size="11" text-anchor="middle">%.1f</text>' % (xy(a / 10, 0)[0], h - pad + 16, a / 10)
                    for a in range(0, 11, 2))
    yticks = "".join('<text x="%d" y="%.1f" font-size="11" text-anchor="end">%.1f</text>' % (pad - 6, xy(0, s)[1] + 4, s)
                     for s in [x * 0.5 for x in range(0, int(ymax / 0.5) + 1)])
    one = xy(0, 1.0)[1]
    path.write_text(f"""<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif">
<rect width="100%" height="100%" fill="white"/>
<line x1="{pad}" y1="{h - pad}" x2="{w - pad}" y2="{h - pad}" stroke="black"/>
<line x1="{pad}" y1="{pad}" x2="{pad}" y2="{h - pad}" stroke="black"/>
<line x1="{pad}" y1="{one:.1f}" x2="{w - pad}" y2="{one:.1f}" stroke="#999" stroke-dasharray="4"/>
<polyline points="{curve}" fill="none" stroke="#1f77b4" stroke-width="2"/>{dots}{ticks}{yticks}
<text x="{w / 2}" y="{h - 10}" font-size="12" text-anchor="middle">acceptance rate α</text>
<text x="14" y="{h / 2}" font-size="12" text-anchor="middle" transform="rotate(-90 14 {h / 2})">decode-phase speedup over plain decoding</text>
<text x="{w / 2}" y="24" font-size="13" text-anchor="middle">ideal (line, γ={gamma}, c={c:.2f}) vs achieved (dots)</text>
</svg>
""")


async def amain(args) -> None:
    from transformers import AutoTokenizer

    from workers.demo_model import demo_model_dir

    target = demo_model_dir()
    draft = build_draft(target, args.draft_layers)
    tok = AutoTokenizer.from_pretrained(target)
    texts = [tok.apply_chat_template([{"role": "user", "content": p}], add_generation_prompt=True, tokenize=False)
             for p in (HELD_OUT_PROMPTS if args.held_out else PROMPTS)[: args.prompts]]
    prompts = [list(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    gamma = args.gamma
    c = measure_cost_ratio(target, draft)
    print(f"draft/target cost ratio c = {c:.3f} ({args.draft_layers} of 30 layers)", flush=True)

    etcd, nats_server = start_servers()
    env = env_for(etcd, nats_server, "bench")
    def start_target(adaptive: bool) -> ManagedProcess:
        flags = [] if adaptive else ["--speculative-config", '{"adaptive": false}']
        return ManagedProcess("workers.target", ["--model", str(target), "--num-speculative-tokens", str(gamma),
                                                 "--max-num-seqs", "4", *flags], env, name="target").start()

    # Fixed γ first, so that the ideal formula applies; the adaptive default comes last.
    target_proc = start_target(adaptive=False)
    rows = []
    try:
        cfg = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_server.url, namespace="bench", handle_signals=False)
        async with Runtime.connect(cfg) as rt:
            await run_requests(rt, prompts[:1], 8, 0)  # warm-up
            plain = await run_requests(rt, prompts, args.max_tokens, 0)
            rows.append(("plain decoding (same target worker, γ=0)", plain, None))
            print(f"plain: {plain['tokens_per_s']:.1f} tok/s", flush=True)
            base = ["--block-size", "16", "--num-blocks", "512"]
            setups = (("n-gram prompt lookup (c ≈ 0)", ["--method", "ngram"], 0.0),
                      ("draft model, no overlap", ["--method", "draft_model", "--draft-model", str(draft), *base,
                                                   "--speculative-config", '{"overlap": false}'], c),
                      ("draft model, overlap", ["--method", "draft_model", "--draft-model", str(draft), *base], c))
            if args.eagle3:
                setups = setups + (("EAGLE-3 head trained by `tandem train-draft`",
                                     ["--method", "eagle3", "--eagle-model", args.eagle3, "--target-model",
                                      str(target), *base], None),)
            else:
                setups = setups + (None,)
            for key, label in (("medusa", "Medusa heads"), ("mlp_speculator", "MLP speculator")):
                head = getattr(args, key)
                if head:  # trained by `tandem train-draft --head medusa|mlp`
                    setups = setups + ((f"{label} trained by `tandem train-draft`",
                                        ["--method", key, "--head-model", head, "--target-model", str(target)], None),)
                else:
                    setups = setups + (None,)
            keys = ("ngram", "draft_model", "draft_model", "eagle3", "medusa", "mlp_speculator")
            setups = tuple(x for key, x in zip(keys, setups) if x and (args.rows is None or key in args.rows))
            for label, draft_args, cost in ([] if args.oracle_only else setups):
                r = await with_draft(rt, env, draft_args, prompts, args.max_tokens, gamma)
                rows.append((label, r, None if cost is None else ideal_speedup(r["alpha"], gamma, cost)))
                print(f"{label}: {r['tokens_per_s']:.1f} tok/s, α={r['alpha']:.2f}, accepted/drafted={r['rate']:.2f}",
                      flush=True)
            refs = Path(tempfile.mkdtemp()) / "refs.json"
            refs.write_text(json.dumps([p + o for p, o in zip(prompts, plain["outputs"])]))
            sweep = []
            for err in args.sweep:
                oracle = {"oracle_file": str(refs), "oracle_error_rate": err}
                r = await with_draft(rt, env, ["--method", "oracle", "--speculative-config", json.dumps(oracle)],
                                     prompts, args.max_tokens, gamma)
                sweep.append((err, r))
                print(f"oracle error {err}: {r['tokens_per_s']:.1f} tok/s, α={r['alpha']:.2f}", flush=True)
            # The oracle again, now with an emulated draft cost c per token: drafting ahead vs not.
            ms_per_token = 1000 / plain["tokens_per_s"]
            costed = []
            for err in args.costed_sweep:
                for overlap in (False, True):
                    oracle = {"oracle_file": str(refs), "oracle_error_rate": err,
                              "oracle_token_cost_ms": round(args.cost * ms_per_token, 2), "overlap": overlap}
                    r = await with_draft(rt, env, ["--method", "oracle", "--speculative-config", json.dumps(oracle)],
                                         prompts, args.max_tokens, gamma)
                    costed.append((err, overlap, r))
                    print(f"oracle error {err}, c={args.cost}, overlap={overlap}: {r['tokens_per_s']:.1f} tok/s, "
                          f"α={r['alpha']:.2f}", flush=True)
            target_proc.stop()
            targets = await rt.client("target", "generate")
            await targets.snapshot.wait_for(lambda items: not items, 30)
            target_proc = start_target(adaptive=True)
            await run_requests(rt, prompts[:1], 8, 0)
            adaptive_rows = [x for x in setups if "overlap" not in x[0] or "no overlap" in x[0]]
            for label, draft_args, cost in ([] if args.oracle_only else adaptive_rows):
                r = await with_draft(rt, env, draft_args, prompts, args.max_tokens, gamma)
                rows.append((label.split(",")[0].split(" (")[0] + ", adaptive γ (the default)", r, None))
                print(f"{label} adaptive: {r['tokens_per_s']:.1f} tok/s, α={r['alpha']:.2f}", flush=True)
    finally:
        target_proc.stop()
        etcd.cleanup()
        nats_server.cleanup()
    hf = None if args.oracle_only or args.no_transformers else transformers_baseline(target, draft, prompts,
                                                                                     args.max_tokens, gamma)

    p = plain["tokens_per_s"]

    def speedups(r: dict) -> tuple[float, float]:
        """End-to-end and decode-phase speedup over the plain decoding interleaved with ``r``."""
        base = r.get("plain", plain)
        return r["tokens_per_s"] / base["tokens_per_s"], r["decode_tokens_per_s"] / base["decode_tokens_per_s"]
    print(f"\n## Speculative decoding: SmolLM2-135M target, γ={gamma}, {len(prompts)} prompts × {args.max_tokens} "
          f"tokens, greedy, batch 1; c = {c:.3f}\n")
    print("| setup | tokens/s | speedup vs our plain (interleaved) | decode-phase speedup | accepted / drafted | α (fit) "
          "| tokens per decode step | ideal speedup | achieved / ideal (end to end) | achieved / ideal (decode phase) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, r, ideal in rows:
        s, sd = speedups(r)
        if ideal:
            extra = (f"{r['rate']:.2f} | {r['alpha']:.2f} | {r['mean_len']:.2f} | {ideal:.2f} | {s / ideal:.2f} | "
                     f"{sd / ideal:.2f}")
        elif r.get("drafts"):
            extra = f"{r['rate']:.2f} | – | {r['mean_len']:.2f} | – | – | –"
        else:
            extra = "– | – | – | – | – | –"
        print(f"| {label} | {r['tokens_per_s']:.1f} | {s:.2f}× | {sd:.2f}× | {extra} |")
    dash = "| – " * 7 + "|"
    if hf is None:
        print_sweeps(args, sweep, costed, gamma, speedups)
        return
    print(f"| transformers `generate` (plain) | {hf['plain']:.1f} | {hf['plain'] / p:.2f}× {dash}")
    print(f"| transformers assisted generation (same draft, γ={gamma} fixed) | {hf['assisted']:.1f} | "
          f"{hf['assisted'] / p:.2f}× {dash}")
    print(f"| transformers assisted generation (same draft, its defaults: ≤ 20 tokens, confidence ≥ 0.4) | "
          f"{hf['default']:.1f} | {hf['default'] / p:.2f}× {dash}")
    fixed = max(r["tokens_per_s"] for label, r, ideal in rows if label.startswith("draft model") and ideal)
    adaptive = next(r["tokens_per_s"] for label, r, _ in rows if label.startswith("draft model, adaptive"))
    print(f"\nsame draft, fixed γ={gamma}: ours / transformers assisted = {fixed / hf['assisted']:.2f}×; "
          f"defaults (our adaptive γ / its defaults) = {adaptive / hf['default']:.2f}×")
    print_sweeps(args, sweep, costed, gamma, speedups)


def print_sweeps(args, sweep, costed, gamma: int, speedups) -> None:
    print("\n| oracle error rate | accepted / drafted | α (fit) | tokens per decode step | achieved speedup (end to end) "
          "| achieved speedup (decode phase) | ideal (c=0) | achieved / ideal (end to end) | achieved / ideal (decode phase) |")
    print("|---|---|---|---|---|---|---|---|---|")
    points = []
    for err, r in sweep:
        s, sd = speedups(r)
        ideal = ideal_speedup(r["alpha"], gamma, 0.0)
        points.append((r["alpha"], sd))
        print(f"| {err} | {r['rate']:.2f} | {r['alpha']:.2f} | {r['mean_len']:.2f} | {s:.2f}× | {sd:.2f}× | "
              f"{ideal:.2f}× | {s / ideal:.2f} | {sd / ideal:.2f} |")
    print(f"\n| oracle error rate, draft cost c = {args.cost} per token | α (fit) | tokens per decode step | "
          "achieved, no overlap | achieved, overlap | ideal without overlap | no overlap / ideal | overlap / ideal |")
    print("|---|---|---|---|---|---|---|---|")
    for err in args.costed_sweep:
        [(_, _, off)] = [x for x in costed if x[0] == err and not x[1]]
        [(_, _, on)] = [x for x in costed if x[0] == err and x[1]]
        ideal = ideal_speedup(off["alpha"], gamma, args.cost)
        (s_off, d_off), (s_on, d_on) = speedups(off), speedups(on)
        print(f"| {err} | {off['alpha']:.2f} | {off['mean_len']:.2f} | {s_off:.2f}× (decode {d_off:.2f}×) | "
              f"{s_on:.2f}× (decode {d_on:.2f}×) | {ideal:.2f}× | {s_off / ideal:.2f} (decode {d_off / ideal:.2f}) | "
              f"{s_on / ideal:.2f} (decode {d_on / ideal:.2f}) |")
    if args.out:
        write_svg(Path(args.out), points, gamma, 0.0)
        print(f"\nplot: {args.out}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=6)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--gamma", type=int, default=4)
    parser.add_argument("--draft-layers", type=int, default=6)
    parser.add_argument("--sweep", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.0, 0.1, 0.3, 0.5, 0.7])
    parser.add_argument("--costed-sweep", type=lambda s: [float(x) for x in s.split(",") if x], default=[0.0, 0.1, 0.3],
                        help="oracle error rates to run with an emulated draft cost, with and without overlap")
    parser.add_argument("--cost", type=float, default=0.25,
                        help="emulated draft cost per token for --costed-sweep, as a fraction of a plain decode step")
    parser.add_argument("--out", default="docs/spec_sweep.svg")
    parser.add_argument("--eagle3", default=None, help="also a row with this EAGLE-3 head directory")
    parser.add_argument("--medusa", default=None, help="also a row with this Medusa head directory")
    parser.add_argument("--mlp-speculator", default=None, help="also a row with this MLP speculator directory")
    parser.add_argument("--rows", type=lambda s: set(s.split(",")), default=None,
                        help="only these draft rows: ngram, draft_model, eagle3, medusa, mlp_speculator (default: all)")
    parser.add_argument("--no-transformers", action="store_true", help="skip transformers' assisted generation")
    parser.add_argument("--held-out", action="store_true",
                        help="prompts no train-draft conversation uses (for rows with a trained head)")
    parser.add_argument("--oracle-only", action="store_true",
                        help="plain decoding and the oracle sweeps only (no draft model, no transformers): a quick check")
    args = parser.parse_args()
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
