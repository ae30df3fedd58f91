"""Online distillation on a shifted workload: the demo target and its shipped EAGLE-3 head serve a
stream of prompts unlike the head's training data, with ``--online-distill`` off and then on, same
prompts in the same order; acceptance length per window of requests over time, end-to-end tokens/s
(the trainer's cost included: it shares the machine), and what the trainer did.

Usage: .venv/bin/python bench/distill_bench.py [--requests 400] [--window 100] [--concurrency 4]
       [--max-tokens 64] [--modes off,on] [--load-aware]
       [--distill-args "--distill-config '{\"eval_every\": 10}'"]
       [--dump outputs.json]

The workload (``bench/prompts/lumen_support.json``, written by hand for this): customer-support
messages to a fictional smart-lamp company under a fixed system prompt, 40 issues × 10 openers, in a
seeded shuffled order, so no prompt repeats within 400 requests. The bundled head was trained on
``tandem train-draft``'s template generator (explanations of general topics), which has no such
domain, product names or support register. Greedy, every output of ``on`` checked equal to ``off``'s.
By default the target runs with ``--speculative-config '{"load_aware": false}'`` so that every decode step asks for a
draft and the acceptance figures rest on every step (``--load-aware`` keeps the default planner).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.load_sweep import draft_args  # noqa: E402
from runtime import Runtime, RuntimeConfig  # noqa: E402
from runtime.messages import GenerateRequest, SamplingParams, TokenDelta  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, start_servers  # noqa: E402

WORKLOAD = ROOT / "bench" / "prompts" / "lumen_support.json"


def workload(tok, n: int, seed: int = 0) -> list[list[int]]:
    """The first ``n`` prompts of the shuffled issue × opener stream, as chat-template token ids."""
    spec = json.loads(WORKLOAD.read_text())
    pairs = [(o, i) for o in spec["openers"] for i in spec["issues"]]
    random.Random(seed).shuffle(pairs)
    out = []
    for k in range(n):
        opener, issue = pairs[k % len(pairs)]
        messages = [{"role": "system", "content": spec["system"]}, {"role": "user", "content": f"{opener} {issue}"}]
        text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(list(tok(text, add_special_tokens=False)["input_ids"]))
    return out


async def draft_metrics(address: str) -> dict[str, float]:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://{address}/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("tandem_draft_")}


async def run(mode: str, prompts: list[list[int]], args, etcd, nats_server, target: Path) -> dict:
    env = env_for(etcd, nats_server, f"distill-{mode}")
    target_flags = [] if args.load_aware else ["--speculative-config", '{"load_aware": false}']
    distill = ["--online-distill", *shlex.split(args.distill_args)] if mode == "on" else []
    procs = [ManagedProcess("workers.target", ["--model", str(target), "--max-num-seqs", "64", *target_flags], env,
                            name=f"target-{mode}").start(),
             ManagedProcess("workers.draft", [*draft_args("eagle3", target), "--health-port", "0", *distill], env,
                            name=f"draft-{mode}").start()]
    cfg = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_server.url, namespace=f"distill-{mode}", handle_signals=False)
    try:
        async with Runtime.connect(cfg) as rt:
            client = await rt.client("target", "generate")
            [inst] = await client.wait_for_instances(1, timeout=180)
            [draft] = await (await rt.client("draft", "speculate")).wait_for_instances(1, timeout=180)
            params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
            per_request: list[dict] = [{} for _ in prompts]
            gate = asyncio.Semaphore(args.concurrency)

            async def one(i: int) -> None:
                async with gate:
                    tokens, spec = [], None
                    async for delta in await client.call(inst.instance_id, GenerateRequest(prompts[i], params),
                                                         TokenDelta):
                        tokens.extend(delta.token_ids)
                        if delta.usage is not None:
                            spec = delta.usage.spec
                    per_request[i] = {"tokens": tokens, "drafts": spec.num_drafts if spec else 0,
                                      "accepted": spec.num_accepted_tokens if spec else 0, "done": time.perf_counter()}

            for i in range(2):  # warm-up (not counted): opens the draft stream
                await one(i)
            started = time.perf_counter()
            await asyncio.gather(*(one(i) for i in range(len(prompts))))
            wall = time.perf_counter() - started
            metrics = await draft_metrics(draft.http_address)
    finally:
        for p in procs:
            p.stop()
    windows = []
    for w in range(0, len(prompts), args.window):
        chunk = per_request[w : w + args.window]
        drafts = sum(r["drafts"] for r in chunk)
        windows.append(1 + sum(r["accepted"] for r in chunk) / drafts if drafts else float("nan"))
    return {"tokens_per_s": sum(len(r["tokens"]) for r in per_request) / wall, "wall": wall, "windows": windows,
            "outputs": [r["tokens"] for r in per_request], "metrics": metrics}


async def amain(args) -> None:
    from transformers import AutoTokenizer

    from workers.demo_model import demo_model_dir

    target = demo_model_dir()
    prompts = workload(AutoTokenizer.from_pretrained(target), args.requests, args.seed)
    etcd, nats_server = start_servers()
    results = {}
    try:
        for mode in args.modes:  # one stack at a time: the trainer's cost lands on "on" only
            results[mode] = await run(mode, prompts, args, etcd, nats_server, target)
            r = results[mode]
            print(f"{mode}: {r['tokens_per_s']:.1f} tok/s over {r['wall']:.0f} s; acceptance per {args.window} "
                  f"requests: {', '.join(f'{x:.2f}' for x in r['windows'])}", flush=True)
    finally:
        etcd.stop()
        nats_server.stop()
    if args.dump:
        Path(args.dump).write_text(json.dumps({"prompts": prompts, **{m: r["outputs"] for m, r in results.items()}}))
    if "off" in results and "on" in results:
        pairs = list(zip(results["off"]["outputs"], results["on"]["outputs"]))
        print(f"\noutputs equal: {sum(a == b for a, b in pairs)}/{len(prompts)}")
        for i, (a, b) in enumerate(pairs):
            if a != b:
                at = next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                print(f"  request {i} differs from token {at}: off {a[at:at + 4]}, on {b[at:at + 4]}")
        print(f"\n| requests | acceptance length, off | on |\n|---|---|---|")
        for k, (a, b) in enumerate(zip(results["off"]["windows"], results["on"]["windows"])):
            print(f"| {k * args.window + 1}–{min((k + 1) * args.window, len(prompts))} | {a:.2f} | {b:.2f} |")
        off, on = results["off"]["tokens_per_s"], results["on"]["tokens_per_s"]
        print(f"\nend to end: off {off:.1f} tok/s, on {on:.1f} tok/s ({on / off:.2f}×)")
        m = results["on"]["metrics"]
        keys = ("distill_samples_total", "distill_train_steps_total", "distill_swaps_total", "distill_rejected_total",
                "distill_nonfinite_total", "distill_failures_total", "distill_train_seconds_total",
                "distill_compute_share", "distill_serving_acceptance", "distill_candidate_acceptance",
                "weight_swaps_total")
        print("trainer: " + ", ".join(f"{k} {m.get('tandem_draft_' + k, float('nan')):.3g}" for k in keys))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=400)
    ap.add_argument("--window", type=int, default=100)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", type=lambda s: s.split(","), default=["off", "on"])
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--load-aware", action="store_true", help="keep the target's load-aware planner on")
    ap.add_argument("--dump", default=None, help="write the prompts and every mode's outputs here (JSON)")
    ap.add_argument("--distill-args", default="",
                    help="extra draft-worker flags for mode on (e.g. --distill-config '{\"lr\": 3e-4}')")
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    main()
