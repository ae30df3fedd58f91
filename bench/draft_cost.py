"""What one draft proposal round costs against one target decode step, per draft method, on this CPU.

Usage: .venv/bin/python bench/draft_cost.py [--threads 2] [--gamma 3,4] [--batch 1] [--prompts 8]
       [--max-tokens 48] [--methods eagle3,ngram,suffix,draft-model] [--draft-layers 6] [--profile]

In one process (CPU, float32, ``--threads`` torch threads): the demo target (SmolLM2-135M-Instruct)
decodes hand-written chat prompts (``bench/prompts/natural_chat.jsonl``, the tokenizer's chat
template) plainly, ``--batch`` requests in flight: the reference outputs. Then, per draft method and
γ, a plain pass whose median decode step is that row's unit (measured next to the row, since the load
of a shared machine drifts; ``--one-plain`` reuses the first pass), and a speculative pass: the
target's ``Engine`` and the draft worker's proposer exchange the same payloads as over gRPC (as
``bench/eagle3_check.py`` does). Per round in the steady state (every sequence of the round already
known to the draft, so no prompt ingestion), this bench times:

- draft round: ``proposer.propose(inputs)``, from the DraftInputs to the DraftOutputs;
- verdict: ``proposer.verified(verdicts)``, the draft side of a verdict;
- verify: the target's ``Engine.step`` with the proposals.

Reported: c = draft round / plain step, c per drafted token (round / γ), verify / plain step (v),
the mean acceptance length τ (1 + accepted / drafts, over rounds that drafted), tokens per round
(every steady round, with those where the draft proposed nothing) and the ideal speedup those imply
when nothing overlaps: tokens per round / ((draft round + verdict + target step) / plain step), means
of measured terms. Greedy speculative outputs are asserted equal to the plain ones.

Methods: ``eagle3`` (the bundled head), ``ngram``, ``suffix``, ``draft-model`` (the target truncated
to its first ``--draft-layers`` layers, ``bench/spec_bench.py``'s draft). ``--profile`` prints a
torch.profiler table of the EAGLE-3 rounds at the first γ.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPTS = ROOT / "bench/prompts/natural_chat.jsonl"


def median_ms(xs: list[float]) -> float:
    return 1e3 * statistics.median(xs) if xs else float("nan")


def mean_ms(xs: list[float]) -> float:
    return 1e3 * statistics.fmean(xs) if xs else float("nan")


def plain_run(engine, prompts: dict, params, batch: int) -> tuple[dict, list[float]]:
    """Plain decoding, ``batch`` requests at a time; outputs and the seconds of every decode step."""
    got = {rid: [] for rid in prompts}
    steps = []
    items = list(prompts.items())
    for i in range(0, len(items), batch):
        for rid, p in items[i : i + batch]:
            engine.add_request(rid, p, params)
        while engine.has_work():
            started = time.perf_counter()
            outputs = engine.step()
            seconds = time.perf_counter() - started
            if engine.last_step.tokens and engine.last_step.decoding == batch:  # a pure decode step, full batch
                steps.append(seconds)
            for rid, delta in outputs:
                got[rid].extend(delta.token_ids)
    return got, steps


def spec_run(engine, proposer, prompts: dict, params, batch: int, gamma: int, profile=None) -> dict:
    """Speculative decoding with ``proposer``; outputs and per-round timings (steady state only)."""
    got = {rid: [] for rid in prompts}
    seen: set[str] = set()
    t = {"round": [], "verdict": [], "verify": [], "emitted": 0, "steps": 0, "plain_steps": 0}
    items = list(prompts.items())
    for i in range(0, len(items), batch):
        for rid, p in items[i : i + batch]:
            engine.add_request(rid, p, params)
        while engine.has_work():
            inputs = engine.draft_inputs()
            steady = bool(inputs) and len(inputs) == batch and all(x.seq_id in seen for x in inputs)
            seen.update(x.seq_id for x in inputs)
            if steady and profile is not None:
                profile.start()
            started = time.perf_counter()
            proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
            round_s = time.perf_counter() - started
            if steady and profile is not None:
                profile.stop()
            started = time.perf_counter()
            outputs = engine.step(proposals)
            step_s = time.perf_counter() - started
            verdicts = engine.take_verdicts()
            started = time.perf_counter()
            proposer.verified(verdicts)
            verdict_s = time.perf_counter() - started
            proposer.release(engine.take_released())
            emitted = 0
            for rid, delta in outputs:
                got[rid].extend(delta.token_ids)
                emitted += len(delta.token_ids)
            st = engine.last_step
            if steady and st.tokens and st.decoding == batch:
                t["round"].append(round_s)
                t["verdict"].append(verdict_s)
                t["steps"] += 1
                t["emitted"] += emitted
                if st.verified:
                    t["verify"].append(step_s)
                else:  # nobody drafted anything: a plain step
                    t["plain_steps"] += 1
                t.setdefault("step", []).append(step_s)
    t["got"] = got
    return t


class Profile:
    """Accumulates torch.profiler samples over many short windows."""

    def __init__(self):
        from torch.profiler import ProfilerActivity, profile

        self.prof = profile(activities=[ProfilerActivity.CPU], record_shapes=False)
        self.prof.__enter__()
        self.on = False
        self.prof.toggle_collection_dynamic(False, [ProfilerActivity.CPU])

    def start(self):
        from torch.profiler import ProfilerActivity

        self.prof.toggle_collection_dynamic(True, [ProfilerActivity.CPU])

    def stop(self):
        from torch.profiler import ProfilerActivity

        self.prof.toggle_collection_dynamic(False, [ProfilerActivity.CPU])

    def report(self, rounds: int) -> str:
        self.prof.__exit__(None, None, None)
        return f"(over {rounds} rounds)\n" + self.prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gamma", default="3,4", help="comma-separated γ values")
    ap.add_argument("--batch", type=int, default=1, help="requests in flight")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=48)
    ap.add_argument("--methods", default="eagle3,ngram,suffix,draft-model")
    ap.add_argument("--draft-layers", type=int, default=6)
    ap.add_argument("--profile", action="store_true", help="torch.profiler table of the EAGLE-3 rounds (first γ)")
    ap.add_argument("--one-plain", action="store_true",
                    help="one plain pass for every row (default: a plain pass right before each row, as its unit)")
    ap.add_argument("--json", help="also write the rows here")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from runtime.messages import SamplingParams
    from runtime.spec_stats import mean_accepted_length
    from workers.demo_model import demo_head_dir, demo_model_dir
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.weights import load_model

    torch.set_num_threads(args.threads)
    gammas = [int(g) for g in args.gamma.split(",")]
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    target = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(target)
    lines = [json.loads(line) for line in PROMPTS.read_text().splitlines() if line.strip()][: args.prompts]
    prompts = {}
    for i, line in enumerate(lines):
        text = tok.apply_chat_template(line["messages"], add_generation_prompt=True, tokenize=False)
        prompts[f"p{i}"] = list(tok(text, add_special_tokens=False)["input_ids"])
    n = len(prompts) - len(prompts) % args.batch or len(prompts)
    prompts = dict(list(prompts.items())[:n])
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    cfg = EngineConfig(num_blocks=2048, block_size=16, max_num_seqs=max(8, args.batch))
    model = load_model(target)
    Engine(model, cfg).generate({"w": prompts["p0"]}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    plain, plain_steps = plain_run(Engine(model, cfg), prompts, params, args.batch)
    p_ms = median_ms(plain_steps)
    print(f"target plain decode step (batch {args.batch}, {args.threads} threads): median {p_ms:.2f} ms "
          f"over {len(plain_steps)} steps (the first pass: the reference outputs)", flush=True)

    def make(method: str):
        if method == "eagle3":
            from workers.draft.eagle import load_eagle, load_target_parts
            from workers.draft.eagle_proposer import EagleProposer

            embed, lm_head, tcfg = load_target_parts(target)
            head, layers = load_eagle(demo_head_dir(), embed, lm_head, tcfg, 2048)
            head = head.float().eval()
            return lambda: EagleProposer(head, layers, num_blocks=2048, block_size=16), layers
        if method == "ngram":
            from workers.draft.ngram import NgramProposer

            return lambda: NgramProposer(), []
        if method == "suffix":
            from workers.draft.suffix import SuffixProposer

            return lambda: SuffixProposer(), []
        if method == "draft-model":
            sys.path.insert(0, str(ROOT / "bench"))
            from spec_bench import build_draft

            from workers.draft.draft_model import DraftModelProposer

            draft = load_model(build_draft(target, args.draft_layers))
            return lambda: DraftModelProposer(draft, num_blocks=2048, block_size=16), []
        raise SystemExit(f"unknown method {method!r}")

    rows = []
    for method in methods:
        factory, layers = make(method)
        for gamma in gammas:
            profile = Profile() if args.profile and method == "eagle3" and gamma == gammas[0] else None
            if not args.one_plain:  # the unit, measured next to the row (the machine's load drifts)
                p_ms = median_ms(plain_run(Engine(model, cfg), prompts, params, args.batch)[1])
            engine = Engine(model, cfg, num_speculative_tokens=gamma, hidden_layers=tuple(layers), adaptive=False)
            t = spec_run(engine, factory(), prompts, params, args.batch, gamma, profile)
            bad = [rid for rid in prompts if t["got"][rid] != plain[rid]]
            assert not bad, f"{method} γ={gamma}: outputs differ from plain decoding for {bad}"
            c = engine.counters[""]
            tau = mean_accepted_length(c.num_accepted_tokens, c.num_drafts) or 1.0
            d_ms, r_ms, v_ms = median_ms(t["round"]), median_ms(t["verdict"]), median_ms(t["verify"])
            per_step = t["emitted"] / max(t["steps"], 1) / args.batch  # tokens per sequence per round
            cycle = mean_ms(t["round"]) + mean_ms(t["verdict"]) + mean_ms(t["step"])
            row = dict(method=method, gamma=gamma, plain_ms=p_ms, round_ms=d_ms, c=d_ms / p_ms,
                       c_tok=d_ms / p_ms / gamma, verdict_ms=r_ms, verify_ms=v_ms, v=v_ms / p_ms, tau=tau,
                       tokens_per_round=per_step, ideal=per_step / (cycle / p_ms), rounds=len(t["round"]),
                       plain_rounds=t["plain_steps"])
            rows.append(row)
            print(f"{method} γ={gamma}: plain step {p_ms:.2f} ms, round {d_ms:.3f} ms, verdict {r_ms:.3f} ms, verify {v_ms:.2f} ms, "
                  f"τ {tau:.2f}, {row['rounds']} rounds ({row['plain_rounds']} without drafts); outputs equal plain",
                  flush=True)
            if profile is not None:
                print(profile.report(len(t["round"])))
    print()
    print(f"batch {args.batch}, {args.threads} threads, {len(prompts)} prompts × {args.max_tokens} tokens, greedy")
    print()
    print("| method | γ | target plain step ms | draft round ms | c = round / step | c per drafted token | "
          "verdict ms | verify / plain step | acceptance length τ | tokens / round | ideal speedup |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['method']} | {r['gamma']} | {r['plain_ms']:.2f} | {r['round_ms']:.3f} | {r['c']:.3f} | "
              f"{r['c_tok']:.3f} | {r['verdict_ms']:.3f} | {r['v']:.2f} | {r['tau']:.2f} | "
              f"{r['tokens_per_round']:.2f} | {r['ideal']:.2f}× |")
    print()
    print("ideal speedup = tokens per round / ((draft round + verdict + target step) / plain step), means over "
          "steady rounds, nothing overlapped; τ = 1 + accepted / drafts over rounds that drafted")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
