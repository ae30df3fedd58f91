"""Suffix decoding on repeated structured outputs: plain decoding, n-gram prompt lookup and suffix
decoding on the same prompts, greedy, batch 1, interleaved prompt by prompt in one run.

Usage: .venv/bin/python bench/suffix_bench.py [--per-template 5] [--warmup 1] [--max-tokens 80] [--gamma 8]
       [--tree-topk 0]

Target: SmolLM2-135M-Instruct (the bundled demo), two identical target processes with prefix caching
off (so that no method finds another's prompt in the cache): target A with an ``ngram`` draft
worker, target B with a ``suffix`` draft worker (each draft serves its target by ``--model-name``),
all over real etcd, NATS and gRPC. Plain decoding is target A with γ = 0 per request.

The workload is what suffix decoding is for: requests that produce the same structure again and
again with small variations — a JSON record for a person, a Python dataclass, a SQL query — three
templates in turn. ``--warmup`` prompts per template go through both speculating targets first,
unmeasured (a server that has seen some traffic; suffix decoding's global tree learns from them,
n-gram keeps nothing between requests). Each measured prompt then runs under all three methods,
the order rotated from one prompt to the next, so that a slow spell of this shared machine hits
all alike; outputs must be equal token for token.

Speedups are given end to end (tokens / request time, prefill included) and for the decode phase
(tokens after the first / time from the first token to the last). Acceptance length is tokens per
verify pass (accepted drafts + the target's own token) over the passes that verified a draft.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from runtime import Runtime, RuntimeConfig  # noqa: E402
from runtime.messages import GenerateRequest, SamplingParams, TokenDelta  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, start_servers  # noqa: E402

PEOPLE = ["Alice, 31, from Paris", "Bob, 45, from Tokyo", "Chen, 28, from Lima", "Dana, 52, from Oslo",
          "Emeka, 39, from Lagos", "Farah, 24, from Cairo", "Goran, 61, from Zagreb", "Hana, 35, from Kyoto"]
CLASSES = ["User", "Order", "Invoice", "Product", "Shipment", "Payment", "Customer", "Review"]
CITIES = ["Paris", "Tokyo", "Lima", "Oslo", "Lagos", "Cairo", "Zagreb", "Kyoto"]
TEMPLATES = (
    ("json", "Write a JSON object for a user profile with the fields name, age, city and email. "
             "The user is {}.", PEOPLE),
    ("dataclass", "Write a Python dataclass named {} with fields id: int, name: str and created_at: datetime.",
     CLASSES),
    ("sql", "Write a SQL query that selects the name and email of every customer from {} in the customers table.",
     CITIES),
)
METHODS = ("plain", "ngram", "suffix")


def workload(tok, per_template: int, warmup: int) -> tuple[list[list[int]], list[list[int]]]:
    """(warm-up prompts, measured prompts), token ids, the templates in turn."""
    def encode(text: str) -> list[int]:
        chat = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
        return list(tok(chat, add_special_tokens=False)["input_ids"])

    rounds = [[encode(t.format(fill[i])) for _, t, fill in TEMPLATES] for i in range(warmup + per_template)]
    return [p for r in rounds[:warmup] for p in r], [p for r in rounds[warmup:] for p in r]


def new_totals() -> dict:
    return {"tokens": 0, "elapsed": 0.0, "decode_tokens": 0, "decode_elapsed": 0.0, "drafts": 0, "draft_tokens": 0,
            "accepted": 0, "outputs": []}


async def serve(client, inst, prompt: list[int], params: SamplingParams, gamma: int | None,
                acc: dict | None) -> list[int]:
    """One request; its tokens, timings and speculation counters added to ``acc`` (None: not measured)."""
    t = time.perf_counter()
    deltas, first_at, first_len = [], None, 0
    request = GenerateRequest(prompt, params, num_speculative_tokens=gamma)
    async for delta in await client.call(inst.instance_id, request, TokenDelta):
        if first_at is None and delta.token_ids:
            first_at, first_len = time.perf_counter(), len(delta.token_ids)
        deltas.append(delta)
    end = time.perf_counter()
    out = [tok for d in deltas for tok in d.token_ids]
    if acc is not None:
        acc["tokens"] += len(out)
        acc["elapsed"] += end - t
        acc["decode_tokens"] += len(out) - first_len
        acc["decode_elapsed"] += end - first_at
        acc["outputs"].append(out)
        spec = deltas[-1].usage.spec
        if spec is not None:
            acc["drafts"] += spec.num_drafts
            acc["draft_tokens"] += spec.num_draft_tokens
            acc["accepted"] += spec.num_accepted_tokens
    return out


async def amain(args) -> None:
    from transformers import AutoTokenizer

    from workers.demo_model import demo_model_dir

    target = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(target)
    warm, prompts = workload(tok, args.per_template, args.warmup)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)

    etcd, nats_server = start_servers()
    env = env_for(etcd, nats_server, "suffix-bench")
    tree = ["--speculative-config", f'{{"eagle_topk": {args.tree_topk}}}'] if args.tree_topk > 1 else []
    procs = []
    for name, method in (("smol-a", "ngram"), ("smol-b", "suffix")):
        procs.append(ManagedProcess("workers.target", [
            "--model", str(target), "--served-model-name", name, "--num-speculative-tokens", str(args.gamma),
            "--max-num-seqs", "4", "--no-prefix-caching"], env, name=f"target-{name}").start())
        procs.append(ManagedProcess("workers.draft", ["--method", method, "--model-name", name, *tree], env,
                                    name=f"draft-{method}").start())
    totals = {m: new_totals() for m in METHODS}
    started = time.perf_counter()
    try:
        cfg = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_server.url, namespace="suffix-bench", handle_signals=False)
        async with Runtime.connect(cfg) as rt:
            client = await rt.client("target", "generate")
            targets = {i.model: i for i in await client.wait_for_instances(2, timeout=180)}
            drafts = await rt.client("draft", "speculate")
            await drafts.wait_for_instances(2, timeout=180)
            where = {"plain": (targets["smol-a"], 0), "ngram": (targets["smol-a"], None),
                     "suffix": (targets["smol-b"], None)}
            for inst in targets.values():  # process warm-up (the target opens its draft stream here)
                for _ in range(2):
                    await serve(client, inst, (warm or prompts)[0], SamplingParams(temperature=0, max_tokens=8), None,
                                None)
            for p in warm:
                for method in ("ngram", "suffix"):
                    inst, gamma = where[method]
                    await serve(client, inst, p, params, gamma, None)
            print(f"warm-up: {len(warm)} prompts in {time.perf_counter() - started:.0f} s", flush=True)
            for i, p in enumerate(prompts):
                order = METHODS[i % 3 :] + METHODS[: i % 3]
                outs = {}
                for method in order:
                    inst, gamma = where[method]
                    outs[method] = await serve(client, inst, p, params, gamma, totals[method])
                assert outs["ngram"] == outs["plain"] == outs["suffix"], f"prompt {i}: outputs differ"
                print(f"prompt {i + 1}/{len(prompts)}: {len(outs['plain'])} tokens; accepted so far: "
                      + ", ".join(f"{m} {totals[m]['accepted']}" for m in METHODS[1:]), flush=True)
    finally:
        for proc in procs:
            proc.stop()
        etcd.cleanup()
        nats_server.cleanup()
    report(args, totals, len(prompts), time.perf_counter() - started)


def report(args, totals: dict, num_prompts: int, wall: float) -> None:
    plain = totals["plain"]
    tps = {m: t["tokens"] / t["elapsed"] for m, t in totals.items()}
    dps = {m: t["decode_tokens"] / t["decode_elapsed"] for m, t in totals.items()}
    shape = f"trees top-{args.tree_topk}" if args.tree_topk > 1 else "chains"
    print(f"\n## Suffix decoding: SmolLM2-135M, {num_prompts} prompts ({len(TEMPLATES)} templates, {args.warmup} "
          f"warm-up per template), ≤ {args.max_tokens} tokens, greedy, batch 1, γ ≤ {args.gamma} adaptive, "
          f"{shape}; "
          f"{plain['tokens']} tokens per method, outputs equal; wall {wall:.0f} s\n")
    print("| method | tokens/s | speedup vs plain (end to end) | decode-phase speedup | accepted / drafted "
          "| acceptance length (tokens per verify pass) | tokens per decode step |")
    print("|---|---|---|---|---|---|---|")
    for m, t in totals.items():
        if m == "plain":
            print(f"| plain decoding (γ = 0) | {tps[m]:.1f} | 1.00× | 1.00× | – | – | 1.00 |")
            continue
        rate = t["accepted"] / t["draft_tokens"] if t["draft_tokens"] else 0.0
        length = 1 + t["accepted"] / t["drafts"] if t["drafts"] else 1.0
        steps = t["decode_tokens"] - t["accepted"]  # one target token per decode step
        per_step = t["decode_tokens"] / steps if steps > 0 else 1.0
        label = {"ngram": "n-gram prompt lookup", "suffix": "suffix decoding"}[m]
        print(f"| {label} | {tps[m]:.1f} | {tps[m] / tps['plain']:.2f}× | {dps[m] / dps['plain']:.2f}× | {rate:.2f} "
              f"| {length:.2f} | {per_step:.2f} |")
    print(f"\nsuffix / n-gram: {tps['suffix'] / tps['ngram']:.2f}× end to end, {dps['suffix'] / dps['ngram']:.2f}× "
          "decode phase")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--per-template", type=int, default=5,
                        help="measured prompts per template (at most 8 - warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured prompts per template served first")
    parser.add_argument("--max-tokens", type=int, default=80)
    parser.add_argument("--gamma", type=int, default=8, help="the targets' --num-speculative-tokens")
    parser.add_argument("--tree-topk", type=int, default=0, help="> 1: both draft workers propose trees")
    args = parser.parse_args()
    if args.per_template + args.warmup > len(PEOPLE):
        parser.error(f"--per-template + --warmup must be <= {len(PEOPLE)}")
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
