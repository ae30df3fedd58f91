"""Prefill/decode disaggregation on this machine: KV transfer speed, acceptance, and a mixed workload.

Parts (``--parts``, default all):

- ``transfer``: one process registers a cache laid out like the demo model's (30 layers' keys and
  values and 4 hidden-row layers, 16-token blocks) and another pulls 8 to 128 blocks from it through
  :class:`workers.target.kv_transfer.KvAgent` (the serving code path: merged descriptors, one READ
  request); the baseline is ``torch.index_select`` copying the same blocks inside one process.
- ``serve``: a prefill worker, a decode worker and the demo's EAGLE-3 draft behind two frontends, one
  disaggregating every prompt and one prefilling on the decode worker (aggregated). Per prompt
  length, the prefill worker's prefill time against the decode worker's pull time (their
  histograms); then the hand-written natural prompts one at a time through each frontend: equal
  greedy text and the mean acceptance length of each.
- ``mixed``: the same two model processes either as two aggregated targets or as one prefill and one
  decode worker (no draft), under short chat requests streaming continuously while long prompts
  arrive; time to first token and inter-token latency p50/p99 per request kind, measured by the client.

Usage: python bench/disagg_bench.py [--parts transfer,serve,mixed] [--mixed-seconds 60]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx  # noqa: E402
import torch  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from deploy.binaries import free_port  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, start_servers  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, HIDDEN, HIDDEN_LAYERS, BS = 30, 3, 64, 576, 4, 16  # the demo model's cache


# ----------------------------------------------------------------------------------- transfer


def demo_like_regions(num_blocks: int) -> list[torch.Tensor]:
    kv = [torch.randn(num_blocks, BS, KV_HEADS, HEAD_DIM) for _ in range(2 * LAYERS)]
    return kv + [torch.randn(num_blocks * BS, HIDDEN) for _ in range(HIDDEN_LAYERS)]


def layout(regions: list[torch.Tensor], num_blocks: int):
    from runtime.messages import KvLayout

    block_bytes = [t[0].numel() * t.element_size() if i < 2 * LAYERS else BS * HIDDEN * 4 for i, t in enumerate(regions)]
    return KvLayout("demo-like", BS, "float32", LAYERS, KV_HEADS, HEAD_DIM, list(range(HIDDEN_LAYERS)), HIDDEN,
                    num_blocks, "DRAM", 0, [t.data_ptr() for t in regions], block_bytes)


def _serve_regions(queue, done, num_blocks: int) -> None:
    from workers.target.kv_transfer import KvAgent

    regions = demo_like_regions(num_blocks)
    agent = KvAgent("bench-prefill", regions, layout(regions, num_blocks))
    queue.put(agent.record("prefill"))
    done.get()
    agent.close()


def transfer(out: dict) -> None:
    from workers.target.kv_transfer import KvAgent

    num_blocks = 256
    ctx = mp.get_context("spawn")
    queue, done = ctx.Queue(), ctx.Queue()
    server = ctx.Process(target=_serve_regions, args=(queue, done, num_blocks))
    server.start()
    record = queue.get(timeout=120)
    mine = demo_like_regions(num_blocks)
    agent = KvAgent("bench-decode", mine, layout(mine, num_blocks))
    rows = []
    torch.set_num_threads(1)
    for blocks in (8, 32, 64, 128):
        local = list(range(blocks))
        remote = list(range(64, 64 + blocks))  # one run each side: 64 descriptors (one per region)
        scattered = list(range(0, 2 * blocks, 2))  # every other block: one descriptor per block per region
        times = {"nixl": [], "nixl_scattered": [], "copy": []}
        nbytes = 0
        for _ in range(12):
            got = asyncio.run(agent.pull(record, local, remote, 10.0))
            nbytes = got.bytes
            times["nixl"].append(got.seconds)
            times["nixl_scattered"].append(asyncio.run(agent.pull(record, local, scattered, 10.0)).seconds)
            idx = torch.tensor(remote)
            t0 = time.perf_counter()
            for r, t in enumerate(mine):  # the same bytes copied within one process
                src = t if r < 2 * LAYERS else t.view(num_blocks, BS, HIDDEN)
                dst = src.index_select(0, idx)
                del dst
            times["copy"].append(time.perf_counter() - t0)
        row = {"blocks": blocks, "tokens": blocks * BS, "mib": nbytes / 2**20}
        for k, v in times.items():
            med = statistics.median(v[2:])
            row[f"{k}_ms"] = 1e3 * med
            row[f"{k}_gbps"] = nbytes / med / 1e9
        rows.append(row)
        print(json.dumps(row), flush=True)
    done.put(1)
    server.join(30)
    agent.close()
    out["transfer"] = {"ucx_tls": os.environ.get("UCX_TLS", "(default)"), "rows": rows}


# ----------------------------------------------------------------------------------- served


async def scrape(addr: str, prefixes: tuple[str, ...]) -> dict[str, float]:
    async with httpx.AsyncClient(timeout=10) as http:
        text = (await http.get(f"http://{addr}/metrics")).text
    out: dict[str, float] = {}
    for f in text_string_to_metric_families(text):
        for s in f.samples:
            if s.name.startswith(prefixes) and "le" not in s.labels:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class Stack:
    """etcd, NATS and named Tandem processes in one namespace."""

    def __init__(self, namespace: str):
        self.servers = start_servers()
        self.env = env_for(*self.servers, namespace)
        self.procs: dict[str, ManagedProcess] = {}
        self.ports: dict[str, int] = {}

    def spawn(self, name: str, module: str, *args: str) -> None:
        self.ports[name] = port = free_port()
        flag = "--http-port" if module == "frontend" else "--health-port"
        self.procs[name] = ManagedProcess(module, [*args, flag, str(port)], self.env, name).start()

    def addr(self, name: str) -> str:
        return f"127.0.0.1:{self.ports[name]}"

    async def ready(self, frontends: list[str], workers: list[str]) -> None:
        from tests.support.http import wait_for_model
        from workers.demo_model import DEMO_NAME

        for f in frontends:
            await wait_for_model(f"http://{self.addr(f)}", DEMO_NAME, timeout=300)
        for w in workers:
            await asyncio.to_thread(self.procs[w].wait_for_log, "ready", 300)

    def close(self) -> None:
        for p in self.procs.values():
            p.stop(timeout=10)
        for s in self.servers:
            s.cleanup()


def worker_args(model: str, *extra: str) -> list[str]:
    from workers.demo_model import DEMO_NAME

    return ["workers.target", "--model", model, "--served-model-name", DEMO_NAME, "--threads", "1", "--num-blocks",
            "512", "--lease-ttl", "3", *extra]


async def complete(addr: str, body: dict) -> dict:
    from workers.demo_model import DEMO_NAME

    async with httpx.AsyncClient(timeout=300) as http:
        resp = await http.post(f"http://{addr}/v1/completions", json={"model": DEMO_NAME, **body})
    resp.raise_for_status()
    return resp.json()


def long_text(tok, n_tokens: int, salt: str) -> str:
    from bench.natural import natural_conversations

    words = " ".join(m["content"] for conv in natural_conversations() for m in conv).split()
    text, k = salt, 0
    while len(tok(text)["input_ids"]) < n_tokens:
        text += " " + " ".join(words[k : k + 40])
        k = (k + 40) % max(1, len(words) - 40)
    ids = tok(text)["input_ids"][:n_tokens]
    return tok.decode(ids)


async def serve(out: dict, args) -> None:
    from transformers import AutoTokenizer

    from bench.natural import natural_prompt_ids
    from workers.demo_model import DEMO_HEAD, DEMO_NAME, demo_model_dir

    model = str(demo_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    stack = Stack("disaggbench")
    try:
        # no prefix caching: each pass computes (or pulls) every prompt in full, whatever ran before it
        spec = ["--num-speculative-tokens", "3", "--speculative-config",
                '{"load_aware": false, "propose_min_wait": 0.3}', "--no-prefix-caching"]
        stack.spawn("prefill", *worker_args(model, "--role", "prefill", "--no-prefix-caching"))
        stack.spawn("decode", *worker_args(model, "--role", "decode", *spec))
        stack.spawn("draft", "workers.draft", "--method", "eagle3", "--eagle-model", str(DEMO_HEAD), "--target-model",
                    model, "--served-model-name", DEMO_NAME, "--lease-ttl", "3")
        stack.spawn("disagg", "frontend", "--disagg-min-tokens", "1", "--lease-ttl", "3")
        stack.spawn("agg", "frontend", "--disagg-min-tokens", "1000000", "--lease-ttl", "3")
        await stack.ready(["disagg", "agg"], ["prefill", "decode"])
        await asyncio.to_thread(stack.procs["draft"].wait_for_log, "draft worker", 300)
        for _ in range(3):  # warm up, and let the decode worker find the draft
            await complete(stack.addr("agg"), {"prompt": "Hello there, how are you today?", "max_tokens": 16,
                                               "temperature": 0})
        # prefill time against pull time, per prompt length
        rows = []
        for n in (128, 512, 1024, 1900):
            before_p = await scrape(stack.addr("prefill"), ("vllm:time_to_first_token",))
            before_d = await scrape(stack.addr("decode"), ("tandem_target_kv",))
            for i in range(args.per_length):
                await complete(stack.addr("disagg"), {"prompt": long_text(tok, n, f"Request {n}-{i}."),
                                                      "max_tokens": 2, "temperature": 0})
            after_p = await scrape(stack.addr("prefill"), ("vllm:time_to_first_token",))
            after_d = await scrape(stack.addr("decode"), ("tandem_target_kv",))

            def mean(a, b, name):
                count = b[f"{name}_count"] - a.get(f"{name}_count", 0)
                return (b[f"{name}_sum"] - a.get(f"{name}_sum", 0)) / count if count else float("nan")

            prefill_s = mean(before_p, after_p, "vllm:time_to_first_token_seconds")
            pull_s = mean(before_d, after_d, "tandem_target_kv_transfer_seconds")
            moved = (after_d["tandem_target_kv_transfer_bytes_total"] - before_d.get("tandem_target_kv_transfer_bytes_total", 0)) / args.per_length
            row = {"prompt_tokens": n, "prefill_ms": 1e3 * prefill_s, "pull_ms": 1e3 * pull_s,
                   "pull_over_prefill": pull_s / prefill_s, "mib_per_request": moved / 2**20}
            rows.append(row)
            print(json.dumps(row), flush=True)
        out["prefill_vs_pull"] = rows
        # acceptance on the hand-written natural prompts, one request at a time through each frontend
        prompts = [tok.decode(ids) for ids in natural_prompt_ids(tok, args.prompts)]
        result = {}
        texts = {}
        for name in ("disagg", "agg"):
            before = await scrape(stack.addr("decode"), ("vllm:spec_decode",))
            texts[name] = [(await complete(stack.addr(name), {"prompt": p, "max_tokens": args.max_tokens,
                                                               "temperature": 0}))["choices"][0]["text"]
                           for p in prompts]
            after = await scrape(stack.addr("decode"), ("vllm:spec_decode",))
            drafts = after["vllm:spec_decode_num_drafts_total"] - before.get("vllm:spec_decode_num_drafts_total", 0)
            accepted = (after["vllm:spec_decode_num_accepted_tokens_total"]
                        - before.get("vllm:spec_decode_num_accepted_tokens_total", 0))
            result[name] = {"drafts": drafts, "acceptance_length": 1 + accepted / drafts if drafts else None}
            print(name, json.dumps(result[name]), flush=True)
        result["equal_texts"] = sum(a == b for a, b in zip(texts["disagg"], texts["agg"]))
        result["prompts"] = len(prompts)
        front = await scrape(stack.addr("disagg"), ("tandem_frontend_prefills",))
        result["frontend_prefills"] = front
        out["acceptance"] = result
        print(json.dumps(result), flush=True)
    finally:
        stack.close()


# ----------------------------------------------------------------------------------- mixed


async def stream_one(addr: str, prompt: str, max_tokens: int) -> tuple[float, list[float]]:
    """(time to first token, inter-token gaps) of one streamed completion, measured here."""
    from workers.demo_model import DEMO_NAME

    start = time.perf_counter()
    stamps = []
    async with httpx.AsyncClient(timeout=300) as http:
        async with http.stream("POST", f"http://{addr}/v1/completions",
                               json={"model": DEMO_NAME, "prompt": prompt, "max_tokens": max_tokens,
                                     "temperature": 0, "stream": True, "ignore_eos": True}) as resp:
            resp.raise_for_status()
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    if json.loads(line[6:])["choices"][0].get("text"):
                        stamps.append(time.perf_counter())
    if not stamps:
        raise RuntimeError("no tokens streamed")
    return stamps[0] - start, [b - a for a, b in zip(stamps, stamps[1:])]


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


async def mixed_run(addr: str, tok, seconds: float, short_streams: int, long_every: float, long_tokens: int) -> dict:
    from bench.natural import natural_conversations

    shorts = [" ".join(m["content"] for m in conv)[:200] for conv in natural_conversations(40)]
    ttft = {"short": [], "long": []}
    itl = {"short": [], "long": []}
    failures = 0
    stop = time.perf_counter() + seconds

    async def short_client(k: int) -> None:
        nonlocal failures
        i = k
        while time.perf_counter() < stop:
            try:
                t, gaps = await stream_one(addr, shorts[i % len(shorts)], 48)
                ttft["short"].append(t)
                itl["short"].extend(gaps)
            except Exception:
                failures += 1
            i += short_streams

    async def long_client() -> None:
        nonlocal failures
        i = 0
        tasks = []
        while time.perf_counter() < stop - 5:
            async def one(j: int) -> None:
                nonlocal failures
                try:
                    t, gaps = await stream_one(addr, long_text(tok, long_tokens, f"Document {j} {time.time()}."), 16)
                    ttft["long"].append(t)
                    itl["long"].extend(gaps)
                except Exception:
                    failures += 1
            tasks.append(asyncio.create_task(one(i)))
            i += 1
            await asyncio.sleep(long_every)
        await asyncio.gather(*tasks)

    await asyncio.gather(long_client(), *(short_client(k) for k in range(short_streams)))
    out = {"failures": failures}
    for kind in ("short", "long"):
        out[kind] = {"requests": len(ttft[kind]), "ttft_p50_ms": 1e3 * pct(ttft[kind], 0.5),
                     "ttft_p99_ms": 1e3 * pct(ttft[kind], 0.99), "itl_p50_ms": 1e3 * pct(itl[kind], 0.5),
                     "itl_p99_ms": 1e3 * pct(itl[kind], 0.99)}
    return out


async def mixed(out: dict, args) -> None:
    from transformers import AutoTokenizer

    from workers.demo_model import demo_model_dir

    model = str(demo_model_dir())
    tok = AutoTokenizer.from_pretrained(model)
    results = {}
    for layout_name in args.mixed_layouts.split(","):
        stack = Stack(f"mixed{layout_name}")
        try:
            if layout_name == "aggregated":
                stack.spawn("w0", *worker_args(model))
                stack.spawn("w1", *worker_args(model))
                stack.spawn("front", "frontend", "--lease-ttl", "3")
            else:
                stack.spawn("w0", *worker_args(model, "--role", "prefill"))
                stack.spawn("w1", *worker_args(model, "--role", "decode"))
                stack.spawn("front", "frontend", "--disagg-min-tokens", str(args.disagg_min_tokens), "--lease-ttl", "3")
            await stack.ready(["front"], ["w0", "w1"])
            await stream_one(stack.addr("front"), "Warm up.", 4)
            results[layout_name] = r = await mixed_run(stack.addr("front"), tok, args.mixed_seconds, args.short_streams,
                                                       args.long_every, args.long_tokens)
            print(layout_name, json.dumps(r), flush=True)
        finally:
            stack.close()
    out["mixed"] = {"shape": {"short_streams": args.short_streams, "short": "natural chat text <= 200 chars, 48 tokens",
                              "long_every_s": args.long_every, "long_prompt_tokens": args.long_tokens,
                              "long_max_tokens": 16, "seconds": args.mixed_seconds}, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="transfer,serve,mixed")
    parser.add_argument("--per-length", type=int, default=4, help="serve: requests per prompt length")
    parser.add_argument("--prompts", type=int, default=68, help="serve: natural prompts for acceptance")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--mixed-seconds", type=float, default=60.0)
    parser.add_argument("--mixed-layouts", default="aggregated,disaggregated")
    parser.add_argument("--short-streams", type=int, default=3)
    parser.add_argument("--long-every", type=float, default=6.0, help="seconds between long prompts")
    parser.add_argument("--long-tokens", type=int, default=1500)
    parser.add_argument("--disagg-min-tokens", type=int, default=256)
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    args = parser.parse_args()
    out: dict = {}
    parts = args.parts.split(",")
    if "transfer" in parts:
        transfer(out)
    if "serve" in parts:
        asyncio.run(serve(out, args))
    if "mixed" in parts:
        asyncio.run(mixed(out, args))
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
