"""The draft seam under load: the synchronous seam, the pipelined seam and the ideal, side by side.

Usage: .venv/bin/python bench/spec_pipeline_bench.py [--tokens 96] [--batches 1,8] [--alphas 0.6,0.8]
       [--cells 0.05:4,0.3:1,0.3:2] [--repeats 3]
       python3 bench/spec_pipeline_bench.py --gpu   (bench/gpu_check.sh's oracle part)

``--gpu``: the target is a random-weight Llama-3.1-8B-shaped model in bf16 on CUDA with CUDA graphs
(buckets up to batch 8), batch 1 and 8, α = 0.8, a draft costing 0.05 of a plain step per token (the
EAGLE-3 head's measured c is 0.068 on an H200) at γ = 4, two repeats. Its weights give wide argmax
margins (the head tied to the embeddings, residual branches scaled down: see ``build_gpu_model``),
since in bf16 a verify step's arithmetic differs from a decode step's (other shapes, other kernels)
and near-tied argmaxes would flip; the outputs equal to plain decoding are counted, not asserted.

The target is the target worker's own step loop (``StepLoop``) on a small random Llama built in code
(``--hidden``, ``--layers``; one torch thread), in this process. The draft is a real ``DraftService``
with the oracle proposer in a child process, reached over gRPC on loopback: the seam is what is
measured. The oracle knows the target's greedy continuations (computed first, plainly) and drafts
each token wrong with probability 1 − α; each drafted token costs ``cost`` × the target's plain step
time at that batch (the median step of three warm plain runs, once per batch size), spent as a sleep
(as on its own device), once per draft depth for a whole batch of sequences and branches. The
machine's speed drifts between runs, so the cost column also gives the cost as run: against each
repeat's own plain step, the median over the repeats.

For each batch size and (α, cost, γ): a plain run (no draft) and one run per seam, repeated
interleaved (so that a slow spell of this shared machine hits all alike); each ratio's median over
the repeats is reported. Step times are medians over the loop's iterations that stepped, each the
whole cycle (step, conversions, delivery) less its wait for proposals: T_plain over the plain run's,
T_verify over the synchronous run's iterations that verified proposals (a verify step with the
draft's time taken out: the draft fully hidden). The ideal speedup is E(α, γ) × T_plain / T_verify
with E = (1 − α^(γ+1)) / (1 − α), the expected tokens of a round. The oracle's errors are random
draws (each cell its own seed), so a run's acceptance may fall short of E or exceed it: the column
"at its drawn acceptance" divides by the ideal at the tokens per round the pipelined run drew
instead, which is the share of the draft's time the seam hid. A batch of one runs longer requests
(``--sequence-tokens`` in all) to draw enough rounds. Every speculative run's outputs are checked
equal to the plain run's.
Speedups are decode-phase tokens/s (tokens after each request's first, from the moment every request
has its first token to the last token) over the plain run's. The ideal is a whole batch's rate, but
speculative requests of equal length finish rounds apart (each draws its own acceptance) and the
last rounds then run part of the batch at nearly a whole batch's step cost; so the column "whole
batch" takes the tokens/s of each run while every request of the batch decodes (from the cycle by
which all have their first token to the first cycle that finishes one; for plain requests, which
all finish in one cycle, and for a batch of one, that is the whole decode phase), and the target
≥ 0.9 of ideal is read there. ``draft wait`` is the loop's time
waiting on proposals (``tandem_target_draft_wait_seconds_total``) over its busy time. ``--cells``
pairs each draft cost with a γ: a draft that is to hide behind verification must draft the γ + 1
tokens a round can advance within one verify step (its staging is γ + 1 batched draft passes), so a
draft costing 0.3 of a plain step per token hides γ = 1 and, on a verify step barely longer than a
plain one, not quite γ = 2.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # the target and the draft share the cores


async def serve_draft(refs: str, error_rate: float, token_cost_ms: float, vocab: int, seed: int = 1) -> None:
    """Child mode: an oracle DraftService on a free loopback port; prints the port."""
    from bench.loopback_draft import serve_on_loopback
    from workers.draft.oracle import OracleProposer

    proposer = OracleProposer.from_file(refs, error_rate, vocab, seed=seed, token_cost_s=token_cost_ms / 1000)
    await serve_on_loopback(proposer, "bench-draft")


def build_model(hidden: int, layers: int, vocab: int):
    import torch

    from workers.engine.config import ModelConfig
    from workers.engine.model import DecoderModel

    torch.manual_seed(0)
    torch.set_num_threads(1)
    heads = max(1, hidden // 64)
    cfg = ModelConfig(model_type="llama", vocab_size=vocab, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_layers=layers, num_heads=heads, num_kv_heads=heads, head_dim=hidden // heads,
                      max_position_embeddings=1024)
    model = DecoderModel(cfg, 1024)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    model.reset_buffers()
    return model.eval()


GPU = False  # --gpu: an 8B-shaped bf16 target on CUDA (see the module docstring)


def build_gpu_model():
    """A random-weight Llama-3.1-8B-shaped model in bf16 on CUDA (bench/gpu_bench.py's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench", ROOT / "bench" / "gpu_bench.py")
    gpu_bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_bench)
    model = gpu_bench.random_model(gpu_bench.llama8b_config(32), max_positions=2048)
    import torch

    # Wide argmax margins: the head reads back the token embedding that dominates the residual stream
    # (embeddings scaled up, residual branches down, head = embeddings: each step repeats its last
    # token, by a margin no rounding flips). With gpu_bench's plain random weights, bf16
    # verify and decode kernels (other shapes) flipped near-tied argmaxes, every output left the
    # plain run's at batch 8, and the oracle, drafting from those references, had nothing to propose
    # from there on (641 plain sequence steps of 768 on an H200). The step costs are the 8B shape's.
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("o_proj.weight", "down_proj.weight")):
                p.mul_(0.02)
        model.model.embed_tokens.weight.mul_(64)
        if model.lm_head.weight is not model.model.embed_tokens.weight:
            model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    return model


def engine_for(model, gamma: int):
    from workers.engine.engine import Engine, EngineConfig

    config = EngineConfig(num_blocks=1024, block_size=16, max_num_seqs=16, cuda_graph_max_batch=8 if GPU else None)
    return Engine(model, config, eos_token_ids=(), num_speculative_tokens=gamma, adaptive=False, load_aware=False)


def prompts_for(batch: int, vocab: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % vocab for j in range(24 + i)] for i in range(batch)]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far, all its threads (0.0 where /proc is absent)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def run_once(engine, pool, prompts: list[list[int]], tokens: int, tag: str, draft_pid: int = 0) -> dict:
    """Serve ``prompts`` on a fresh step loop; decode-phase tokens/s, the loop's counters, and the CPU
    time the target (this process) and the draft worker (``draft_pid``) spent a step."""
    from runtime.messages import SamplingParams
    from workers.target.step_loop import StepLoop

    loop = StepLoop(engine, pool, "bench-target", propose_timeout=2.0)
    cycles: list[float] = []  # seconds of each iteration that stepped, less its wait for proposals
    verify_cycles: list[float] = []  # of those, the iterations that verified proposals
    iteration = loop._iteration

    def drafts() -> int:
        return sum(c.num_drafts for c in engine.counters.values())

    async def timed_iteration():
        steps, verified, waited, started = loop.steps, drafts(), loop.drafting.wait_seconds, time.perf_counter()
        await iteration()
        if loop.steps > steps:
            cycles.append(time.perf_counter() - started - (loop.drafting.wait_seconds - waited))
            if drafts() > verified:
                verify_cycles.append(cycles[-1])

    loop._iteration = timed_iteration
    deliveries: list[tuple[float, int, set, bool]] = []  # per cycle: when, tokens, requests served, one finished
    deliver = loop._deliver

    def timed_deliver(outputs):
        deliver(outputs)
        if outputs:
            deliveries.append((time.perf_counter(), sum(len(d.token_ids) for _, d in outputs),
                               {rid for rid, _ in outputs}, any(d.finish_reason for _, d in outputs)))

    loop._deliver = timed_deliver
    loop.start()
    if pool is not None:
        deadline = time.monotonic() + 30
        while await pool.poll() is None:
            assert time.monotonic() < deadline, "no draft stream"
            await asyncio.sleep(0.05)
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    firsts: list[float] = []
    outputs: dict[str, list[int]] = {}

    async def one(i: int, prompt: list[int]):
        rid = f"{tag}-{i}"
        queue = loop.submit(rid, prompt, params)
        out = outputs[rid] = []
        while True:
            delta = await queue.get()
            if isinstance(delta, BaseException):
                raise delta
            if not out:
                firsts.append(time.perf_counter())
            out.extend(delta.token_ids)
            if delta.finish_reason:
                return time.perf_counter()

    started = time.perf_counter()
    steps0, busy0, wait0 = loop.steps, loop.busy_seconds, loop.drafting.wait_seconds
    cpu0, draft_cpu0 = time.process_time(), cpu_seconds(draft_pid) if draft_pid else 0.0
    ends = await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    wall = time.perf_counter() - started
    steps = max(loop.steps - steps0, 1)
    cpu_ms = 1e3 * (time.process_time() - cpu0) / steps
    draft_cpu_ms = 1e3 * (cpu_seconds(draft_pid) - draft_cpu0) / steps if draft_pid else 0.0
    decode = max(ends) - max(firsts)
    counters = engine.counters.get(getattr(pool.client, "draft_id", ""), None) if pool is not None else None
    row = {"tok_s": sum(len(o) - 1 for o in outputs.values()) / decode, "wall": wall,
           "steps": loop.steps - steps0, "busy": loop.busy_seconds - busy0,
           "wait": loop.drafting.wait_seconds - wait0, "outputs": [outputs[f"{tag}-{i}"] for i in range(len(prompts))],
           "plain_steps": dict(engine.spec.plain_steps), "dropped": dict(engine.spec.dropped),
           "cpu_ms": cpu_ms, "draft_cpu_ms": draft_cpu_ms}
    row["full_tok_s"] = full_batch_tok_s(deliveries, len(prompts))
    row["step_s"] = statistics.median(cycles[1:] or cycles)  # the first is the prefill
    row["verify_s"] = statistics.median(verify_cycles) if verify_cycles else None
    if counters is not None:
        row["drafts"] = counters.num_drafts
        row["tokens_per_round"] = 1 + counters.num_accepted_tokens / max(counters.num_drafts, 1)
    await loop.stop()
    return row


def full_batch_tok_s(deliveries: list[tuple[float, int, set, bool]], batch: int) -> float:
    """Tokens/s while the whole batch decodes: from the cycle by which every request has its first
    token to the first cycle that finishes one. Speculative requests finish rounds apart (each draws
    its own acceptance), and the last rounds then run part of the batch, at nearly the cost of a
    whole one; the ideal (E × T_plain / T_verify) is a whole batch's. Plain requests of equal length
    all finish in one cycle, so for them (and for a batch of one) this is the whole decode phase."""
    seen: set = set()
    start = None
    for i, (_, _, rids, _) in enumerate(deliveries):
        seen |= rids
        if len(seen) >= batch:
            start = i
            break
    if start is None:
        return 0.0
    end = next(i for i in range(start, len(deliveries)) if deliveries[i][3] or i == len(deliveries) - 1)
    if end == start:
        return 0.0
    tokens = sum(n for _, n, _, _ in deliveries[start + 1 : end + 1])
    return tokens / (deliveries[end][0] - deliveries[start][0])


def expected_tokens(alpha: float, gamma: int) -> float:
    return (gamma + 1) if alpha >= 1 else (1 - alpha ** (gamma + 1)) / (1 - alpha)


def median_row(rows: list[dict]) -> dict:
    rows = sorted(rows, key=lambda r: r["tok_s"])
    return rows[len(rows) // 2]


def start_draft(refs: Path, error_rate: float, cost_ms: float, vocab: int, seed: int):
    child = subprocess.Popen([sys.executable, __file__, "--serve-draft", str(refs), str(error_rate), str(cost_ms),
                              str(vocab), str(seed)], stdout=subprocess.PIPE, text=True)
    return child, int(child.stdout.readline())


async def bench_batch(args, model, batch: int, work: Path) -> list[dict]:
    from runtime.messages import InstanceRecord
    from workers.target.draft_pool import DraftPool

    prompts = prompts_for(batch, args.vocab)
    tokens = max(args.tokens, -(-args.sequence_tokens // batch))
    # plain: the references the oracle drafts from, and the step time the draft's cost is set from
    first = await run_once(engine_for(model, 0), None, prompts, tokens, "plain-ref")
    refs = work / f"refs-{batch}.json"
    refs.write_text(json.dumps([p + o for p, o in zip(prompts, first["outputs"])]))
    # the draft's cost is set from the median step of three warm runs: one run's, in a slow spell of
    # this shared machine, was half as long again as the runs after it, and made the draft that much costlier
    t_plain0 = statistics.median([(await run_once(engine_for(model, 0), None, prompts, tokens, f"plain-cal{k}"))["step_s"]
                                  for k in range(3)])
    print(f"batch {batch}: plain {first['tok_s']:.0f} tok/s, step {1e3 * t_plain0:.2f} ms warm "
          f"({1e3 * first['step_s']:.2f} ms cold), {tokens} tokens a request", flush=True)
    rows = []
    for alpha in args.alphas:
        error = round(1 - alpha, 3)
        for cost, gamma in args.cells:
            e = expected_tokens(alpha, gamma)
            # each cell its own seed: a fixed one drew the same errors in every run of the bench, and with
            # them the same lucky or unlucky acceptance for each seam
            child, port = start_draft(refs, error, cost * t_plain0 * 1e3, args.vocab, len(rows) + 10 * batch + 1)
            record = InstanceRecord("bench-draft", "bench", "draft", "speculate", "", role="draft",
                                    grpc_address=f"127.0.0.1:{port}")
            reps = []
            try:
                for k in range(args.repeats):  # interleaved, so that a slow spell of the machine hits all alike
                    plain = await run_once(engine_for(model, 0), None, prompts, tokens, f"plain{k}")
                    rep = {"plain_tok_s": plain["tok_s"], "t_plain": plain["step_s"], "plain_cpu_ms": plain["cpu_ms"],
                           "cost_run": cost * t_plain0 / plain["step_s"]}  # the draft's cost against this repeat's step
                    for seam in ("sync", "pipelined"):
                        pool = DraftPool("bench-target", "", args.vocab, lambda: [record], pipelined=seam == "pipelined")
                        r = await run_once(engine_for(model, gamma), pool, prompts, tokens, f"{seam}{k}", child.pid)
                        await pool.close()
                        equal = sum(a == b for a, b in zip(r["outputs"], first["outputs"]))
                        assert GPU or equal == len(prompts), f"{seam}: outputs differ from plain decoding"
                        rep[f"{seam}_equal"] = f"{equal}/{len(prompts)}"
                        rep[seam] = r["tok_s"] / plain["tok_s"]
                        rep[f"{seam}_full"] = r["full_tok_s"] / plain["full_tok_s"]
                        rep[f"{seam}_wait"] = r["wait"] / r["busy"]
                        rep[f"{seam}_tpr"] = r.get("tokens_per_round", 0.0)
                        rep[f"{seam}_plain_steps"] = r["plain_steps"]
                        rep[f"{seam}_dropped"] = r["dropped"]
                        rep[f"{seam}_verify_s"] = r["verify_s"]
                        rep[f"{seam}_cpu_ms"], rep[f"{seam}_draft_cpu_ms"] = r["cpu_ms"], r["draft_cpu_ms"]
                    # the verify step: the synchronous run's verifying cycles, less their wait for proposals
                    rep["t_verify"] = rep["sync_verify_s"]
                    rep["ideal"] = e * rep["t_plain"] / rep["t_verify"]
                    rep["of_ideal"] = rep["pipelined"] / rep["ideal"]
                    rep["of_ideal_full"] = rep["pipelined_full"] / rep["ideal"]
                    # the same at the acceptance the pipelined run drew (its oracle's errors are random):
                    # how much of the draft's time the seam hid, whatever the draws
                    drawn = rep["pipelined_tpr"] * rep["t_plain"] / rep["t_verify"]
                    rep["of_drawn_ideal"] = rep["pipelined"] / drawn if drawn else 0.0
                    reps.append(rep)
            finally:
                child.kill()
                child.wait()
            row = {"batch": batch, "alpha": alpha, "cost": cost, "gamma": gamma, "E": e, "repeats": reps}
            for key in ("cost_run", "plain_tok_s", "t_plain", "t_verify", "ideal", "sync", "pipelined", "of_ideal", "of_drawn_ideal",
                        "sync_full", "pipelined_full", "of_ideal_full",
                        "sync_wait", "pipelined_wait", "sync_tpr", "pipelined_tpr", "plain_cpu_ms", "sync_cpu_ms",
                        "pipelined_cpu_ms", "sync_draft_cpu_ms", "pipelined_draft_cpu_ms"):
                row[key] = statistics.median(r[key] for r in reps)
            # a pipelined verify cycle against the synchronous one (less its wait): what overlapping costs
            row["pipelined_verify_s"] = statistics.median(r["pipelined_verify_s"] or 0.0 for r in reps)
            row["pipelined_plain_steps"] = reps[len(reps) // 2]["pipelined_plain_steps"]
            row["equal"] = ", ".join(f"{seam} {r[f'{seam}_equal']}" for r in reps for seam in ("sync", "pipelined"))
            print(json.dumps({k: v for k, v in row.items() if k != "repeats"}), flush=True)
            rows.append(row)
    return rows


def print_table(rows: list[dict]) -> None:
    print("| batch | α | draft cost (× plain step) | γ | plain tok/s | T_plain ms | T_verify ms | ideal | sync | "
          "pipelined | pipelined / ideal | at its drawn acceptance | whole batch: sync / pipelined, pipelined / ideal | "
          "draft wait sync | draft wait pipelined | "
          "tokens/round sync / pipelined | pipelined verify cycle ÷ T_verify | CPU ms a step: target plain / sync / "
          "pipelined, draft sync / pipelined | outputs equal |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['batch']} | {r['alpha']} | {r['cost']} ({r.get('cost_run', r['cost']):.2f} as run) | {r['gamma']} | {r['plain_tok_s']:.0f} | "
              f"{1e3 * r['t_plain']:.2f} | {1e3 * r['t_verify']:.2f} | {r['ideal']:.2f}× | {r['sync']:.2f}× | "
              f"{r['pipelined']:.2f}× | {r['of_ideal']:.2f} | {r['of_drawn_ideal']:.2f} | "
              f"{r['sync_full']:.2f}× / {r['pipelined_full']:.2f}×, **{r['of_ideal_full']:.2f}** | {100 * r['sync_wait']:.0f} % | "
              f"{100 * r['pipelined_wait']:.1f} % | {r['sync_tpr']:.2f} / {r['pipelined_tpr']:.2f} | "
              f"{r['pipelined_verify_s'] / r['t_verify']:.2f} | {r['plain_cpu_ms']:.2f} / {r['sync_cpu_ms']:.2f} / "
              f"{r['pipelined_cpu_ms']:.2f}, {r['sync_draft_cpu_ms']:.2f} / {r['pipelined_draft_cpu_ms']:.2f} | "
              f"{r['equal']} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, default=96, help="tokens per request")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--alphas", default="0.6,0.8")
    ap.add_argument("--cells", default="0.05:4,0.3:1,0.3:2",
                    help="draft cost per token (in plain target steps) : γ, comma separated")
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=3, help="runs per cell (the median is reported)")
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument("--gpu", action="store_true",
                    help="an 8B-shaped bf16 target on CUDA, batch 1 and 8, α 0.8, cost 0.05 at γ 4, 2 repeats")
    ap.add_argument("--sequence-tokens", type=int, default=384,
                    help="tokens a cell's requests generate at least, in all (a batch of 1 runs longer requests: "
                         "fewer rounds leave the draws of acceptance noisier)")
    ap.add_argument("--serve-draft", nargs=5, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_draft:
        refs, error, cost, vocab, seed = args.serve_draft
        asyncio.run(serve_draft(refs, float(error), float(cost), int(vocab), int(seed)))
        return
    global GPU
    if args.gpu:
        import torch

        if not torch.cuda.is_available():
            sys.exit("spec_pipeline_bench --gpu needs a CUDA GPU")
        GPU = True
        args.batches, args.alphas, args.cells, args.repeats = "1,8", "0.8", "0.05:4", 2
        args.tokens = max(args.tokens, 128)
    args.batches = [int(x) for x in args.batches.split(",")]
    args.alphas = [float(x) for x in args.alphas.split(",")]
    args.cells = [(float(c), int(g)) for c, g in (x.split(":") for x in args.cells.split(","))]
    if GPU:
        model = build_gpu_model()
        args.vocab = model.cfg.vocab_size
    else:
        model = build_model(args.hidden, args.layers, args.vocab)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for batch in args.batches:
            rows.extend(asyncio.run(bench_batch(args, model, batch, Path(tmp))))
    print_table(rows)
    worst = min(r["of_ideal"] for r in rows)
    wait = max(r["pipelined_wait"] for r in rows)
    print(f"pipelined / ideal while the whole batch decodes: worst {min(r['of_ideal_full'] for r in rows):.2f}, median "
          f"{statistics.median(r['of_ideal_full'] for r in rows):.2f} (target ≥ 0.9); over the whole decode phase:")
    print(f"pipelined / ideal: worst {worst:.2f}; pipelined draft wait: worst {100 * wait:.1f} % "
          f"of busy time (target ≤ 5 %); median pipelined / ideal {statistics.median(r['of_ideal'] for r in rows):.2f}; "
          f"at the acceptance drawn: worst {min(r['of_drawn_ideal'] for r in rows):.2f}, "
          f"median {statistics.median(r['of_drawn_ideal'] for r in rows):.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
