"""The default speculation policy on requests that differ in what drafting can win: a suffix draft,
hand-written chat prompts served once (novel: the draft has little to go on) and then again after
others (repeated: the draft's global tree holds the whole answer), greedy, batch 1.

Usage: .venv/bin/python bench/spec_policy_bench.py [--novel 8] [--repeated 4] [--max-tokens 64]
       [--mixed 4] [--concurrency 4] [--target-args "..."] [--json rows.json]

One demo target (SmolLM2-135M) with the default flags (load-aware speculation, the default seam)
and a ``suffix`` draft worker, as real processes over etcd, NATS and gRPC; plain decoding is the
same target with γ = 0 per request, run next to each speculative request on the same prompt, the
order alternating (the second finds the prompt in the prefix cache); outputs must be equal.
Reported per group: tokens/s against plain, drafts verified per request,
and the acceptance length (tokens per verify pass: accepted drafts + the target's own token, over
the passes that verified a draft). Then ``--mixed`` groups of ``--concurrency`` requests in flight
together, one repeated prompt among fresh ones, speculative and plain in alternating order: the case
where the batch's average request does not pay for drafting and one request does. Issue 37's
target: a repeated request accepts ≥ 3 tokens a round under the default policy, and novel ones
lose no more than noise against plain.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shlex
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.natural import natural_prompt_ids  # noqa: E402
from bench.suffix_bench import new_totals, serve  # noqa: E402
from runtime import Runtime, RuntimeConfig  # noqa: E402
from runtime.messages import SamplingParams  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, start_servers  # noqa: E402

GROUPS = ("novel", "repeated", "mixed: repeated", "mixed: novel")


def summary(spec: dict, plain: dict) -> dict:
    drafts = spec["drafts"]
    return {"requests": len(spec["outputs"]), "tokens": spec["tokens"],
            "spec_tok_s": spec["tokens"] / spec["elapsed"], "plain_tok_s": plain["tokens"] / plain["elapsed"],
            "ratio": (spec["tokens"] / spec["elapsed"]) / (plain["tokens"] / plain["elapsed"]),
            "drafts_per_request": drafts / max(1, len(spec["outputs"])),
            "acceptance_length": 1 + spec["accepted"] / drafts if drafts else 1.0,
            "accepted": spec["accepted"], "drafted": spec["draft_tokens"]}


async def amain(args) -> dict:
    from transformers import AutoTokenizer

    from workers.demo_model import demo_model_dir

    target = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(target)
    fresh_needed = args.mixed * (args.concurrency - 1)
    every = natural_prompt_ids(tok, args.novel + fresh_needed)
    prompts, fresh = every[: args.novel], every[args.novel :]
    # every other novel prompt comes back, after all of them were served once
    repeats = [prompts[i] for i in range(0, len(prompts), 2)][: args.repeated]
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    etcd, nats_server = start_servers()
    env = env_for(etcd, nats_server, "policy-bench")
    procs = [ManagedProcess("workers.target", ["--model", str(target), "--served-model-name", "smol",
                                               *shlex.split(args.target_args)], env, name="target").start(),
             ManagedProcess("workers.draft", ["--method", "suffix", "--model-name", "smol"], env,
                            name="draft-suffix").start()]
    spec = {g: new_totals() for g in GROUPS}
    plain = {g: new_totals() for g in GROUPS}
    started = time.perf_counter()
    try:
        cfg = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_server.url, namespace="policy-bench",
                            handle_signals=False)
        async with Runtime.connect(cfg) as rt:
            client = await rt.client("target", "generate")
            (inst,) = await client.wait_for_instances(1, timeout=180)
            drafts = await rt.client("draft", "speculate")
            await drafts.wait_for_instances(1, timeout=180)
            warm = tok("Hello!", add_special_tokens=False)["input_ids"]
            for _ in range(2):  # process warm-up (the target opens its draft stream here)
                await serve(client, inst, warm, SamplingParams(temperature=0, max_tokens=8), None, None)
            for group, batch in (("novel", prompts), ("repeated", repeats)):
                for i, p in enumerate(batch):
                    # alternate which goes first: the second finds the prompt in the prefix cache
                    if i % 2:
                        b = await serve(client, inst, p, params, 0, plain[group])
                        a = await serve(client, inst, p, params, None, spec[group])
                    else:
                        a = await serve(client, inst, p, params, None, spec[group])
                        b = await serve(client, inst, p, params, 0, plain[group])
                    assert a == b, f"{group} prompt {i}: outputs differ"
                    print(f"{group} {i + 1}/{len(batch)}: {len(a)} tokens; drafts so far {spec[group]['drafts']}, "
                          f"accepted {spec[group]['accepted']}", flush=True)
            # mixed: a repeated request among ``concurrency - 1`` novel ones, all in flight together (the
            # batch's average request does not pay for drafting; the repeated one does)
            for i in range(args.mixed):
                others = args.concurrency - 1
                batch = [repeats[i % len(repeats)]] + fresh[i * others : (i + 1) * others]
                runs = {}
                for gamma in ((None, 0) if i % 2 == 0 else (0, None)):
                    accs = (spec if gamma is None else plain)
                    runs[gamma] = await asyncio.gather(*(
                        serve(client, inst, p, params, gamma, accs["mixed: repeated" if j == 0 else "mixed: novel"])
                        for j, p in enumerate(batch)))
                assert runs[None] == runs[0], f"mixed group {i}: outputs differ"
                print(f"mixed {i + 1}/{args.mixed}: repeated drafts so far {spec['mixed: repeated']['drafts']}, "
                      f"novel {spec['mixed: novel']['drafts']}", flush=True)
    finally:
        for proc in procs:
            proc.stop()
        etcd.cleanup()
        nats_server.cleanup()
    rows = {g: summary(spec[g], plain[g]) for g in GROUPS if spec[g]["outputs"]}
    print(f"\n## Default policy, suffix draft: SmolLM2-135M, {len(prompts)} novel + {len(repeats)} repeated "
          f"hand-written chat prompts, ≤ {args.max_tokens} tokens, greedy, batch 1 (mixed: {args.mixed} groups "
          f"of {args.concurrency} in flight, one repeated among fresh ones); target flags: "
          f"{args.target_args or '(defaults)'}; outputs equal; wall {time.perf_counter() - started:.0f} s\n")
    print("| requests | plain tok/s | spec tok/s | ratio | drafts verified per request | acceptance length |")
    print("|---|---|---|---|---|---|")
    for g, r in rows.items():
        print(f"| {g} ({r['requests']}) | {r['plain_tok_s']:.1f} | {r['spec_tok_s']:.1f} | {r['ratio']:.2f}× "
              f"| {r['drafts_per_request']:.1f} | {r['acceptance_length']:.2f} |")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--novel", type=int, default=8, help="hand-written prompts served once first")
    parser.add_argument("--repeated", type=int, default=4, help="of those, served again after all of them")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mixed", type=int, default=4, help="groups served with --concurrency requests in flight")
    parser.add_argument("--concurrency", type=int, default=4, help="requests in flight in a mixed group")
    parser.add_argument("--target-args", default="", help="extra target flags (default: none, the defaults)")
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args()
    rows = asyncio.run(amain(args))
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
