"""How evenly draft workers share the drafting when targets carry uneven load: each target with one
draft stream (``draft_streams: 1``, a draft per target by rendezvous hashing: the old way) against
streams to every draft with each sequence placed on the least-held one (``draft_streams: 2``).

Usage: .venv/bin/python bench/draft_balance_bench.py [--targets 4] [--drafts 2] [--load 8,4,2,1]
       [--seconds 20] [--token-cost-ms 0.3] [--draft-streams 1 2]

Real etcd and nats-server on loopback; ``--targets`` tiny target workers (a seeded 2-layer Llama, one
thread each) and ``--drafts`` oracle draft workers (they replay the target's own greedy outputs with a
25 % error rate and cost ``--token-cost-ms`` of CPU per drafted token, so drafting time follows the
tokens drafted). Target k gets ``--load[k]`` concurrent greedy streams, back to back, for ``--seconds``
seconds. The figure: each draft's drafting time per second of wall time
(``tandem_draft_proposal_seconds_sum``), their spread ((max - min) / max; target: within 20 %), and
every output checked against the target alone.
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

import httpx  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from runtime import Runtime, RuntimeConfig  # noqa: E402
from runtime.messages import GenerateRequest, SamplingParams, TokenDelta  # noqa: E402
from runtime.request_plane import collect  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, running_servers  # noqa: E402
from tests.support.tiny_models import tiny_hf_model  # noqa: E402

PROMPTS = [[(5 * i + 7 * j) % 200 for j in range(8 + 3 * i)] for i in range(6)]
GREEDY = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)


def expected(model_dir: Path) -> dict[str, list[int]]:
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model

    engine = Engine(load_model(model_dir), EngineConfig(block_size=8, num_blocks=512, max_num_seqs=16))
    return engine.generate({str(i): p for i, p in enumerate(PROMPTS)}, GREEDY)


async def metric(address: str, name: str) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://{address}/metrics", timeout=5)).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


async def run(streams: int, args, etcd, nats_server, model_dir: Path, refs: Path, want) -> dict:
    namespace = f"balance-{streams}-{int(time.time())}"
    env = env_for(etcd, nats_server, namespace)
    oracle = json.dumps({"oracle_file": str(refs), "oracle_error_rate": 0.25, "oracle_vocab_size": 256,
                         "oracle_token_cost_ms": args.token_cost_ms})
    spec = json.dumps({"adaptive": False, "load_aware": False, "propose_min_wait": 0.5, "draft_streams": streams})
    procs = [ManagedProcess("workers.draft", ["--method", "oracle", "--speculative-config", oracle, "--health-port", "0",
                                              "--lease-ttl", "5"], env, f"draft{i}").start() for i in range(args.drafts)]
    procs += [ManagedProcess("workers.target", ["--model", str(model_dir), "--served-model-name", "tiny", "--block-size", "8",
                                                "--num-blocks", "1024", "--max-model-len", "1024", "--threads", "1",
                                                "--num-speculative-tokens", "3", "--speculative-config", spec,
                                                "--health-port", "0", "--lease-ttl", "5"], env, f"target{k}").start()
              for k in range(args.targets)]
    config = RuntimeConfig(etcd_url=etcd.url, nats_url=nats_server.url, namespace=namespace, lease_ttl=5,
                           handle_signals=False)
    try:
        async with Runtime.connect(config) as rt:
            targets = await rt.client("target", "generate")
            drafts = await rt.client("draft", "speculate")
            tinsts = sorted(await targets.wait_for_instances(args.targets, timeout=120), key=lambda r: r.instance_id)
            dinsts = await drafts.wait_for_instances(args.drafts, timeout=120)
            for inst in tinsts:  # warm: every target speculating
                await collect(await targets.call(inst.instance_id, GenerateRequest(PROMPTS[0], GREEDY), TokenDelta))
            await asyncio.sleep(2.0)  # streams to every draft up
            before = {d.instance_id: await metric(d.http_address, "tandem_draft_proposal_seconds_sum") for d in dinsts}
            stop = time.monotonic() + args.seconds
            bad, done = [], [0]

            async def stream(inst, i: int) -> None:
                n = 0
                while time.monotonic() < stop:
                    p = (i + n) % len(PROMPTS)
                    out = await collect(await targets.call(inst.instance_id, GenerateRequest(PROMPTS[p], GREEDY),
                                                           TokenDelta))
                    if [t for d in out for t in d.token_ids] != want[str(p)]:
                        bad.append((inst.instance_id, p))
                    n += 1
                    done[0] += 1

            started = time.monotonic()
            await asyncio.gather(*(stream(inst, i) for inst, n in zip(tinsts, args.load) for i in range(n)))
            wall = time.monotonic() - started
            after = {d.instance_id: await metric(d.http_address, "tandem_draft_proposal_seconds_sum") for d in dinsts}
            per_s = {d: (after[d] - before[d]) / wall for d in after}
            return {"streams": streams, "per_s": per_s, "spread": (max(per_s.values()) - min(per_s.values()))
                    / max(max(per_s.values()), 1e-9), "requests": done[0], "bad": len(bad), "wall": wall}
    finally:
        for p in procs:
            p.stop(timeout=10)


async def amain(args) -> None:
    with tempfile.TemporaryDirectory() as tmp, running_servers() as (etcd, nats_server):
        model_dir = Path(tmp) / "tiny"
        tiny_hf_model("llama", model_dir, seed=11, vocab=256, layers=2, max_positions=1024)
        want = expected(model_dir)
        refs = Path(tmp) / "refs.json"
        refs.write_text(json.dumps([p + want[str(i)] for i, p in enumerate(PROMPTS)]))
        for streams in args.draft_streams:
            r = await run(streams, args, etcd, nats_server, model_dir, refs, want)
            shares = ", ".join(f"{d[:8]} {1e3 * v:.1f} ms/s" for d, v in sorted(r["per_s"].items()))
            print(f"draft_streams {streams}: drafting time per second {shares}; spread {100 * r['spread']:.0f} %; "
                  f"{r['requests']} requests in {r['wall']:.1f} s, {r['bad']} outputs unlike the target alone",
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, default=4)
    parser.add_argument("--drafts", type=int, default=2)
    parser.add_argument("--load", type=lambda s: [int(x) for x in s.split(",")], default=[8, 4, 2, 1],
                        help="concurrent streams per target")
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--token-cost-ms", type=float, default=0.3)
    parser.add_argument("--draft-streams", type=int, nargs="+", default=[1, 2])
    args = parser.parse_args()
    if len(args.load) != args.targets:
        parser.error("--load needs one count per target")
    asyncio.run(amain(args))


if __name__ == "__main__":
    main()
