"""Two draft kinds side by side: does each request end on the kind that accepts more for it?

Usage: .venv/bin/python bench/draft_fit_bench.py [--rounds 6] [--batch 8] [--error-rate 0.2]

Real etcd and nats-server on loopback, one tiny target worker (a seeded 2-layer Llama), and draft
workers of two kinds: a suffix draft (it drafts what earlier outputs continued with: a request asked
again is drafted whole) and an oracle draft standing in for a model-based head (it replays the
target's own greedy output with ``--error-rate`` of its tokens wrong: it drafts any text, never
perfectly). The workload mixes *repeated* requests (two prompts asked over and over: the suffix draft's
case) with *fresh* ones (a new prompt each time: the head's), ``--batch`` at a time, greedy.

``--demo``: the real thing on the demo model (SmolLM2-135M-Instruct) with its bundled EAGLE-3 head
instead of the oracle (runs ``suffix``, ``eagle3``, ``suffix+eagle3``): the repeated requests are two
hand-written chat prompts asked over and over, the fresh ones the other prompts of
``bench/prompts/natural_chat.jsonl`` (``--batch`` 4 and ``--rounds`` 4 keep it to minutes on a CPU).

Three runs, each on a fresh target and drafts: suffix alone, oracle alone, and both (``draft_streams``
2: each sequence placed on one stream and moved by its measured fit, see workers/target/placement.py).
The figure: tokens per target step (completion tokens over the steps that made them, from each
request's ``usage``: a step emits 1 + the drafts it accepted), per kind of request and overall; every
output checked against the target alone.
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
from runtime.request_plane import collect  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, running_servers  # noqa: E402
from tests.support.tiny_models import tiny_hf_model  # noqa: E402

GREEDY = SamplingParams(temperature=0, max_tokens=128, ignore_eos=True)
REPEATED = [[(11 * j + 3) % 250 for j in range(12)], [(13 * j + 40) % 250 for j in range(10)]]


def fresh_prompts(n: int) -> list[list[int]]:
    return [[(7 * i + 31 * j + 5) % 250 for j in range(6 + i % 9)] for i in range(n)]


def expected(model_dir: Path, prompts: list[list[int]]) -> list[list[int]]:
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model

    engine = Engine(load_model(model_dir), EngineConfig(block_size=8, num_blocks=2048, max_num_seqs=32))
    out = engine.generate({str(i): p for i, p in enumerate(prompts)}, GREEDY)
    return [out[str(i)] for i in range(len(prompts))]


async def run(kinds: list[str], args, etcd, nats_server, model_dir: Path, refs: Path | None, prompts, want) -> dict:
    namespace = f"fit-{'-'.join(kinds)}-{int(time.time())}"
    env = env_for(etcd, nats_server, namespace)
    oracle = json.dumps({"oracle_file": str(refs), "oracle_error_rate": args.error_rate, "oracle_vocab_size": 256})
    fresh_ids = iter(range(len(REPEATED), len(prompts))) if args.demo else None
    spec = json.dumps({"adaptive": False, "load_aware": False, "propose_min_wait": 0.5, "draft_streams": len(kinds),
                       "seam": args.seam})
    procs = []
    for kind in kinds:
        extra = {"oracle": ["--speculative-config", oracle],
                 "eagle3": ["--eagle-model", str(args.head or ""), "--target-model", str(model_dir)]}.get(kind, [])
        procs.append(ManagedProcess("workers.draft", ["--method", kind, *extra, "--health-port", "0", "--lease-ttl", "5"],
                                    env, f"draft-{kind}").start())
    procs.append(ManagedProcess("workers.target", ["--model", str(model_dir), "--served-model-name", "tiny", "--block-size",
                                                   "8", "--num-blocks", "2048", "--max-model-len", "2048", "--threads", "1",
                                                   "--num-speculative-tokens", "3", "--speculative-config", spec,
                                                   "--health-port", "0", "--lease-ttl", "5"], env, "target").start())
    config = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_server.url, namespace=namespace, lease_ttl=5,
                           handle_signals=False)
    try:
        async with Runtime.connect(config) as rt:
            targets = await rt.client("target", "generate")
            [inst] = await targets.wait_for_instances(1, timeout=120)
            await (await rt.client("draft", "speculate")).wait_for_instances(len(kinds), timeout=120)
            await asyncio.sleep(2.0)  # the target's streams up
            tally = {"repeated": [0, 0], "fresh": [0, 0]}  # [tokens, accepted]
            plain: dict[str, int] = {}  # decode steps without a draft, by why
            bad = 0
            fresh = fresh_ids or iter(range(len(REPEATED), len(prompts)))

            async def one(i: int, kind: str) -> None:
                nonlocal bad
                out = await collect(await targets.call(inst.instance_id, GenerateRequest(prompts[i], GREEDY), TokenDelta))
                got = [t for d in out for t in d.token_ids]
                bad += got != want[i]
                spec = out[-1].usage.spec
                tally[kind][0] += len(got)
                tally[kind][1] += spec.num_accepted_tokens if spec is not None else 0
                for why, n in (spec.plain_steps if spec is not None else {}).items():
                    plain[why] = plain.get(why, 0) + n

            for r in range(args.rounds):
                batch = [((j // 2) % len(REPEATED), "repeated") if j % 2 == 0 else (next(fresh), "fresh")
                         for j in range(args.batch)]
                await asyncio.gather(*(one(i, kind) for i, kind in batch))
            per_step = {kind: tokens / max(tokens - accepted, 1) for kind, (tokens, accepted) in tally.items()}
            tokens = sum(t for t, _ in tally.values())
            per_step["all"] = tokens / max(tokens - sum(a for _, a in tally.values()), 1)
            return {"kinds": kinds, "per_step": per_step, "bad": bad, "plain": plain}
    finally:
        for p in procs:
            p.stop(timeout=10)


async def amain(args) -> None:
    with tempfile.TemporaryDirectory() as tmp, running_servers() as (etcd, nats_server):
        refs = None
        if args.demo:
            from transformers import AutoTokenizer

            from bench.natural import natural_prompt_ids
            from workers.demo_model import demo_head_dir, demo_model_dir, demo_tokenizer_dir

            model_dir, args.head = demo_model_dir(), demo_head_dir()
            chat = natural_prompt_ids(AutoTokenizer.from_pretrained(demo_tokenizer_dir()))
            REPEATED[:] = chat[:2]
            prompts = REPEATED + chat[2 : 2 + args.rounds * args.batch // 2]
            want = expected(model_dir, prompts)
        else:
            prompts = REPEATED + fresh_prompts(args.rounds * args.batch * len(args.runs))
            model_dir = Path(tmp) / "tiny"
            tiny_hf_model("llama", model_dir, seed=11, vocab=256, layers=2, max_positions=1024)
            want = expected(model_dir, prompts)
            refs = Path(tmp) / "refs.json"
            refs.write_text(json.dumps([p + w for p, w in zip(prompts, want)]))
        for run_kinds in args.runs:
            kinds = run_kinds.split("+")
            r = await run(kinds, args, etcd, nats_server, model_dir, refs, prompts, want)
            s = r["per_step"]
            print(f"{run_kinds:>13}: tokens per step: repeated {s['repeated']:.2f}, fresh {s['fresh']:.2f}, "
                  f"all {s['all']:.2f}; {r['bad']} outputs unlike the target alone; plain steps {r['plain']}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--error-rate", type=float, default=0.2)
    parser.add_argument("--seam", choices=["pipelined", "sync"], default="sync")
    parser.add_argument("--runs", nargs="+", default=None,
                        help="draft kinds per run (default: suffix, oracle, suffix+oracle; with --demo eagle3 for oracle)")
    parser.add_argument("--demo", action="store_true", help="the demo model and its bundled EAGLE-3 head")
    args = parser.parse_args()
    args.head = None
    if args.runs is None:
        args.runs = ["suffix", "eagle3", "suffix+eagle3"] if args.demo else ["suffix", "oracle", "suffix+oracle"]
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
