"""KV tiers below the device pool on multi-turn chat: TTFT with tiers off, a host tier, host + disk.

Usage: .venv/bin/python bench/kv_tier_bench.py [--conversations 32] [--turns 6] [--max-tokens 4] [--notes 1]
       [--num-blocks 96] [--threads 1] [--eagle-conversations 4]

In one process (CPU, float32, the demo model SmolLM2-135M-Instruct): 32 conversations, each opened
by a hand-written user message (below: a question and ``--notes`` paragraphs of hand-written context,
about 130 tokens with one, as when a user pastes notes under a question) and continued with
hand-written follow-ups; every
turn re-sends the whole history through the chat template, as a chat client does. Turns go round
robin over the conversations (turn 1 of all, then turn 2 of all, ...), one request at a time, so
TTFT is the engine's own time to the first token (prefill of what is not cached, plus any tier
load), with no queueing. The device pool is ``--num-blocks`` blocks, a fraction of the
conversations' KV working set (printed), so between two turns of a conversation its blocks are
evicted from the device pool. Configurations, in one run on the same prompts:

- ``off``: the device prefix cache only (today's behaviour);
- ``host``: a host tier that holds the whole working set;
- ``host+disk``: a host tier of a quarter of the working set and a disk tier below it (a scratch dir);
- ``shared``: a second engine ("target B") with its own empty device pool and host tier, on the
  same disk directory: turn 2 of every conversation whose turn 1 ran on the first engine. Its
  prefix must come from disk (disk hits), not be recomputed.

Every configuration's greedy outputs must equal ``off``'s, every turn. Then the same conversations
(the first ``--eagle-conversations``, on a 32-block device pool) with the demo's EAGLE-3 head
speculating in process, tiers off and host+disk: outputs equal, and the acceptance length equal (the hidden rows the head reads
move with their blocks; rows computed fresh and rows loaded back must give the same drafts).
Host-tier memory: the process's RSS growth across the ``host`` run, against the tier's size.
"""

from __future__ import annotations

import argparse
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

OPENERS = [
    "My tomato plants have yellow leaves at the bottom. What am I doing wrong?",
    "Explain how a bicycle gear system works to someone who has never ridden one.",
    "I want to start running in the mornings but I always hit snooze. Any tips?",
    "What is the difference between a virus and a bacterium?",
    "Help me plan a three day trip to Lisbon on a small budget.",
    "Why does bread go stale faster in the fridge?",
    "Can you explain what an API is, using a restaurant as an example?",
    "My cat keeps knocking glasses off the table. Why do cats do that?",
    "Write a short thank-you note to a neighbour who watered my plants.",
    "How do noise cancelling headphones actually cancel noise?",
    "What should I look for when buying a used car?",
    "I keep forgetting people's names right after I meet them. How can I fix that?",
    "Explain compound interest with a simple example in euros.",
    "What are some easy vegetarian dinners I can cook in twenty minutes?",
    "Why is the sky blue during the day and red at sunset?",
    "How do I politely decline a meeting invitation from my manager?",
    "What is a good way to teach a seven year old about fractions?",
    "My houseplant's soil smells bad. Should I repot it?",
    "Describe how a bill becomes a law, in plain words.",
    "What exercises help with lower back pain from sitting all day?",
    "How do vaccines train the immune system?",
    "Give me ideas for a birthday party for a ten year old who loves space.",
    "Why do onions make people cry when they cut them?",
    "How should I prepare for my first job interview at a bank?",
    "What is the best way to store coffee beans at home?",
    "Explain what a blockchain is without using any jargon.",
    "My phone battery dies by lunchtime. What drains it so fast?",
    "How do airplanes stay in the air?",
    "I want to learn the guitar as an adult. Where do I begin?",
    "What causes the seasons on Earth?",
    "How can I make my small apartment feel bigger?",
    "Why do we dream, and do dreams mean anything?",
]
# What the users paste under their question (multi-round QA over a document, the workload LMCache and
# KVBM cite): three of these per conversation, rotated, so no two conversations share a prefix past the
# system prompt and the question.
NOTES = [
    "Last spring we moved into an old house with a garden that had been left alone for years. The soil is "
    "heavy clay, it stays wet for days after rain, and the previous owner seems to have used a lot of wood "
    "chips as mulch. Most afternoons the back corner gets full sun, but the front is shaded by a large oak.",
    "At work I manage a small team of four people who are spread over two time zones. We meet on Mondays "
    "and Thursdays, we track tasks on a shared board, and most of our problems come from hand-offs: one "
    "person finishes something late in their day and the other only sees it the next morning.",
    "My budget is tight this year. Rent takes a bit less than half of what I earn, I am paying back a "
    "student loan at a fixed rate, and I try to put a small amount aside every month, although unexpected "
    "costs like a broken washing machine or a dentist bill usually eat the savings before they grow.",
    "I have been trying to get fitter since January. I walk to the station every day, which is about twenty "
    "minutes each way, I go swimming on Saturdays, and I tried a running plan twice but stopped both times "
    "after two weeks because my knees started to hurt on the longer runs.",
    "Our family has two children, aged seven and ten, and a dog that needs a long walk every evening. Both "
    "kids have after-school activities on different days, my partner works late on Wednesdays, and the "
    "weekends fill up quickly with birthday parties, groceries and visits to the grandparents.",
    "The laptop I use is about five years old. It has eight gigabytes of memory, a solid state drive that "
    "is almost full, and it runs the same operating system it came with. It takes a long time to start, "
    "the fan is loud when I have many browser tabs open, and the battery lasts barely two hours.",
    "I started learning Spanish on my phone six months ago. I practise for ten minutes almost every day, I "
    "can read simple texts and order food, but when people speak at a normal speed I lose track after a "
    "few words, and I am too shy to speak with the colleague from Madrid who offered to help me.",
    "We are planning a trip for next summer with a group of five friends. Two of them do not drive, one is "
    "vegetarian, everyone has a different budget, and we only agree that we want to be near the sea, see "
    "at least one city, and avoid spending more than a few hours a day travelling between places.",
]
FOLLOW_UPS = [
    "Can you say more about the first point?",
    "Give me a concrete example of that.",
    "What is the most common mistake people make here?",
    "Summarise that in two sentences.",
    "Thanks. Is there anything else I should know?",
]


def percentile(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class Chat:
    """The conversations' histories and prompts, turn by turn (token ids through the chat template)."""

    def __init__(self, tok, n: int, notes: int = 1):
        self.tok = tok
        self.history = [[{"role": "user", "content": OPENERS[i % len(OPENERS)] + "\n\nSome context:\n"
                          + "\n".join(NOTES[(i + k) % len(NOTES)] for k in range(notes))}] for i in range(n)]

    def prompt(self, i: int) -> list[int]:
        text = self.tok.apply_chat_template(self.history[i], add_generation_prompt=True, tokenize=False)
        return self.tok(text, add_special_tokens=False)["input_ids"]

    def reply(self, i: int, turn: int, tokens: list[int]) -> None:
        self.history[i].append({"role": "assistant", "content": self.tok.decode(tokens, skip_special_tokens=True)})
        self.history[i].append({"role": "user", "content": FOLLOW_UPS[turn % len(FOLLOW_UPS)]})


def serve(engine, rid: str, prompt: list[int], params, proposer=None) -> tuple[list[int], float, int, int]:
    """One request alone: (tokens, TTFT seconds, drafts, accepted)."""
    started = time.perf_counter()
    engine.add_request(rid, prompt, params)
    out, ttft, drafts, accepted = [], None, 0, 0
    while engine.has_work():
        inputs = engine.draft_inputs() if proposer is not None else []
        proposals = {o.seq_id: o for o in proposer.propose(inputs)} if inputs else {}
        for _, delta in engine.step(proposals):
            if delta.token_ids and ttft is None:
                ttft = time.perf_counter() - started
            out.extend(delta.token_ids)
            if delta.finish_reason and delta.usage is not None and delta.usage.spec is not None:
                drafts += delta.usage.spec.num_drafts
                accepted += delta.usage.spec.num_accepted_tokens
        if proposer is not None:
            proposer.verified(engine.take_verdicts())
            proposer.release(engine.take_released())
    return out, ttft, drafts, accepted


def run_config(name, make_engine, tok, args, params, proposer_factory=None, conversations=None):
    """All turns of all conversations on a fresh engine; per-turn outputs and TTFTs."""
    n = conversations or args.conversations
    engine = make_engine()
    proposer = proposer_factory() if proposer_factory else None
    chat = Chat(tok, n, args.notes)
    outputs, ttfts, drafts, accepted = {}, [], 0, 0
    rss0 = rss_mib()
    started = time.perf_counter()
    for turn in range(args.turns):
        for i in range(n):
            prompt = chat.prompt(i)
            out, ttft, d, a = serve(engine, f"{name}-{i}-{turn}", prompt, params, proposer)
            outputs[(i, turn)] = out
            ttfts.append(ttft)
            drafts, accepted = drafts + d, accepted + a
            chat.reply(i, turn, out)
    seconds = time.perf_counter() - started
    if engine.tiers is not None and engine.tiers.disk is not None:
        engine.tiers.disk.flush()
    return {"name": name, "engine": engine, "outputs": outputs, "ttfts": ttfts, "seconds": seconds,
            "drafts": drafts, "accepted": accepted, "rss_growth": rss_mib() - rss0, "chat": chat}


def report(r, base=None) -> str:
    p50, p90 = statistics.median(r["ttfts"]), percentile(r["ttfts"], 0.9)
    line = f"{r['name']:>10}: TTFT p50 {1e3 * p50:7.1f} ms  p90 {1e3 * p90:7.1f} ms  total {r['seconds']:6.1f} s"
    if base is not None:
        line += (f"  | p50 {statistics.median(base['ttfts']) / p50:4.2f}x lower, total "
                 f"{base['seconds'] / r['seconds']:4.2f}x faster than off")
    tiers = r["engine"].tiers
    if tiers is not None:
        st = tiers.stats
        line += f"  | hits host {st['host'].hits} disk {st['disk'].hits} blocks"
    return line


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--conversations", type=int, default=32)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=4)
    ap.add_argument("--notes", type=int, default=1, help="paragraphs of context under each opener (1-8)")
    ap.add_argument("--num-blocks", type=int, default=96, help="device pool blocks (of 16 tokens)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--eagle-conversations", type=int, default=4, help="0: skip the EAGLE-3 part")
    args = ap.parse_args()

    import torch
    from transformers import AutoTokenizer

    from runtime.messages import SamplingParams
    from workers.demo_model import demo_head_dir, demo_model_dir
    from workers.engine.engine import Engine, EngineConfig
    from workers.engine.kv_tiers import block_bytes, build_tiers
    from workers.engine.weights import load_model

    torch.set_num_threads(args.threads)
    target = demo_model_dir()
    tok = AutoTokenizer.from_pretrained(target)
    model = load_model(target)
    params = SamplingParams(temperature=0, max_tokens=args.max_tokens)
    cfg = EngineConfig(num_blocks=args.num_blocks, block_size=16, max_num_seqs=8)
    scratch = Path(tempfile.mkdtemp(prefix="kv-tier-bench-"))

    def engine(host_blocks=0, disk=None, hidden=(), num_blocks=None):
        c = cfg if num_blocks is None else EngineConfig(num_blocks=num_blocks, block_size=16, max_num_seqs=8)
        e = Engine(model, c, hidden_layers=hidden, adaptive=False, num_speculative_tokens=3)
        if host_blocks:
            e.attach_tiers(build_tiers(e, host_blocks * block_bytes(e), disk, 64 << 30, "bench"))
        return e

    try:
        print(f"demo model on CPU, {args.threads} threads; device pool {args.num_blocks} blocks of 16 tokens; "
              f"{args.conversations} conversations x {args.turns} turns, {args.max_tokens} tokens per reply")
        off = run_config("off", engine, tok, args, params)
        working = sum(-(-len(off["chat"].prompt(i)) // 16) for i in range(args.conversations))
        print(f"KV working set at the last turn: {working} blocks = {working / args.num_blocks:.1f}x the device pool")
        # host tier: room for the whole working set; disk: a host tier of a quarter of it
        host_blocks = working + 64
        host = run_config("host", lambda: engine(host_blocks), tok, args, params)
        disk_dir = scratch / "disk"
        both = run_config("host+disk", lambda: engine(working // 4, str(disk_dir)), tok, args, params)
        print(report(off))
        print(report(host, off))
        print(report(both, off))
        for r in (host, both):
            bad = [k for k in off["outputs"] if off["outputs"][k] != r["outputs"][k]]
            print(f"{r['name']:>10}: greedy outputs equal to off on {len(off['outputs']) - len(bad)}/{len(off['outputs'])} turns")
        row = host["engine"].tiers.copier.block_bytes
        size = host_blocks * row / (1 << 20)
        print(f"host tier: {host_blocks} blocks x {row} bytes = {size:.0f} MiB; RSS grew {host['rss_growth']:.0f} MiB "
              f"over the host run (off run: {off['rss_growth']:.0f} MiB); blocks held at the end "
              f"{len(host['engine'].tiers.host)} <= capacity {host['engine'].tiers.host.capacity}")
        files = len(list((both["engine"].tiers.disk.dir).glob("*.kvb")))
        print(f"disk tier: {files} block files, {both['engine'].tiers.disk.counters.written_bytes / (1 << 20):.0f} MiB written")

        # target B: a fresh engine on the same disk dir serves turn 2 of every conversation
        b = engine(working // 4, str(disk_dir))
        chat = Chat(tok, args.conversations, args.notes)
        ttfts_b, same = [], 0
        for i in range(args.conversations):
            chat.reply(i, 0, off["outputs"][(i, 0)])
            out, ttft, _, _ = serve(b, f"b-{i}", chat.prompt(i), params)
            ttfts_b.append(ttft)
            same += out == off["outputs"][(i, 1)]
        off_t2 = [off["ttfts"][args.conversations + i] for i in range(args.conversations)]
        print(f"    shared: target B, turn 2 of each conversation whose turn 1 ran on target A: disk hits "
              f"{b.tiers.stats['disk'].hits} blocks ({b.tiers.stats['disk'].loaded_bytes / (1 << 20):.0f} MiB); "
              f"TTFT p50 {1e3 * statistics.median(ttfts_b):.1f} ms vs {1e3 * statistics.median(off_t2):.1f} ms "
              f"recomputing (off, turn 2); outputs equal {same}/{args.conversations}")
        for r in (off, host, both):
            r["engine"].tiers and r["engine"].tiers.close()
        b.tiers.close()

        if args.eagle_conversations:
            from workers.draft.eagle import load_eagle, load_target_parts
            from workers.draft.eagle_proposer import EagleProposer

            embed, lm_head, target_cfg = load_target_parts(target)
            head, layers = load_eagle(str(demo_head_dir()), embed, lm_head, target_cfg, 2048)
            hidden = tuple(layers)

            def proposer():
                return EagleProposer(head, layers, num_blocks=2048, block_size=16)

            n = args.eagle_conversations
            small = 32  # a device pool of 32 blocks: a third of these conversations' working set
            spec_off = run_config("eagle off", lambda: engine(hidden=hidden, num_blocks=small), tok, args, params,
                                  proposer, n)
            spec_on = run_config("eagle h+d", lambda: engine(n * 8, str(scratch / "eagle"), hidden, small), tok, args,
                                 params, proposer, n)
            for r in (spec_off, spec_on):
                tau = 1 + r["accepted"] / r["drafts"] if r["drafts"] else 1.0
                same = sum(r["outputs"][k] == off["outputs"][k] for k in r["outputs"])
                print(f"{report(r)}  | acceptance length {tau:.3f} ({r['drafts']} drafts); outputs equal to plain "
                      f"off {same}/{len(r['outputs'])}")
            spec_on["engine"].tiers.close()
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
