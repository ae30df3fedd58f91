"""The KV tiers never change an output: tiered and untiered greedy outputs on the demo model.

Usage: .venv/bin/python bench/kv_tier_diff.py [--prompts 200] [--host-gb 0.005,0.01,0.02,0.05,0.1]
       [--chunks 2048,128] [--max-tokens 8] [--served] [--json out.json]

Two parts, both CPU float32 with the demo model (SmolLM2-135M-Instruct):

- ``--served``: issue 53's repro through ``tandem up`` (two stacks side by side: ``--draft-method none
  --kv-cache-gb 0.035 --max-model-len 640``, one with ``--kv-offload-config
  '{"host_gb": 0.01, "disk_dir": DIR}'`` (14 host rows), one without tiers). A 496-token prompt (31 blocks
  stored in one step: more than the host tier's rows), three unrelated prompts, then a 199-token
  prompt sharing its first 11 blocks, ``/v1/completions`` with token-id prompts, temperature 0. Then
  the tiered stack is restarted on the same directory and the last prompt sent again (blocks come
  from disk only). Every answer must equal the untiered stack's.
- the engine differential (always): ``--prompts`` random prompts cut from hand-written text at
  random depths (so prefixes are shared at every depth) with random tails, sent in waves of 1-4,
  through engines with the served stack's limits (0.035 GiB device pool, 640 tokens, block 16),
  whole prefills and chunked ones (128 tokens a step), at each ``--host-gb`` with a disk tier, each
  with and without faults injected into the directory between waves (truncated, flipped, deleted
  files, a valid file copied under another block's name); then a fresh engine on the same directory
  sends every prompt again. Every output must equal an engine without tiers.

Exits 1 on any difference.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# hand-written: the text prompts are cut from (no generator)
TEXT = """\
The greenhouse at the end of the garden holds eleven plants. Plant number one is a tomato that likes sun and
water every morning. Plant number two is a basil that wilts if the soil dries out. Plant number three is a
cactus that should be left alone for weeks. The gardener keeps a notebook where each page lists the plant,
the day it was watered, and whether its leaves looked healthy. Last spring the notebook was lost for a month
and two of the plants died, so now there is a second copy pinned to the door.

Question: which plant likes sun and water? Answer with the plant number and one sentence about why.

Our team moved the billing service to a new database in March. The migration plan had four steps: copy the
tables, run both systems side by side for a week, compare every invoice, and then switch the writes. Step
three found that invoices with a discount code were rounded differently, because the old system rounded
each line and the new one rounded the total. We fixed it by rounding each line in the new system too, and
the comparison came back clean on the ninth day.

Dear Ms. Alvarez, thank you for your letter about the noise from the building site on Harbour Street. The
contractor has agreed to start work at eight instead of seven on weekdays and not to work on Sundays. If
you notice work outside these hours, please call the site office and note the time, so that we can follow
it up with the council.

To make a simple flatbread you need flour, water, salt and a little oil. Mix two cups of flour with a pinch
of salt, add about three quarters of a cup of warm water and a spoon of oil, and knead for five minutes.
Let the dough rest, divide it into six balls, roll each one thin and cook it in a hot dry pan for about a
minute on each side, until brown spots appear.

def moving_average(values, window):
    if window <= 0:
        raise ValueError("window must be positive")
    out = []
    total = 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out
"""


def engine_config(chunk: int):
    from workers.engine.engine import EngineConfig

    return EngineConfig(block_size=16, max_num_seqs=8, max_num_batched_tokens=chunk, max_model_len=640,
                        kv_cache_bytes=int(0.035 * (1 << 30)))


def make_prompts(tokenizer, n: int, seed: int) -> list[dict[str, list[int]]]:
    """``n`` prompts in waves: a random depth (up to 560 tokens) of the text, from one of a few starts,
    plus a random tail of text tokens (or none)."""
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    rng = random.Random(seed)
    starts = [0, 0, 0, len(ids) // 3, len(ids) // 2]
    waves, k = [], 0
    while k < n:
        wave = {}
        for _ in range(min(rng.randrange(1, 5), n - k)):
            s = rng.choice(starts)
            depth = rng.randrange(8, min(560, len(ids) - s))
            tail_at = rng.randrange(0, len(ids) - 40)
            tail = ids[tail_at : tail_at + rng.choice((0, 0, 5, 30))]
            wave[f"p{k}"] = ids[s : s + depth] + tail
            k += 1
        waves.append(wave)
    return waves


def run_waves(engine, waves, params, rng=None, directory: Path | None = None) -> list[list[int]]:
    from tests.support.kv_faults import damage_block_file

    outs = []
    for wave in waves:
        got = engine.generate(wave, params)
        outs.extend(got[r] for r in wave)
        if engine.tiers is not None and engine.tiers.disk is not None:
            engine.tiers.disk.flush()
        if rng is not None and directory is not None and rng.random() < 0.5:
            damage_block_file(rng, directory)
    return outs


def differential(args) -> list[dict]:
    import torch
    from transformers import AutoTokenizer

    from runtime.messages import SamplingParams
    from workers.demo_model import demo_model_dir
    from workers.engine.engine import Engine
    from workers.engine.kv_tiers import build_tiers
    from workers.engine.weights import load_model

    torch.set_num_threads(args.threads)
    model_dir = demo_model_dir()
    model = load_model(model_dir, max_positions=640)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    waves = make_prompts(tokenizer, args.prompts, args.seed)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    rows = []
    for chunk in args.chunks:
        base = Engine(model, engine_config(chunk))
        started = time.perf_counter()
        want = run_waves(base, waves, params)
        print(f"chunk {chunk}: untiered {len(want)} prompts in {time.perf_counter() - started:.0f}s", flush=True)
        for host_gb in args.host_gb:
            for faults in (False, True):
                directory = Path(tempfile.mkdtemp(prefix="kv-tier-diff-"))
                rng = random.Random(args.seed + int(host_gb * 1000) + faults)
                try:
                    e = Engine(model, engine_config(chunk))
                    e.attach_tiers(build_tiers(e, int(host_gb * (1 << 30)), str(directory), 1 << 30, "bench"))
                    got = run_waves(e, waves, params, rng if faults else None, directory)
                    e.tiers.close()
                    again = Engine(model, engine_config(chunk))  # a restart on the same directory
                    again.attach_tiers(build_tiers(again, int(host_gb * (1 << 30)), str(directory), 1 << 30, "bench"))
                    reread = run_waves(again, waves, params, rng if faults else None, directory)
                    again.tiers.close()
                finally:
                    shutil.rmtree(directory, ignore_errors=True)
                row = {"chunk": chunk, "host_gb": host_gb, "host_rows": e.tiers.host.capacity, "faults": faults,
                       "prompts": len(want), "equal": got == want, "equal_after_restart": reread == want,
                       "differ": sum(a != b for a, b in zip(got, want)) + sum(a != b for a, b in zip(reread, want)),
                       "host_hits": e.tiers.stats["host"].hits + again.tiers.stats["host"].hits,
                       "disk_hits": e.tiers.stats["disk"].hits + again.tiers.stats["disk"].hits,
                       "disk_written": e.tiers.disk.counters.written + again.tiers.disk.counters.written,
                       "bad_files": {k: e.tiers.disk.counters.bad.get(k, 0) + again.tiers.disk.counters.bad.get(k, 0)
                                     for k in set(e.tiers.disk.counters.bad) | set(again.tiers.disk.counters.bad)}}
                rows.append(row)
                print(json.dumps(row), flush=True)
    return rows


def served(args) -> dict:
    import httpx

    from served_bench import Stack, start_stacks, stop_stacks
    from transformers import AutoTokenizer
    from workers.demo_model import demo_model_dir

    tokenizer = AutoTokenizer.from_pretrained(demo_model_dir())
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    long = ids[:496]
    unrelated = [ids[300 + 40 * i : 300 + 40 * i + 120] for i in range(3)]
    short = long[:176] + ids[-23:]  # 199 tokens: 11 blocks shared, then its own
    common = ["--draft-method", "none", "--kv-cache-gb", "0.035", "--max-model-len", "640"]
    directory = Path(tempfile.mkdtemp(prefix="kv-tier-served-"))
    tiered_flags = [*common, "--kv-offload-config", json.dumps({"host_gb": 0.01, "disk_dir": str(directory)})]

    def ask(client, stack, prompt):
        r = client.post(f"{stack.url}/v1/completions", json={"model": stack.model, "prompt": prompt,
                                                              "temperature": 0, "max_tokens": 32}, timeout=300)
        r.raise_for_status()
        out = r.json()
        return out["choices"][0]["text"], (out["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)

    sequence = [long, *unrelated, short]
    result: dict = {"answers": []}
    plain, tiered = Stack("plain", common, 900), Stack("tiered", tiered_flags, 900)
    try:
        start_stacks([plain, tiered], 900)
        with httpx.Client() as client:
            for i, prompt in enumerate(sequence):
                a, ca = ask(client, plain, prompt)
                b, cb = ask(client, tiered, prompt)
                result["answers"].append({"prompt_tokens": len(prompt), "equal": a == b, "cached_plain": ca,
                                          "cached_tiered": cb, "tiered": b, "plain": a})
        stop_stacks([tiered])
        tiered = Stack("tiered-restarted", tiered_flags, 900)
        start_stacks([tiered], 900)
        with httpx.Client() as client:
            b, cb = ask(client, tiered, short)
            result["answers"].append({"prompt_tokens": len(short), "restarted": True, "cached_tiered": cb,
                                      "equal": b == result["answers"][-1]["plain"], "tiered": b,
                                      "plain": result["answers"][-1]["plain"]})
    finally:
        stop_stacks([s for s in (plain, tiered) if s.proc.proc is not None])
        shutil.rmtree(directory, ignore_errors=True)
    for row in result["answers"]:
        print(json.dumps(row), flush=True)
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", type=int, default=200)
    ap.add_argument("--host-gb", type=lambda s: [float(x) for x in s.split(",")], default=[0.005, 0.01, 0.02, 0.05, 0.1])
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--chunks", type=lambda s: [int(x) for x in s.split(",")], default=[2048, 128],
                    help="max_num_batched_tokens of the engines: 2048 prefills whole, 128 in chunks")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--served", action="store_true", help="also run issue 53's repro through tandem up")
    ap.add_argument("--no-engine", action="store_true", help="skip the engine differential")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "bench"))
    out: dict = {}
    if args.served:
        out["served"] = served(args)
    if not args.no_engine:
        out["engine"] = differential(args)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))
    ok = all(r["equal"] for r in out.get("served", {}).get("answers", [])) and \
        all(r["equal"] and r["equal_after_restart"] for r in out.get("engine", []))
    print("ALL EQUAL" if ok else "DIFFERENCES FOUND", flush=True)
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
