"""Engine throughput against transformers' ``generate`` on the same weights, same machine, same run.

Usage: .venv/bin/python bench/engine_bench.py [--models tiny,smollm2] [--new-tokens 64] [--repeats 3] [--threads 1]
                                             [--async-scheduling] [--no-hf]

For each model, child processes measure (one implementation per process, so peak RSS is its own):
  ours:       the engine at batch 1 and with 16 concurrent requests (continuous batching, greedy);
  ours-torch: the same with ``TANDEM_CPU_LINEAR=torch`` (torch's default CPU matmul, as transformers
              uses) — shows how much of the gap is the matmul kernel and how much the engine;
  hf:         ``model.generate`` at batch 1 and on a left-padded batch of 16 (greedy, same prompts);
  ours-async: with ``--async-scheduling``, the engine with ``EngineConfig(async_scheduling=True)``
              beside the synchronous one (on a CPU nothing overlaps: this shows what the bookkeeping
              one step behind costs; on a GPU, what it gains).
Three workloads: batch 1 (``--new-tokens`` tokens); 16 requests that all want ``--new-tokens``
tokens; and a served stream ("mixed") of 64 requests wanting 16–128 tokens each, at most 16 in
flight: the engine admits the next request as soon as one finishes, while ``generate`` takes them
as 4 padded batches of 16, each running until its longest member is done. Tokens/s counts the
tokens the requests asked for only. Children alternate ``--repeats`` times;
the best run of each is reported (the machine is shared and noisy).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

BATCH = 16
IMPLS = ("ours", "ours-torch", "hf", "ours-async")
KEYS = (("batch1", "1"), ("batch16", "16 concurrent / padded 16, equal lengths"),
        ("mixed16", "64 requests of 16–128 tokens, 16 in flight / 4 padded batches of 16"))


def prompts(vocab: int, n: int = BATCH) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(24, 48))] for _ in range(n)]


MIXED = 64


def mixed_lengths(n: int = MIXED) -> list[int]:
    rng = random.Random(1)
    return [rng.randrange(16, 129) for _ in range(n)]


def tiny_model_dir() -> Path:
    """A seeded random Llama of ~1.3M parameters (overhead-bound), saved once in a temp dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(tempfile.gettempdir()) / "tandem-bench-tiny-llama-v2"
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=4, num_attention_heads=4,
                          num_key_value_heads=2, vocab_size=4096, max_position_embeddings=1024,
                          tie_word_embeddings=True, eos_token_id=None, bos_token_id=None, pad_token_id=0)
        LlamaForCausalLM(cfg).save_pretrained(path)
    return path


def model_dir(name: str) -> Path:
    if name == "tiny":
        return tiny_model_dir()
    from workers.demo_model import demo_model_dir

    return demo_model_dir()


def run_ours(path: Path, new_tokens: int, async_scheduling: bool = False) -> dict:
    import torch

    from runtime.messages import SamplingParams
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model

    model = load_model(path, max_positions=1024)
    engine = Engine(model, EngineConfig(num_blocks=256, max_model_len=1024, max_num_batched_tokens=1024,
                                        async_scheduling=async_scheduling), eos_token_ids=())
    ps = prompts(model.cfg.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate({"warm": ps[0]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.blocks.clear()  # no prefix hits from the warm-up
    out = {}
    with torch.inference_mode():
        start, cpu = time.perf_counter(), time.process_time()
        res = engine.generate({"b1": ps[0]}, params)
        out["batch1"] = len(res["b1"]) / (time.perf_counter() - start)
        out["cpu_batch1"] = len(res["b1"]) / (time.process_time() - cpu)
        engine.blocks.clear()
        start, cpu = time.perf_counter(), time.process_time()
        res = engine.generate({f"r{i}": p for i, p in enumerate(ps)}, params)
        out["batch16"] = sum(map(len, res.values())) / (time.perf_counter() - start)
        out["cpu_batch16"] = sum(map(len, res.values())) / (time.process_time() - cpu)
        engine.blocks.clear()
        queue = list(zip(prompts(model.cfg.vocab_size, MIXED), mixed_lengths()))
        in_flight = done = 0
        start, cpu = time.perf_counter(), time.process_time()
        while queue or in_flight:
            while queue and in_flight < BATCH:  # keep 16 requests in flight, as 16 concurrent clients do
                p, n = queue.pop(0)
                engine.add_request(f"m{len(queue)}", p, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))
                in_flight += 1
            for _, delta in engine.step():
                done += len(delta.token_ids)
                in_flight -= delta.finish_reason is not None
        out["mixed16"] = done / (time.perf_counter() - start)
        out["cpu_mixed16"] = done / (time.process_time() - cpu)  # per CPU-second: what another process's load hides
        assert done == sum(mixed_lengths()), (done, sum(mixed_lengths()))
    return out


def run_hf(path: Path, new_tokens: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    ps = prompts(model.config.vocab_size)
    kw = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
    out = {}
    with torch.inference_mode():
        model.generate(torch.tensor([ps[0]]), max_new_tokens=4, do_sample=False, pad_token_id=0)
        start = time.perf_counter()
        res = model.generate(torch.tensor([ps[0]]), **kw)
        out["batch1"] = (res.shape[1] - len(ps[0])) / (time.perf_counter() - start)
        width = max(map(len, ps))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in ps])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps])
        start = time.perf_counter()
        res = model.generate(ids, attention_mask=mask, **kw)
        out["batch16"] = BATCH * (res.shape[1] - width) / (time.perf_counter() - start)
        # mixed: 4 padded batches of 16 in arrival order, each runs until its longest request is done
        mixed, wants = prompts(model.config.vocab_size, MIXED), mixed_lengths()
        start = time.perf_counter()
        for b in range(0, MIXED, BATCH):
            ps_b, n = mixed[b : b + BATCH], max(wants[b : b + BATCH])
            width = max(map(len, ps_b))
            ids = torch.tensor([[0] * (width - len(p)) + p for p in ps_b])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in ps_b])
            res = model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                 pad_token_id=0)
            assert res.shape[1] - width == n
        out["mixed16"] = sum(wants) / (time.perf_counter() - start)
    return out


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    if args.child == "hf":
        result = run_hf(path, args.new_tokens)
    else:
        result = run_ours(path, args.new_tokens, async_scheduling=args.child == "ours-async")
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every child (same for both)")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="also run the engine with async scheduling, alternating with the others")
    parser.add_argument("--no-hf", action="store_true",
                        help="with --async-scheduling: only the engine, synchronous and async (no transformers, no "
                             "torch-matmul run)")
    parser.add_argument("--child", choices=IMPLS, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    from runtime.config import child_env

    if args.no_hf and not args.async_scheduling:
        parser.error("--no-hf leaves only the --async-scheduling comparison")
    impls = [i for i in IMPLS if (i not in ("hf", "ours-torch") or not args.no_hf)
             and (i != "ours-async" or args.async_scheduling)]
    rows = []
    for name in args.models.split(","):
        model_dir(name)  # build / convert once, outside the timed children
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for impl in impls:
                cmd = [sys.executable, __file__, "--child", impl, "--model", name,
                       "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
                env = child_env(TANDEM_CPU_LINEAR="torch" if impl == "ours-torch" else "onednn")
                done = subprocess.run(cmd, capture_output=True, text=True, check=True, env=env)
                res = json.loads(done.stdout.strip().splitlines()[-1])
                prev = best.setdefault(impl, res)
                for key in res:
                    if key != "peak_rss_mb":
                        prev[key] = max(prev[key], res[key])
                prev["peak_rss_mb"] = max(prev["peak_rss_mb"], res["peak_rss_mb"])
        rows.append((name, best))
    if not args.no_hf:
        print("| model | batch | ours tok/s | ours, torch matmul tok/s | transformers tok/s | ours / transformers |")
        print("|---|---|---|---|---|---|")
        for name, best in rows:
            ours, plain, hf = best["ours"], best["ours-torch"], best["hf"]
            for key, label in KEYS:
                print(f"| {name} | {label} | {ours[key]:.1f} | {plain[key]:.1f} | {hf[key]:.1f} "
                      f"| {ours[key] / hf[key]:.2f}× |")
        print()
        print("| model | ours peak RSS | transformers peak RSS |")
        print("|---|---|---|")
        for name, best in rows:
            print(f"| {name} | {best['ours']['peak_rss_mb']:.0f} MB | {best['hf']['peak_rss_mb']:.0f} MB |")
    if args.async_scheduling:
        print()
        print("| model | batch | ours tok/s | ours, async scheduling tok/s | async / sync "
              "| per CPU-second: sync | async | async / sync |")
        print("|---|---|---|---|---|---|---|---|")
        for name, best in rows:
            ours, fast = best["ours"], best["ours-async"]
            for key, label in KEYS:
                cpu = f"cpu_{key}"
                print(f"| {name} | {label} | {ours[key]:.1f} | {fast[key]:.1f} | {fast[key] / ours[key]:.3f}× "
                      f"| {ours[cpu]:.1f} | {fast[cpu]:.1f} | {fast[cpu] / ours[cpu]:.3f}× |")


if __name__ == "__main__":
    main()
