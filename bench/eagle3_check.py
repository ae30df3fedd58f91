"""Greedy equality and acceptance of a trained draft head on prompts it was not trained on.

Usage: .venv/bin/python bench/eagle3_check.py HEAD_DIR [--prompt-set natural|generator] [--prompts 68]
       [--max-tokens 48] [--gamma 3] [--topk K] [--ignore-eos]

HEAD_DIR: an EAGLE-3 / EAGLE head, Medusa heads or an MLP speculator (``tandem train-draft --head``).

In one process (CPU, float32): the demo target decodes every prompt plainly, then speculates with the
head at batch 1 and with 8 requests in flight (the target's ``Engine`` and the draft worker's
``EagleProposer`` or ``HeadProposer``, exchanging the same typed payloads as over gRPC). Every speculative output must
equal the plain one token for token. Prompts: ``natural`` (the default) = the hand-written chat prompts
of ``bench/prompts/natural_chat.jsonl``, written apart from any generator, replies ending at the end
of turn as a user sees them; ``generator`` = the train-draft template generator under a seed no
training run uses (``--ignore-eos`` as the older figures were taken). Prints equality, the mean
acceptance length (vLLM's 1 + accepted / drafts), accepted drafts per position and the engine-level
tokens/s of each run.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("head")
    ap.add_argument("--prompt-set", choices=["natural", "generator"], default="natural")
    ap.add_argument("--prompts", type=int, default=0, help="how many (0: all natural ones, 50 generated)")
    ap.add_argument("--batches", type=lambda v: [int(x) for x in v.split(",")], default=[1, 8],
                    help="requests in flight per speculative run (default 1,8)")
    ap.add_argument("--ignore-eos", action="store_true", help="every reply runs to --max-tokens")
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--topk", type=int, default=1, help="draft trees: children per node (1: chains; γ is the node budget)")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from runtime.messages import SamplingParams
    from runtime.spec_stats import mean_accepted_length
    from workers.demo_model import demo_model_dir
    from workers.draft.eagle import load_eagle, load_target_parts
    from workers.draft.eagle_proposer import EagleProposer
    from bench.natural import natural_prompt_ids
    from workers.draft.train.prompts import held_out_prompts
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model

    torch.set_num_threads(args.threads)
    target = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(target)
    if args.prompt_set == "natural":
        prompts = {f"n{i}": p for i, p in enumerate(natural_prompt_ids(tok, args.prompts or None))}
    else:
        prompts = held_out_prompts(tok, args.prompts or 50)
    model = load_model(target)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=args.ignore_eos)
    cfg = EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=8)
    started = time.perf_counter()
    plain = Engine(model, cfg).generate(prompts, params)
    plain_s = time.perf_counter() - started
    embed, lm_head, target_cfg = load_target_parts(target)
    from workers.draft.head_proposer import HeadProposer
    from workers.draft.spec_heads import head_kind, load_spec_head

    if head_kind(args.head):  # Medusa / MLP speculator: the target's last hidden state
        head = load_spec_head(args.head, target_cfg.hidden_size, target_cfg.vocab_size, lm_head).float()
        layers = [target_cfg.num_layers]

        def make_proposer():
            return HeadProposer(head, target_cfg.num_layers, tree_topk=args.topk)
    else:
        head, layers = load_eagle(args.head, embed, lm_head, target_cfg, 2048)

        def make_proposer():
            return EagleProposer(head, layers, num_blocks=2048, block_size=16, tree_topk=args.topk)
    total = sum(len(v) for v in plain.values())
    print(f"plain (batch of 8 in flight): {total / plain_s:.1f} tok/s")
    for batch in args.batches:
        engine = Engine(model, cfg, num_speculative_tokens=args.gamma, hidden_layers=tuple(layers), adaptive=False)
        proposer = make_proposer()
        got, drafts, accepted = {}, 0, 0
        PER_POS.clear()
        WIRE.update(bytes=0, seconds=0.0, steps=0, step_seconds=0.0)
        items = list(prompts.items())
        started = time.perf_counter()
        for i in range(0, len(items), batch):
            out, d, a = run(engine, proposer, dict(items[i : i + batch]), params)
            got.update(out)
            drafts, accepted = drafts + d, accepted + a
        seconds = time.perf_counter() - started
        same = sum(got[k] == plain[k] for k in prompts)
        print(f"batch {batch}: {same}/{len(prompts)} outputs equal to plain decoding; mean acceptance length "
              f"{mean_accepted_length(accepted, drafts) or 1.0:.2f} at γ={args.gamma} ({drafts} drafts); "
              f"{total / seconds:.1f} tok/s; accepted per position "
              f"{[round(n / drafts, 3) for n in PER_POS] if drafts else []}")
        print(f"  hidden states on the wire ({proposer.caps.hidden_dtype}): {WIRE['bytes'] / WIRE['steps']:.0f} bytes per "
              f"target step; converting and serialising them {1e3 * WIRE['seconds'] / WIRE['steps']:.3f} ms per step "
              f"= {WIRE['seconds'] / WIRE['step_seconds']:.2%} of a target step")
        if same != len(prompts):
            sys.exit("speculative output differs from plain decoding")


WIRE = {"bytes": 0, "seconds": 0.0, "steps": 0, "step_seconds": 0.0}
PER_POS: list[int] = []
def _wire(inputs, verdicts, dtype: str) -> None:
    """What the target's draft client would put on the wire for these: hidden-state bytes and the
    time to convert and serialise the messages."""
    from workers.speculation.convert import draft_input_to_pb, verify_to_pb

    started = time.perf_counter()
    msgs = [draft_input_to_pb(d, dtype) for d in inputs] + [verify_to_pb(v, dtype) for v in verdicts]
    for m in msgs:
        m.SerializeToString()
    WIRE["seconds"] += time.perf_counter() - started
    WIRE["bytes"] += sum(len(h.data) for m in msgs for h in m.hidden_states)


def run(engine, proposer, prompts: dict, params) -> tuple[dict, int, int]:
    got = {rid: [] for rid in prompts}
    drafts = accepted = 0
    for rid, p in prompts.items():
        engine.add_request(rid, p, params)
    while engine.has_work():
        inputs = engine.draft_inputs()
        proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
        started = time.perf_counter()
        outputs = engine.step(proposals)
        WIRE["step_seconds"] += time.perf_counter() - started
        WIRE["steps"] += 1
        verdicts = engine.take_verdicts()
        _wire(inputs, verdicts, proposer.caps.hidden_dtype)
        for rid, delta in outputs:
            got[rid].extend(delta.token_ids)
            if delta.finish_reason and delta.usage is not None and delta.usage.spec is not None:
                drafts += delta.usage.spec.num_drafts
                accepted += delta.usage.spec.num_accepted_tokens
                for i, n in enumerate(delta.usage.spec.accepted_per_pos):
                    if i == len(PER_POS):
                        PER_POS.append(0)
                    PER_POS[i] += n
        proposer.verified(verdicts)
        proposer.release(engine.take_released())
    return got, drafts, accepted


if __name__ == "__main__":
    main()
