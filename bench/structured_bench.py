"""Structured outputs on the demo model: 50 JSON-schema prompts through the openai SDK with speculation
on and off, and what a grammar mask costs the target per step.

Usage: .venv/bin/python bench/structured_bench.py [--prompts 50] [--concurrency 8] [--max-tokens 200]

Starts a real etcd and nats-server on loopback, the target worker on SmolLM2-135M (CPU), its
EAGLE-3 draft worker and the frontend. Every prompt asks for a person as JSON under a
``response_format`` json_schema (strict), at temperature 0, once with the worker's speculation
and once with ``speculative.num_draft_tokens: 0``. Reports: outputs that validate against the schema
(``jsonschema``), outputs equal across the two runs, the speculation counters, and tokens/s.
Then, in this process, the cost of llguidance's masks on the same outputs: the next-token mask per
generated token, and the masks of a verify step of 3 drafts (the worker's chain length here).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import jsonschema  # noqa: E402
import openai  # noqa: E402

from tests.e2e.test_structured_outputs import PERSON  # noqa: E402  (the schema the e2e test checks)
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, free_port, start_servers  # noqa: E402

NAMES = ["Ada", "Bjorn", "Chen", "Dalia", "Emeka", "Farah", "Gustavo", "Hana", "Ivan", "Jia"]
STYLES = ["Describe a person called {n} as JSON: name, age, city and hobbies.",
          "{n} is a teacher who loves music. Give their profile as JSON.",
          "Invent a character named {n} and answer with JSON only.",
          "Write a JSON record for {n}, a retired pilot from Lisbon.",
          "Return {n}'s details (name, age, city, hobbies) in JSON."]


def prompts(n: int) -> list[str]:
    return [STYLES[i % len(STYLES)].format(n=NAMES[(i // len(STYLES)) % len(NAMES)] + ("" if i < 50 else f" {i}"))
            for i in range(n)]


async def run(client: openai.AsyncOpenAI, texts: list[str], extra: dict | None, concurrency: int,
              max_tokens: int) -> tuple[list, float]:
    sem = asyncio.Semaphore(concurrency)

    async def one(text):
        async with sem:
            return await client.chat.completions.create(
                model="smol", temperature=0, max_tokens=max_tokens, extra_body=extra,
                messages=[{"role": "user", "content": text}],
                response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                                        "strict": True}})

    started = time.perf_counter()
    out = await asyncio.gather(*(one(t) for t in texts))
    return out, time.perf_counter() - started


def valid(content: str) -> bool:
    try:
        jsonschema.validate(json.loads(content), PERSON)
    except (ValueError, jsonschema.ValidationError):
        return False
    return True


def summary(name: str, results: list, seconds: float) -> None:
    tokens = sum(r.usage.completion_tokens for r in results)
    ok = sum(valid(r.choices[0].message.content) for r in results)
    cut = sum(r.choices[0].finish_reason == "length" for r in results)
    specs = [r.usage.model_extra.get("spec_decode") or {} for r in results]
    drafts = sum(s.get("num_drafts", 0) for s in specs)
    draft_tokens = sum(s.get("draft_tokens", 0) for s in specs)
    accepted = sum(s.get("accepted_tokens", 0) for s in specs)
    line = f"{name}: {ok}/{len(results)} valid, {cut} cut by max_tokens, {tokens} tokens in {seconds:.1f} s " \
           f"({tokens / seconds:.1f} tokens/s)"
    if drafts:
        line += f"; {drafts} drafts, acceptance {accepted / draft_tokens:.2f}, mean accepted length " \
                f"{1 + accepted / drafts:.2f}"
    print(line)


def mask_costs(outputs: list[str], gamma: int = 3) -> None:
    """llguidance's mask cost on the outputs' tokens (SmolLM2's 49152-token vocabulary)."""
    from tokenizers import Tokenizer

    from runtime.messages import StructuredOutput
    from workers.demo_model import demo_model_dir
    from workers.engine.grammar import GrammarBackend

    path = demo_model_dir() / "tokenizer.json"
    tok = Tokenizer.from_file(str(path))
    backend = GrammarBackend(str(path), 49152, [2])
    started = time.perf_counter()
    backend.tokenizer()
    print(f"tokenizer info: {1e3 * (time.perf_counter() - started):.0f} ms (once per worker)")
    spec = StructuredOutput(json_schema=json.dumps(PERSON))
    started = time.perf_counter()
    backend.grammar(StructuredOutput(json_schema=json.dumps({**PERSON, "title": "uncached"})))
    print(f"first compile of the schema: {1e3 * (time.perf_counter() - started):.2f} ms; "
          f"cached: ", end="")
    backend.grammar(spec)
    started = time.perf_counter()
    for _ in range(100):
        backend.grammar(spec)
    print(f"{1e6 * (time.perf_counter() - started) / 100:.0f} us")
    step, verify = [], []
    row, rows = backend.new_masks(1)[0], backend.new_masks(gamma + 1)
    for text in outputs:
        ids = tok.encode(text).ids + [2]
        g = backend.grammar(spec)
        for i, t in enumerate(ids):
            started = time.perf_counter()
            g.fill(row)
            step.append(time.perf_counter() - started)
            started = time.perf_counter()
            g.fill_draft(rows, ids[i + 1 : i + 1 + gamma])
            verify.append(time.perf_counter() - started)
            if not g.accept([t]):
                break
    q = statistics.quantiles
    print(f"next-token mask: median {1e6 * statistics.median(step):.0f} us, mean {1e6 * statistics.mean(step):.0f} us, "
          f"p99 {1e6 * q(step, n=100)[98]:.0f} us over {len(step)} tokens")
    print(f"verify masks for {gamma} drafts: median {1e6 * statistics.median(verify):.0f} us, "
          f"mean {1e6 * statistics.mean(verify):.0f} us, p99 {1e6 * q(verify, n=100)[98]:.0f} us")


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--show", type=int, default=3, help="print this many outputs")
    args = parser.parse_args()
    from workers.demo_model import demo_head_dir, demo_model_dir

    etcd, nats = start_servers()
    env = env_for(etcd, nats, "sbench")
    port = free_port()
    model = str(demo_model_dir())
    procs = [
        ManagedProcess("workers.target", ["--model", model, "--served-model-name", "smol", "--num-speculative-tokens",
                                          "3", "--max-model-len", "2048"], env, "target").start(),
        ManagedProcess("workers.draft", ["--method", "eagle3", "--eagle-model", str(demo_head_dir()),
                                         "--target-model", model], env, "draft").start(),
        ManagedProcess("frontend", ["--http-port", str(port)], env, "frontend").start(),
    ]
    try:
        procs[2].wait_for_log("frontend ready", 120)
        client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                                    timeout=600)
        while True:  # until the draft worker speculates
            try:
                r = await client.chat.completions.create(model="smol", max_tokens=8, temperature=0,
                                                         messages=[{"role": "user", "content": "Count to five."}])
                if (r.usage.model_extra.get("spec_decode") or {}).get("num_drafts"):
                    break
            except openai.APIError:
                pass
            await asyncio.sleep(0.5)
        texts = prompts(args.prompts)
        on, t_on = await run(client, texts, None, args.concurrency, args.max_tokens)
        off, t_off = await run(client, texts, {"speculative": {"num_draft_tokens": 0}}, args.concurrency,
                               args.max_tokens)
        summary("speculation on ", on, t_on)
        summary("speculation off", off, t_off)
        same = sum(a.choices[0].message.content == b.choices[0].message.content for a, b in zip(on, off))
        print(f"equal on and off: {same}/{len(texts)}")
        for r in on[: args.show]:
            print("  ", r.choices[0].message.content)
        mask_costs([r.choices[0].message.content for r in on])
    finally:
        for proc in reversed(procs):
            proc.stop(timeout=10)
        etcd.cleanup()
        nats.cleanup()


if __name__ == "__main__":
    asyncio.run(main())
