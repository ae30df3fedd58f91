"""Engine throughput against transformers' ``generate`` on the same weights, same machine, same run.

Usage: .venv/bin/python bench/engine_bench.py [--models tiny,smollm2] [--new-tokens 64] [--repeats 3] [--threads 1]

For each model, child processes measure (one implementation per process, so peak RSS is its own):
  ours: the engine at batch 1 and with 16 concurrent requests (continuous batching, greedy);
  hf:   ``model.generate`` at batch 1 and on a left-padded batch of 16 (greedy, same prompts).
Tokens/s counts generated tokens only. Children alternate ours/hf ``--repeats`` times; the best
run of each is reported (the machine is shared and noisy).
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


def prompts(vocab: int, n: int = BATCH) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(rng.randrange(24, 48))] for _ in range(n)]


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


def run_ours(path: Path, new_tokens: int) -> dict:
    import torch

    from runtime.messages import SamplingParams
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model

    model = load_model(path, max_positions=1024)
    engine = Engine(model, EngineConfig(num_blocks=256, max_model_len=1024, max_num_batched_tokens=1024),
                    eos_token_ids=())
    ps = prompts(model.cfg.vocab_size)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    engine.generate({"warm": ps[0]}, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    engine.blocks.clear()  # no prefix hits from the warm-up
    out = {}
    with torch.inference_mode():
        start = time.perf_counter()
        res = engine.generate({"b1": ps[0]}, params)
        out["batch1"] = len(res["b1"]) / (time.perf_counter() - start)
        engine.blocks.clear()
        start = time.perf_counter()
        res = engine.generate({f"r{i}": p for i, p in enumerate(ps)}, params)
        out["batch16"] = sum(map(len, res.values())) / (time.perf_counter() - start)
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
    return out


def child(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    path = model_dir(args.model)
    result = (run_ours if args.child == "ours" else run_hf)(path, args.new_tokens)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps(result))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch threads in every child (same for both)")
    parser.add_argument("--child", choices=["ours", "hf"], default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for name in args.models.split(","):
        model_dir(name)  # build / convert once, outside the timed children
        best: dict[str, dict] = {}
        for _ in range(args.repeats):
            for impl in ("ours", "hf"):
                cmd = [sys.executable, __file__, "--child", impl, "--model", name,
                       "--new-tokens", str(args.new_tokens), "--threads", str(args.threads)]
                done = subprocess.run(cmd, capture_output=True, text=True, check=True)
                res = json.loads(done.stdout.strip().splitlines()[-1])
                prev = best.setdefault(impl, res)
                for key in ("batch1", "batch16"):
                    prev[key] = max(prev[key], res[key])
                prev["peak_rss_mb"] = max(prev["peak_rss_mb"], res["peak_rss_mb"])
        ours, hf = best["ours"], best["hf"]
        rows.append((name, ours, hf))
    print(f"| model | batch | ours tok/s | transformers tok/s | ratio | target |")
    print("|---|---|---|---|---|---|")
    for name, ours, hf in rows:
        for key, label, target in (("batch1", "1", "≥ 1.0×"), ("batch16", "16 concurrent / padded 16", "≥ 2×")):
            print(f"| {name} | {label} | {ours[key]:.1f} | {hf[key]:.1f} | {ours[key] / hf[key]:.2f}× | {target} |")
    print()
    print("| model | ours peak RSS | transformers peak RSS |")
    print("|---|---|---|")
    for name, ours, hf in rows:
        print(f"| {name} | {ours['peak_rss_mb']:.0f} MB | {hf['peak_rss_mb']:.0f} MB |")


if __name__ == "__main__":
    main()
