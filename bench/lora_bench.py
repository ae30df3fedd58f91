"""Multi-LoRA cost per token: decode throughput of a batch with 0, 1, 4 and 16 adapters in it.

Usage: .venv/bin/python bench/lora_bench.py [--model smollm2|tiny] [--batch 16] [--new-tokens 48]
                                            [--rank 16] [--repeats 3] [--threads 2] [--device cpu|cuda]
       .venv/bin/python bench/lora_bench.py --speculation [--new-tokens 48]

One engine (``--max-loras 16``) serves ``--batch`` greedy requests at once, in four mixes: all on
the base model (no adapter code runs), all on one adapter, spread over 4 adapters, and one adapter
each (16). The adapters are PEFT LoRAs of rank ``--rank`` on every attention and MLP projection,
written by ``peft`` itself with random (not zero) A and B (``init_lora_weights=False``): their
values do not change the cost. Prefill is run first and not timed; the decode steps are. The mixes
alternate ``--repeats`` times in one process (in reverse order every other time) and the best run of each is reported (the machine is
shared and noisy), with its ratio to the base.

``--speculation``: how lossless speculation with adapters costs acceptance. The base model drafts
(a draft knows no adapter) and the target verifies under each request's adapter; the base model's
own requests accept every draft, an adapter's accept what its adapter agrees with.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

MIXES = (("base", 0), ("1 adapter", 1), ("4 adapters", 4), ("16 adapters", 16))
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def model_dir(name: str) -> Path:
    if name == "tiny":
        from bench.engine_bench import tiny_model_dir

        return tiny_model_dir()
    from workers.demo_model import demo_model_dir

    return demo_model_dir()


def write_adapters(base: Path, n: int, rank: int, out: Path) -> list[Path]:
    """``n`` PEFT adapters with random weights (peft's own ``init_lora_weights=False``) on ``base``."""
    import torch
    import transformers as tf
    from peft import LoraConfig, get_peft_model

    paths = []
    model = tf.AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    for i in range(n):
        torch.manual_seed(i)
        cfg = LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, init_lora_weights=False,
                         task_type="CAUSAL_LM")
        peft_model = get_peft_model(model, cfg)
        path = out / f"adapter{i}"
        peft_model.save_pretrained(str(path))
        model = peft_model.unload()  # the base back, without this adapter's layers
        paths.append(path)
    return paths


def run_mix(engine, prompts: list[list[int]], adapters: list[str | None], new_tokens: int) -> float:
    """Decode tokens/s of one batch (prefill first, untimed)."""
    from runtime.messages import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i, (p, name) in enumerate(zip(prompts, adapters)):
        engine.add_request(f"r{i}", p, params, lora=name)
    tokens = 0
    while any(s.num_computed < s.num_prompt_tokens for s in engine.seqs.values()) or engine.scheduler.waiting:
        tokens += sum(len(d.token_ids) for _, d in engine.step())
    start, decoded = time.perf_counter(), 0
    while engine.has_work():
        decoded += sum(len(d.token_ids) for _, d in engine.step())
    return decoded / (time.perf_counter() - start)


def speculation(requests: int, new_tokens: int) -> None:
    """Acceptance when the base model drafts and the target verifies under an adapter (lossless),
    against base requests, on a seeded tiny Llama with two adapters trained by peft (tests/support)."""
    import torch

    from runtime.messages import SamplingParams
    from tests.support.lora import train_lora
    from tests.unit.workers.engine.helpers import tiny_hf_model
    from workers.draft.draft_model import DraftModelProposer
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.lora import LoraManager
    from workers.engine.weights import load_model

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        tiny_hf_model("llama", root / "base", vocab=256)
        train_lora(root / "base", root / "a1", seed=1)
        train_lora(root / "base", root / "a2", seed=2, rank=4, targets=("q_proj", "v_proj"))
        model = load_model(root / "base")
        engine = Engine(model, EngineConfig(num_blocks=1024, block_size=4, max_num_seqs=64), eos_token_ids=(),
                        lora=LoraManager(model, 2, 8))
        engine.load_lora("a1", str(root / "a1"))
        engine.load_lora("a2", str(root / "a2"))
        proposer = DraftModelProposer(load_model(root / "base"), num_blocks=1024, block_size=4)
    rng = random.Random(0)
    names = [None, "a1", "a2"]
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True)
    for i in range(requests * len(names)):
        engine.add_request(f"r{i}", [rng.randrange(256) for _ in range(16)], params, lora=names[i % len(names)],
                           num_speculative_tokens=3)
    usage = {}
    while engine.has_work():
        inputs = engine.draft_inputs()
        proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
        for rid, delta in engine.step(proposals):
            if delta.usage is not None:
                usage[rid] = delta.usage.spec
        proposer.verified(engine.take_verdicts())
        proposer.release(engine.take_released())
    print(f"speculation: the base model drafts γ=3 for {requests} greedy requests per adapter, "
          f"{new_tokens} tokens each (tiny Llama, adapters trained by peft)")
    print("| requests on | draft tokens | accepted | acceptance | mean accepted per verify |")
    print("|---|---:|---:|---:|---:|")
    for j, name in enumerate(names):
        spec = [usage[f"r{i}"] for i in range(j, requests * len(names), len(names)) if usage.get(f"r{i}")]
        drafted = sum(u.num_draft_tokens for u in spec)
        accepted = sum(u.num_accepted_tokens for u in spec)
        drafts = sum(u.num_drafts for u in spec)
        print(f"| {name or 'base'} | {drafted} | {accepted} | {accepted / max(drafted, 1):.2f} | "
              f"{accepted / max(drafts, 1):.2f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", choices=["smollm2", "tiny"])
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default=None, help="default: float32 on CPU, bfloat16 on CUDA")
    parser.add_argument("--speculation", action="store_true",
                        help="instead: acceptance of base-model drafts verified under adapters (tiny model)")
    args = parser.parse_args()
    if args.speculation:
        speculation(8, args.new_tokens)
        return
    import torch

    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.lora import LoraManager
    from workers.engine.weights import load_model

    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    base = model_dir(args.model)
    fused = args.device.startswith("cuda")
    model = load_model(base, dtype=dtype, device=args.device, fused=fused)
    params = sum(p.numel() for p in model.parameters())  # before the engine packs (and frees) CPU weights
    names = [f"a{i}" for i in range(max(n for _, n in MIXES))]
    lora = LoraManager(model, len(names), args.rank)
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=2048, max_num_seqs=args.batch,
                                        max_num_batched_tokens=4096, enable_prefix_caching=False),
                    eos_token_ids=(), lora=lora)
    with tempfile.TemporaryDirectory() as tmp:
        for name, path in zip(names, write_adapters(base, len(names), args.rank, Path(tmp))):
            engine.load_lora(name, str(path))
    rng = random.Random(0)
    vocab = model.cfg.vocab_size
    prompts = [[rng.randrange(3, vocab) for _ in range(rng.randrange(24, 48))] for _ in range(args.batch)]
    best = {label: 0.0 for label, _ in MIXES}
    run_mix(engine, prompts, [None] * args.batch, 4)  # warm-up: kernels, packed weights
    run_mix(engine, prompts, [names[i % 16] for i in range(args.batch)], 4)
    for repeat in range(args.repeats):
        for label, n in (MIXES if repeat % 2 == 0 else MIXES[::-1]):  # no mix always runs first
            adapters = [names[i % n] if n else None for i in range(args.batch)]
            best[label] = max(best[label], run_mix(engine, prompts, adapters, args.new_tokens))
    device = torch.cuda.get_device_name() if args.device.startswith("cuda") else f"CPU, {args.threads} threads"
    print(f"model {args.model} ({params / 1e6:.0f}M), {dtype}, {device}; "
          f"batch {args.batch}, {args.new_tokens} decode tokens each, rank {args.rank} on all 7 projections; "
          f"best of {args.repeats}")
    print("| mix | decode tok/s | vs base |")
    print("|---|---:|---:|")
    for label, _ in MIXES:
        print(f"| {label} | {best[label]:.0f} | {best[label] / best['base']:.2f} |")


if __name__ == "__main__":
    main()
