"""Where an EAGLE-3 head's acceptance goes between training and serving, on one prompt set.

Usage: .venv/bin/python bench/head_gap.py [HEAD_DIR] [--prompts 16] [--max-tokens 48] [--gamma 3]
       [--set eval|held-out] [--ignore-eos]

In one process on the CPU (float32), for the same prompts and the demo target's own greedy replies:

1. teacher-forced, as ``tandem train-draft`` evaluates (training-time test: target features for the
   prefix, the head's own features for later steps): top-1 per step and acceptance length;
2. live: the target's ``Engine`` verifying the head's chains (``EagleProposer``), fixed γ, batch 8:
   acceptance per position and mean acceptance length; every live first draft token is also checked
   against a fresh proposer given the whole committed context, so a bug in the proposer's incremental
   state (KV rollback, features from verdicts) shows as a mismatch.

``--set eval`` takes the generator's evaluation conversations (the split a training run reports on);
``held-out`` the generator's held-out seed (what ``bench/eagle3_check.py`` uses).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DEFAULT_HEAD = ROOT / "workers/draft/heads/smollm2-135m-instruct-eagle3"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("head", nargs="?", default=str(DEFAULT_HEAD))
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--set", choices=("eval", "held-out"), default="held-out")
    ap.add_argument("--ignore-eos", action="store_true")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from runtime.messages import SamplingParams
    from workers.demo_model import demo_model_dir
    from workers.draft.eagle import load_eagle, load_target_parts
    from workers.draft.eagle_proposer import EagleProposer
    from workers.draft.train.data import SampleMaker
    from workers.draft.train.prompts import HELD_OUT_SEED, conversation
    from workers.draft.train.trainer import TrainConfig, evaluate
    from workers.draft.train.ttt import ttt_forward
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model
    from workers.speculation.payloads import DraftInput

    torch.set_num_threads(args.threads)
    target = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(target)
    embed, lm_head, tcfg = load_target_parts(target)
    head, layers = load_eagle(args.head, embed, lm_head, tcfg, 2048)
    head = head.float().eval()
    model = load_model(target)
    train_seed = TrainConfig.__dataclass_fields__["seed"].default  # a default run's seeds: s (train), s + 1_000_003 (eval)
    seed = train_seed + 1_000_003 if args.set == "eval" else HELD_OUT_SEED
    prompts = {}
    for i in range(args.prompts):
        text = tok.apply_chat_template(conversation(seed, i)["messages"], add_generation_prompt=True, tokenize=False)
        prompts[f"p{i}"] = list(tok(text, add_special_tokens=False)["input_ids"])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    cfg = EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=8)
    replies = Engine(model, cfg).generate(prompts, params)

    maker = SampleMaker(model, tok, layers, max_tokens=args.max_tokens, batch=8, max_len=1024)
    samples = [maker.hidden(prompts[r] + replies[r], [False] * len(prompts[r]) + [True] * len(replies[r]))
               for r in prompts if len(replies[r]) >= 2]
    d2t = head.d2t
    t2d = torch.full((tcfg.vocab_size,), -1, dtype=torch.long)
    t2d[torch.arange(d2t.shape[0]) + d2t] = torch.arange(d2t.shape[0])
    reachable = set((torch.arange(d2t.shape[0]) + d2t).tolist())
    reply_tokens = [t for r in replies.values() for t in r]
    tf = evaluate(lambda s: ttt_forward(head, embed, s["tokens"], s["hidden"].float(), s["mask"], t2d, args.gamma),
                  samples, args.gamma)

    engine = Engine(model, cfg, num_speculative_tokens=args.gamma, hidden_layers=tuple(layers), adaptive=False)
    proposer = EagleProposer(head, layers, num_blocks=2048, block_size=16)
    mismatches = checked = 0
    items = list(prompts.items())
    for start in range(0, len(items), 8):
        for rid, p in items[start : start + 8]:
            engine.add_request(rid, p, params)
        while engine.has_work():
            inputs = engine.draft_inputs()
            proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
            for inp in inputs:
                seq = engine.seqs[inp.seq_id]
                [rows] = engine.news.rows([seq], [(0, len(seq) - 1)], tuple(layers), None)
                fresh = EagleProposer(head, layers, num_blocks=256, block_size=16)
                first = fresh.propose([DraftInput("x", 0, list(seq.token_ids), 1, hidden_states=rows)])[0].token_ids
                checked += 1
                mismatches += first != proposals[inp.seq_id].token_ids[:1]
            engine.step(proposals)
            proposer.verified(engine.take_verdicts())
            proposer.release(engine.take_released())
    c = engine.counters[""]
    print(f"prompts: {args.set} × {args.prompts}, {args.max_tokens} tokens, ignore_eos={args.ignore_eos}, γ={args.gamma}")
    print(f"reply tokens in the draft vocabulary: {sum(t in reachable for t in reply_tokens) / len(reply_tokens):.3f}")
    print(f"teacher-forced: top-1 per step {[round(x, 3) for x in tf['top1_per_step']]}, "
          f"acceptance length {tf['acceptance_length']:.3f} ({tf['chains']} chains)")
    print(f"live: accepted per position {[round(x / c.num_drafts, 3) for x in c.accepted_per_pos]}, "
          f"mean acceptance length {1 + c.num_accepted_tokens / c.num_drafts:.3f} ({c.num_drafts} drafts)")
    print(f"live first draft tokens differing from a fresh proposer's: {mismatches} of {checked}")


if __name__ == "__main__":
    main()
