"""What a target step costs its engine thread under the default speculative policy when drafting does
not pay, against plain decoding: the host work speculation adds to every step.

Usage: .venv/bin/python bench/default_step_bench.py [--requests 40] [--max-tokens 96] [--aa] [--json out.json]

Two engines serve the same random 2-layer Llama (``bench/served_bench.py``'s tiny target: hidden 64,
the demo vocabulary) in one process, one thread of torch, greedy, batch 1, the same requests one
after the other, the two engines in lockstep (a cycle of one, then a cycle of the other, who goes
first alternating), so that a slow spell of this shared machine hits both alike:

- **plain**: no hidden layers offered, no draft worker (what ``tandem up --draft-method none``
  serves);
- **default**: hidden layers 0, 1 and 2 offered (what an EAGLE-3 head reads), load-aware
  speculation, and a draft worker connected on the synchronous seam: each cycle runs
  :meth:`workers.target.step_loop.StepLoop.run_cycle` with a draft context that may ask, as the
  target's loop does, and feeds the cost model the cycle's time. Every round the policy asks for
  is answered in time (the synchronous seam's next cycle) with random tokens, what a random-weight
  EAGLE-3 head proposes: nearly never accepted, the regime in which load-aware speculation should
  switch itself off and cost nothing.

Each cycle (:meth:`StepLoop.run_cycle`, what the target's engine thread runs; the proposals it is
handed are collected on the event loop, so they are built outside it here) is timed on the engine
thread's CPU clock (``time.thread_time``: time this thread was descheduled does not count), and so
is the model's forward pass within it. Reported: the mean CPU
time per step of each engine (and the median), their difference and ratio; the same outside the
forward pass (the host work around it: scheduling, sampling, bookkeeping, and on the default side
the speculation policy, the hidden-state store, the draft messages), whose difference is what the
default policy adds to a step, measured without the forward pass's own noise (two copies of the
same weights run a few per cent apart on this machine, whichever engine holds them, see ``--aa``);
the rounds the policy asked for and the drafts verified. Both engines' outputs are compared (they must be equal).
``--aa`` runs the same with plain decoding on both sides: the bench's own noise (each engine's
figure moves by 1-2 % between runs on this shared machine, the absolute ones by far more).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

LAYERS = (0, 1, 2)


def engines(model: str, aa: bool):
    from workers.engine.build import build_engine
    from workers.engine.target_config import TargetConfig

    plain = build_engine(TargetConfig(model=model, served_model_name="bench", threads=1,
                                      spec={"hidden_layers": "none"}), "plain")
    layers = "none" if aa else ",".join(map(str, LAYERS))
    spec = build_engine(TargetConfig(model=model, served_model_name="bench", threads=1,
                                     spec={"hidden_layers": layers}), "default")
    return plain, spec


def loops(plain, spec, aa: bool):
    from workers.target.step_loop import DraftContext, StepLoop

    class Pool:  # a draft worker connected (never asked to open anything: run_cycle only checks it is there)
        pass

    if aa:  # the A/A control: plain decoding on both sides
        return StepLoop(plain, None), StepLoop(spec, None), None
    context = DraftContext("bench-draft", LAYERS, "float32", ask=True, stream=1)
    return StepLoop(plain, None), StepLoop(spec, Pool()), context


class Driver:
    """One request at a time through one loop's cycles, a cycle per :meth:`step`, as the target's loop
    runs them (the synchronous seam: the answers to a round are in hand at the next cycle)."""

    def __init__(self, loop, context):
        self.loop, self.context = loop, context
        self.contexts = (context,) if context is not None else ()
        self.forward = 0.0  # engine-thread CPU seconds in the model's forward passes, running total
        self.outside: list[float] = []  # per cycle that stepped: its CPU seconds outside the forward pass
        runner, forward = loop.engine.runner, loop.engine.runner.forward

        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return forward(*args, **kwargs)
            finally:
                self.forward += time.thread_time() - started

        runner.forward = timed
        self.draw = random.Random(2)
        self.last, self.asked, self.requests = 0.0, False, []
        self.rounds = 0
        self.commands: list = []
        self.tokens: list[int] = []
        self.done = True
        self.cpu: list[float] = []  # engine-thread CPU seconds of each cycle that stepped

    def start(self, request_id: str, prompt: list[int], params) -> None:
        from workers.target.step_loop import AddRequest

        self.commands = [AddRequest(request_id, prompt, params)]
        self.tokens, self.done = [], False

    def step(self) -> None:
        from workers.speculation.payloads import DraftOutput
        from workers.target.seam import Proposals

        # a random head's answers to the last round, in time; collected, as the target's loop does, on
        # its event loop (outside the engine thread's cycle timed here)
        answers = {r.seq_id: DraftOutput(r.seq_id, r.round, [self.draw.randrange(self.loop.engine.vocab_size)
                                                             for _ in range(r.num_speculative_tokens)])
                   for r in self.requests}
        contexts = self.contexts  # (the target's loop hands the same tuple while its streams are the same)
        proposals = {self.context.stream: Proposals(answers=answers)} if self.context is not None else {}
        started, wall, forward = time.thread_time(), time.perf_counter(), self.forward
        cycle = self.loop.run_cycle(self.commands, proposals, contexts, self.last, self.asked)
        cpu = time.thread_time() - started
        self.commands = []
        self.last = time.perf_counter() - wall if cycle.stepped else 0.0
        self.requests = [r for news in cycle.news.values() for r in news.requests]
        self.asked = bool(self.requests)
        self.rounds += self.asked
        if cycle.stepped:
            self.cpu.append(cpu)
            self.outside.append(cpu - (self.forward - forward))
        for error in (e for _, _, e in cycle.results if e is not None):
            raise error
        for _, delta in cycle.outputs:
            self.tokens.extend(delta.token_ids)
            self.done = self.done or delta.finish_reason is not None


def run(args: argparse.Namespace) -> dict:
    import torch

    from bench.served_bench import tiny_target
    from runtime.messages import SamplingParams

    torch.manual_seed(0)
    plain, spec = engines(str(tiny_target()), args.aa)
    plain_loop, spec_loop, context = loops(plain, spec, args.aa)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    drivers = {"plain": Driver(plain_loop, None), "default": Driver(spec_loop, context)}
    equal, warm = 0, 2  # the first two requests warm up
    order = random.Random(3)
    for i in range(args.requests + warm):
        prompt = torch.randint(100, 40000, (32,), generator=gen).tolist()
        if i == warm:
            for d in drivers.values():
                d.cpu.clear()
                d.outside.clear()
        for d in drivers.values():
            d.start(f"r{i}", prompt, params)
        while not all(d.done for d in drivers.values()):  # one cycle each in turn, who goes first at random
            for d in sorted(drivers.values(), key=lambda _: order.random()):
                if not d.done:
                    d.step()
        equal += i >= warm and drivers["plain"].tokens == drivers["default"].tokens
    cpu = {name: d.cpu for name, d in drivers.items()}
    mean = {name: statistics.fmean(v) for name, v in cpu.items()}
    outside = {name: statistics.fmean(d.outside) for name, d in drivers.items()}
    med = {name: statistics.median(v) for name, v in cpu.items()}
    rounds = drivers["default"].rounds
    result = {"aa": args.aa, "requests": args.requests, "max_tokens": args.max_tokens,
              "steps": {k: len(v) for k, v in cpu.items()},
              "cpu_us_per_step": {k: 1e6 * v for k, v in mean.items()},
              "median_cpu_us_per_step": {k: 1e6 * v for k, v in med.items()},
              "extra_us_per_step": 1e6 * (mean["default"] - mean["plain"]), "ratio": mean["default"] / mean["plain"],
              "outside_forward_us_per_step": {k: 1e6 * v for k, v in outside.items()},
              "extra_outside_forward_us_per_step": 1e6 * (outside["default"] - outside["plain"]),
              "rounds_asked": rounds, "drafts_verified": sum(c.num_drafts for c in spec.counters.values()),
              "accepted_tokens": sum(c.num_accepted_tokens for c in spec.counters.values()),
              "plain_steps": dict(spec.spec.plain_steps), "outputs_equal": equal}
    print(f"engine-thread CPU per step (mean over {len(cpu['plain'])} steps; {args.requests} requests, "
          f"{args.max_tokens} tokens each; median plain {1e6 * med['plain']:.1f}, "
          f"default {1e6 * med['default']:.1f} us): "
          f"plain {result['cpu_us_per_step']['plain']:.1f} us, default {result['cpu_us_per_step']['default']:.1f} us: "
          f"{result['extra_us_per_step']:+.1f} us ({result['ratio']:.3f}x); outside the model's forward pass: plain "
          f"{1e6 * outside['plain']:.1f} us, default {1e6 * outside['default']:.1f} us: "
          f"{result['extra_outside_forward_us_per_step']:+.1f} us; rounds asked {rounds}, drafts verified "
          f"{result['drafts_verified']} ({result['accepted_tokens']} tokens accepted); "
          f"plain-step reasons {result['plain_steps']}; outputs equal {equal}/{args.requests}")
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="measured requests per engine (default 40)")
    ap.add_argument("--max-tokens", type=int, default=96, help="tokens per request (default 96)")
    ap.add_argument("--aa", action="store_true",
                    help="A/A control: the second engine decodes plainly too (what the bench's noise is)")
    ap.add_argument("--json", default=None, help="write the result here")
    args = ap.parse_args()
    if args.requests < 1 or args.max_tokens < 2:
        ap.error("--requests must be >= 1 and --max-tokens >= 2")
    result = run(args)
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
