"""Tokens per target step of the demo model with its bundled EAGLE-3 head (or, ``--draft ngram``,
of the served bench's tiny target with an n-gram draft), synchronous seam against the pipelined
seam, in one process and without clocks: what the seams can emit per step, apart from what a step
or the wire costs.

Usage: .venv/bin/python bench/eagle_stage_bench.py [--prompts 6] [--max-tokens 48] [--gamma 4]
       [--runs sync,pipelined:1:1,pipelined:1:3,pipelined:2:1] [--draft eagle3|ngram]

Each request runs alone (batch 1), greedy, on hand-written chat (``bench/prompts/natural_chat.jsonl``;
``--draft ngram``: the tiny target of ``served_bench.py --tiny-target`` on its repetitive prompts,
``bench/prompts/repetitive.jsonl``, with the n-gram draft's defaults, 1 to 4 tokens).
``sync``: each step verifies the proposal the head drafted from everything committed before it (the
synchronous seam with the draft's answer always in time: its ceiling). ``pipelined:L:A``: the target
never waits; the stager (:mod:`workers.draft.stager`, ``A`` = ``--speculative-config``'s
``stage_alternatives``) drafts from each step's news (commits with their hidden rows, verdicts) exactly as the draft service does, and
what it drafts reaches the target ``L`` steps later (L = 1: the draft answers within one target
step, as on a target slower than its draft; an answer can never come sooner, since the target does
not wait for it). Reported per run: tokens emitted / target steps (the prefill's token included),
verify steps, mean acceptance length over them, why the other steps ran plain, and whether the
outputs equal plain decoding.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import deque
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from runtime.messages import SamplingParams  # noqa: E402
from workers.demo_model import DEMO_HEAD, demo_model_dir, demo_tokenizer_dir  # noqa: E402
from workers.draft.eagle import load_eagle, load_target_parts  # noqa: E402
from workers.draft.eagle_proposer import EagleProposer  # noqa: E402
from workers.draft.ngram import NgramProposer  # noqa: E402
from workers.draft.stager import Stager  # noqa: E402
from workers.engine.engine import Engine, EngineConfig  # noqa: E402
from workers.engine.weights import load_model  # noqa: E402


def run(model, make_proposer, layers, batch, params, gamma: int, mode: str, lag: int, alternatives: int,
        want) -> str:
    engine = Engine(model, EngineConfig(block_size=16, num_blocks=1024, max_num_seqs=1),
                    num_speculative_tokens=gamma, hidden_layers=tuple(layers), adaptive=False)
    engine.spec.pipelined = mode == "pipelined"
    proposer = make_proposer()
    stager = Stager(proposer, alternatives)
    out = {rid: [] for rid in batch}
    steps = 0
    for rid, prompt in batch.items():  # one at a time
        engine.add_request(rid, prompt, params)
        in_flight: deque = deque()
        proposals: dict = {}
        while engine.has_work():
            for r, delta in engine.step(proposals):
                out[r].extend(delta.token_ids)
            steps += 1
            if mode == "sync":
                proposer.verified(engine.take_verdicts())
                proposer.release(engine.take_released())
                inputs = engine.draft_inputs()
                proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
                continue
            stager.verified(engine.take_verdicts())
            stager.release(engine.take_released())
            inputs = engine.draft_inputs()
            for d in inputs:
                stager.commit(d.seq_id, d.round, list(d.new_tokens), d.chain_budget, d.hidden_states,
                              d.sampling)
            answers, asked = stager.answer_and_stage([d.seq_id for d in inputs])
            in_flight.append(answers + stager.stage(asked))
            while len(in_flight) > lag:
                engine.offer(in_flight.popleft())
    c = engine.counters[""]
    tokens = sum(len(v) for v in out.values())
    name = "sync" if mode == "sync" else f"pipelined, lag {lag}, alternatives {alternatives}"
    plain = ", ".join(f"{k} {v}" for k, v in sorted(engine.spec.plain_steps.items()))
    return (f"| {name} | {tokens} | {steps} | {tokens / steps:.3f} | {c.num_drafts} | "
            f"{1 + c.num_accepted_tokens / max(c.num_drafts, 1):.2f} | {plain or '–'} | {out == want} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--runs", default="sync,pipelined:1:1,pipelined:1:3,pipelined:2:1")
    ap.add_argument("--draft", choices=["eagle3", "ngram"], default="eagle3",
                    help="ngram: the tiny target of served_bench.py --tiny-target, on repetitive prompts")
    args = ap.parse_args()
    torch.set_num_threads(1)
    from transformers import AutoTokenizer

    if args.draft == "eagle3":
        path = demo_model_dir()
        embed, lm_head, tcfg = load_target_parts(path)
        head, layers = load_eagle(DEMO_HEAD, embed, lm_head, tcfg, 2048)
        make_proposer, prompts = (lambda: EagleProposer(head, layers, 1024, 16)), "natural_chat.jsonl"
    else:
        sys.path.insert(0, str(ROOT / "bench"))
        from served_bench import tiny_target

        path, layers, prompts = tiny_target(), (), "repetitive.jsonl"
        make_proposer = NgramProposer
    model = load_model(path)
    tok = AutoTokenizer.from_pretrained(demo_tokenizer_dir())
    lines = [json.loads(line) for line in (ROOT / "bench/prompts" / prompts).read_text().splitlines()]
    batch = {str(i): tok(tok.apply_chat_template(line["messages"], add_generation_prompt=True, tokenize=False))[
        "input_ids"] for i, line in enumerate(lines[: args.prompts])}
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    want = Engine(model, EngineConfig(block_size=16, num_blocks=1024)).generate(batch, params)
    print(f"{len(batch)} prompts, {args.max_tokens} tokens, greedy, batch 1, γ = {args.gamma}\n")
    print("| seam | tokens | target steps | tokens / step | verify steps | acceptance length | plain steps | equal |")
    print("|---|---|---|---|---|---|---|---|")
    for spec in args.runs.split(","):
        mode, *rest = spec.split(":")
        lag, alternatives = (int(rest[0]), int(rest[1])) if rest else (0, 1)
        print(run(model, make_proposer, layers, batch, params, args.gamma, mode, lag, alternatives, want), flush=True)


if __name__ == "__main__":
    main()
