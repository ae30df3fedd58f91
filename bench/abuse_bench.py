"""A bounded abuse run against the frontend: do well-behaved streams keep flowing while others misbehave?

Usage: .venv/bin/python bench/abuse_bench.py [--streams 8] [--fuzz 1000] [--cases baseline,token_ids,...]

Real etcd and nats-server on loopback (NATS allowing 8 MB messages), one mock worker for the
well-behaved streams and one for the one-shot cases' large requests (model ``abuse``; ``--one-worker``:
the same one), each at ``--token-ms`` (default 20 ms per token) with a context of 1M tokens so that
long prompts are routed and sent, and one ``python -m frontend`` (--body-timeout 3, --write-timeout 3). ``--streams`` clients stream completions all along and record the gap between
consecutive chunks. The cases run one after another; each reports the worst gap (and p99) the
well-behaved streams saw while it ran, next to ``baseline`` (nothing else running) of the same run:

  baseline     nothing but the well-behaved streams (3 s);
  long_prompt  two 1.4 MB prompt strings at once;
  chat_3mb     one chat message of 3 MB;
  token_ids    a completions prompt of 500,000 token ids;
  big_schema   a 3.9 MB JSON schema (response_format; too large: a 400);
  huge_regex   ``guided_regex`` ``a{4000000}`` (a 400);
  tools_10k    a chat request with 10,000 tools;
  bodies       a 3.5 MB body of 700,000 one-letter prompts, and a chat of 100,000 empty messages;
  costly       three bodies at once that each cost much to check before a 400: a chat of 4,096 messages
               (over ``--max-messages``... or their context), 1 MB of tools, and a 49,152-entry ``logit_bias``;
  deep_tools   128 tools whose parameters nest 60 deep;
  loop_chat    four clients sending the 4,096-message chat over and over for 3 s;
  uploads      10 uploads that declare 1,000 bytes, send 10 and disconnect, and 8 that trickle a byte a
               second past the body timeout;
  readers      3 streaming requests (n = 8, 2,000 tokens, logprobs 20) whose client never reads;
  fuzz         ``--fuzz`` random and mutated request bodies;
  wipe         etcd killed, its data deleted and started again empty, while plain requests keep coming;
               every worker stays alive, so every answer must be a 200 while the workers register again.
Case ``startup`` first starts services wrongly (missing model paths, a negative lease TTL, an unknown
TANDEM_LOG_LEVEL, a bad flag, NATS and etcd refusing connections) and reports, per case, the exit status,
the number of output lines and the seconds to exit (target: non-zero, one line, under 5 s).
Targets: every case's worst gap under 250 ms, no 5xx, 0 non-200 across the wipe. Also reports the
frontend's RSS before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from tests.support import http as http_support  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import EtcdServer, NatsServer, env_for, free_port  # noqa: E402

def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


async def raw(port: int, data: bytes, hold: float = 0.0, trickle: bool = False) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        if trickle:
            for _ in range(int(hold)):
                await asyncio.sleep(1)
                writer.write(b" ")
                await writer.drain()
        elif hold:
            await asyncio.sleep(hold)
    except (ConnectionError, OSError):
        pass
    finally:
        writer.close()


def never_reader(port: int):
    return http_support.raw_completion(port, {"model": "mock", "prompt": "x", "n": 8, "max_tokens": 2000,
                                            "stream": True, "logprobs": 20})


def fuzz_bodies(n: int, seed: int = 0) -> list[tuple[str, bytes]]:
    rng = random.Random(seed)
    values = [None, True, -1, 0, 1, 2**70, 1e308, float("nan"), "", "x" * 1000, "\udcff", [], {}, [1, "a"],
              {"a": [None]}, -0.5, 3.7, "mock"]
    fields = ["model", "prompt", "messages", "max_tokens", "temperature", "top_p", "top_k", "n", "stream", "stop",
              "logprobs", "seed", "stream_options", "response_format", "tools", "min_tokens", "ignore_eos", "echo",
              "best_of", "logit_bias", "user", "max_completion_tokens", "top_logprobs", "stop_token_ids"]
    out = []
    for i in range(n):
        path = rng.choice(["/v1/completions", "/v1/chat/completions"])
        kind = rng.random()
        if kind < 0.1:
            body = bytes(rng.randrange(256) for _ in range(rng.randrange(1, 200)))
        else:
            base = ({"model": "mock", "prompt": "hi", "max_tokens": 3} if path.endswith("/completions") and
                    "chat" not in path else {"model": "mock", "messages": [{"role": "user", "content": "hi"}],
                                             "max_tokens": 3})
            for _ in range(rng.randrange(1, 4)):
                value = rng.choice(values)
                base[rng.choice(fields)] = value if not (isinstance(value, float) and value != value) else "nan"
            try:
                body = json.dumps(base, allow_nan=False).encode("utf-8", "surrogatepass")
            except ValueError:
                body = b"{" + str(i).encode()
        out.append((path, body))
    return out


STARTUP_FAILURES = [
    ("target, missing model path", ["workers.target", "--model", "/nonexistent/model"], {}),
    ("draft, missing model path", ["workers.draft", "--method", "draft_model", "--draft-model", "/nonexistent/m"], {}),
    ("mock, negative --lease-ttl", ["workers.mock", "--lease-ttl", "-1"], {}),
    ("frontend, negative --lease-ttl", ["frontend", "--lease-ttl", "-1"], {}),
    ("router, unknown TANDEM_LOG_LEVEL", ["router"], {"TANDEM_LOG_LEVEL": "LOUD"}),
    ("frontend, bad flag", ["frontend", "--no-such-flag"], {}),
    ("mock, NATS refuses", ["workers.mock"], {"TANDEM_NATS": "nats://127.0.0.1:{dead}"}),
    ("mock, etcd refuses", ["workers.mock"], {"TANDEM_ETCD": "http://127.0.0.1:{dead}"}),
]


def startup_failures(env: dict[str, str]) -> bool:
    """Run every start-up failure; print one row each; True when all are one line, non-zero, < 5 s."""
    import subprocess

    dead, ok = free_port(), True
    for name, argv, extra in STARTUP_FAILURES:
        began = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", *argv], capture_output=True, text=True, cwd=ROOT, timeout=120,
                              env={**env, **{k: v.format(dead=dead) for k, v in extra.items()}})
        seconds = time.perf_counter() - began
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        good = done.returncode != 0 and len(lines) == 1 and seconds < 5
        ok &= good
        print(f"start-up failure {name:34s} exit {done.returncode}  {len(lines)} line(s)  {seconds:4.1f}s  "
              f"{'ok' if good else 'FAIL'}: {lines[-1][-110:] if lines else ''}")
    return ok


async def etcd_wipe(url: str, etcd, worker: ManagedProcess) -> Counter:
    """Kill etcd, delete its data, start it again; the statuses of plain requests sent meanwhile
    until the worker has registered again (and a second more)."""
    statuses: Counter = Counter()
    stop = asyncio.Event()

    load = [asyncio.create_task(http_support.completion_load(url, statuses, stop, "across an etcd wipe"))
            for _ in range(4)]
    await asyncio.sleep(0.5)
    registered = worker.logs().count("registering again")
    await asyncio.to_thread(etcd.stop, True)
    await asyncio.to_thread(etcd.wipe)  # (rmtree of its data: not on this loop, which times the streams)
    await asyncio.sleep(1.0)
    await asyncio.to_thread(etcd.start)
    deadline = time.monotonic() + 30
    while worker.logs().count("registering again") == registered and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    await asyncio.sleep(1.0)
    stop.set()
    await asyncio.gather(*load)
    return statuses


def _words(chars: int, seed: int) -> str:
    rng = random.Random(seed)
    vocab = ["the", "model", "serves", "tokens", "quickly", "while", "drafts", "verify", "every", "step", "and",
             "streams", "keep", "flowing", "under", "load", "3.14", "(x)", "naïve", "日本"]
    out, size = [], 0
    while size < chars:
        word = rng.choice(vocab)
        out.append(word)
        size += len(word) + 1
    return " ".join(out)


def case_bodies(model: str) -> dict[str, list[tuple[str, bytes]]]:
    """The request bodies of the one-shot cases, for ``model``: case -> [(path, body)], sent all at once."""
    rng = random.Random(1)
    chat = "/v1/chat/completions"
    comp = "/v1/completions"
    enc = lambda obj: json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()  # noqa: E731
    big_schema = {"type": "object", "properties": {f"field_{i}": {"type": "string", "description": "d" * 40}
                                                   for i in range(44_000)}}
    tool = lambda i: {"type": "function", "function": {  # noqa: E731
        "name": f"tool_{i}", "description": "Looks something up",
        "parameters": {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}}}
    many_messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": _words(60, i)} for i in range(4_096)]
    fat_tool = lambda i: {"type": "function", "function": {  # noqa: E731  (about 2.6 kB each: 1 MB for 400)
        "name": f"tool_{i}", "description": _words(600, i),
        "parameters": {"type": "object", "properties": {f"p{k}": {"type": "string", "description": _words(60, k)}
                                                        for k in range(24)}}}}

    def nested(depth: int) -> dict:
        schema: dict = {"type": "string"}
        for level in range(depth):
            schema = {"type": "object", "properties": {f"l{level}": schema, "x": {"type": "integer"}}}
        return schema

    deep_tool = lambda i: {"type": "function", "function": {  # noqa: E731
        "name": f"deep_{i}", "description": "nested", "parameters": nested(60)}}
    return {
        "long_prompt": [(comp, enc({"model": model, "prompt": _words(1_400_000, s), "max_tokens": 2})) for s in (1, 2)],
        "chat_3mb": [(chat, enc({"model": model, "messages": [{"role": "user", "content": _words(3_000_000, 3)}],
                                 "max_tokens": 2}))],
        "token_ids": [(comp, enc({"model": model, "prompt": [rng.randrange(1000, 49_000) for _ in range(500_000)],
                                  "max_tokens": 2}))],
        "big_schema": [(chat, enc({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                   "response_format": {"type": "json_schema",
                                                       "json_schema": {"name": "big", "schema": big_schema}}}))],
        "huge_regex": [(comp, enc({"model": model, "prompt": "hi", "max_tokens": 2, "guided_regex": "a{4000000}"}))],
        "tools_10k": [(chat, enc({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                  "tools": [tool(i) for i in range(10_000)], "tool_choice": "required"}))],
        "costly": [(chat, enc({"model": model, "max_tokens": 2, "messages": many_messages})),
                   (chat, enc({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                               "tools": [fat_tool(i) for i in range(400)]})),
                   (comp, enc({"model": model, "prompt": "hi", "max_tokens": 2,
                               "logit_bias": {str(i): 1 for i in range(49_152)}}))],
        "deep_tools": [(chat, enc({"model": model, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}],
                                   "tools": [deep_tool(i) for i in range(128)]}))],
        "loop_chat": [(chat, enc({"model": model, "max_tokens": 2, "messages": many_messages}))],
        "bodies": [(comp, enc({"model": model, "prompt": ["a"] * 700_000})),
                   (chat, enc({"model": model, "messages": [{"role": "user", "content": ""}] * 100_000}))],
    }


ORDER = ("baseline", "long_prompt", "chat_3mb", "token_ids", "big_schema", "huge_regex", "tools_10k", "bodies",
         "costly", "deep_tools", "loop_chat", "uploads", "readers", "fuzz", "wipe")


async def amain(args) -> None:
    etcd = EtcdServer()
    etcd.start()
    # NATS allows 8 MB messages here (1 MB by default), so that a 500k-token prompt reaches the worker
    conf = Path(tempfile.mkdtemp(prefix="abuse-nats-")) / "nats.conf"
    conf.write_text("max_payload: 8388608\n")
    nats_server = NatsServer("-c", str(conf))
    nats_server.start()
    env = env_for(etcd, nats_server, "abuse")
    startup_ok = startup_failures(env) if "startup" in args.cases else True
    port = free_port()
    worker = ManagedProcess("workers.mock", ["--token-latency-ms", str(args.token_ms), "--num-speculative-tokens", "0",
                                             "--max-model-len", str(1 << 20)], env, "mock").start()
    # The one-shot cases go to a worker of their own (model "abuse"), unless --one-worker: a mock
    # worker hashes and scans a 500k-token prompt on its own event loop, which would stall the
    # well-behaved streams it serves and be counted against the frontend.
    abuse_model = "mock" if args.one_worker else "abuse"
    other = None if args.one_worker else ManagedProcess(
        "workers.mock", ["--served-model-name", "abuse", "--token-latency-ms", str(args.token_ms),
                         "--num-speculative-tokens", "0", "--max-model-len", str(1 << 20)], env, "abuse").start()
    frontend = ManagedProcess("frontend", ["--http-port", str(port), "--body-timeout", "3", "--write-timeout", "3",
                                           *args.frontend_args.split()], env, "frontend").start()
    url = f"http://127.0.0.1:{port}"
    bodies = case_bodies(abuse_model)
    gc.collect()
    gc.freeze()  # this client's own full collections would stall the gaps it measures
    rows, failures = [], []
    try:
        frontend.wait_for_log("frontend ready", timeout=60)
        await http_support.wait_for_model(url, "mock")
        await http_support.wait_for_model(url, abuse_model)
        async with httpx.AsyncClient(base_url=url, timeout=30) as client:
            await client.post("/v1/completions", json={"model": "mock", "prompt": "warm", "max_tokens": 2})
        # costly chat templates render in a process of the frontend's own, which loads the tokenizer first
        await asyncio.to_thread(frontend.wait_for_log, "render process ready", 120)
        if args.pause:  # e.g. to attach a profiler to the frontend
            print(f"frontend pid {frontend.pid}; starting in {args.pause:.0f}s", flush=True)
            await asyncio.sleep(args.pause)
        rss_before = rss_mb(frontend.pid)
        gaps: list[float] = []
        stop = asyncio.Event()
        lags: list[float] = []  # this client's own event loop: a late wake-up here is no frontend stall

        async def own_lag() -> None:
            while not stop.is_set():
                began = time.perf_counter()
                await asyncio.sleep(0.005)
                lags.append(time.perf_counter() - began - 0.005)

        lag_task = asyncio.create_task(own_lag())
        good = [asyncio.create_task(http_support.good_stream(url, gaps, stop)) for _ in range(args.streams)]
        await asyncio.sleep(1.5)  # every well-behaved stream is running
        async with httpx.AsyncClient(base_url=url, timeout=120) as client:
            async def post(path: str, content: bytes, statuses: Counter) -> None:
                try:
                    r = await client.post(path, content=content, headers={"content-type": "application/json"})
                    statuses[r.status_code] += 1
                    if r.status_code >= 400 and args.verbose:
                        print(f"  {r.status_code}: {r.text[:200]}")
                except httpx.HTTPError as exc:
                    statuses[type(exc).__name__] += 1

            for case in [c for c in ORDER if c in args.cases]:
                statuses: Counter = Counter()
                gaps.clear()
                lags.clear()
                started = time.perf_counter()
                if case == "baseline":
                    await asyncio.sleep(3)
                elif case == "loop_chat":
                    (path, body), until = bodies[case][0], time.perf_counter() + 3

                    async def loop_one() -> None:
                        while time.perf_counter() < until:
                            await post(path, body, statuses)

                    await asyncio.gather(*(loop_one() for _ in range(4)))
                elif case in bodies:
                    for _ in range(args.repeat):
                        await asyncio.gather(*(post(p, b, statuses) for p, b in bodies[case]))
                elif case == "uploads":
                    partial = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                               b"Content-Length: 1000\r\n\r\n" + b'{"model": ')
                    await asyncio.gather(*[raw(port, partial) for _ in range(10)],
                                         *[raw(port, partial, hold=5, trickle=True) for _ in range(8)])
                elif case == "readers":
                    readers = [never_reader(port) for _ in range(3)]
                    await asyncio.sleep(5)  # the never-reading clients' streams get dropped meanwhile
                    for sock in readers:
                        sock.close()
                elif case == "fuzz":
                    sem = asyncio.Semaphore(32)

                    async def fuzz(path: str, body: bytes) -> None:
                        async with sem:
                            await post(path, body, statuses)

                    await asyncio.gather(*[fuzz(p, b) for p, b in fuzz_bodies(args.fuzz)])
                elif case == "wipe":
                    statuses = await etcd_wipe(url, etcd, worker)
                seconds = time.perf_counter() - started
                await asyncio.sleep(0.5)  # a stall right at the end still shows
                window = list(gaps)
                worst = max(window, default=0.0)
                client_lag = max(lags, default=0.0)
                p99 = sorted(window)[int(0.99 * len(window))] if window else 0.0
                rows.append((case, worst, p99, len(window), seconds, statuses, client_lag))
                print(f"{case:12s} worst gap {1e3 * worst:6.0f} ms  p99 {1e3 * p99:4.0f} ms  ({len(window)} gaps, "
                      f"{seconds:5.1f}s; this client's own loop lag {1e3 * client_lag:4.0f} ms)  "
                      f"{dict(sorted(statuses.items(), key=str))}", flush=True)
                if worst >= 0.25:
                    failures.append(f"{case}: worst gap {1e3 * worst:.0f} ms")
                if any(isinstance(k, int) and k >= 500 for k in statuses) or (case == "wipe" and set(statuses) != {200}):
                    failures.append(f"{case}: statuses {dict(statuses)}")
        stop.set()
        await lag_task
        streams = sum(await asyncio.gather(*good))
        rss_after = rss_mb(frontend.pid)
        text = httpx.get(url + "/metrics", timeout=5).text
        server_5xx = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                         if line.startswith("tandem_frontend_requests_total{") and 'status="5' in line)
        base = next((r[1] for r in rows if r[0] == "baseline"), None)
        print(f"\n{args.streams} well-behaved streams at {args.token_ms:g} ms/token completed {streams} streams; "
              f"frontend RSS {rss_before:.0f} MB before, {rss_after:.0f} MB after; frontend-counted 5xx: {server_5xx:.0f}")
        print("\n| case | worst gap (ms) | vs baseline | p99 gap (ms) | client's own lag (ms) | seconds | statuses |")
        print("|---|---|---|---|---|---|---|")
        for case, worst, p99, _, seconds, statuses, client_lag in rows:
            ratio = f"{worst / base:.1f}×" if base else "-"
            shown = ", ".join(f"{k}: {v}" for k, v in sorted(statuses.items(), key=str)) or "-"
            print(f"| {case} | {1e3 * worst:.0f} | {ratio} | {1e3 * p99:.0f} | {1e3 * client_lag:.0f} | {seconds:.1f} | "
                  f"{shown} |")
        if server_5xx:
            failures.append(f"{server_5xx:.0f} 5xx counted by the frontend")
        if not startup_ok:
            failures.append("a start-up failure was not one line, non-zero and under 5 s")
        if failures:
            sys.exit("FAILED: " + "; ".join(failures))
    finally:
        frontend.stop()
        worker.stop()
        if other is not None:
            other.stop()
        etcd.cleanup()
        nats_server.cleanup()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--streams", type=int, default=8)
    ap.add_argument("--fuzz", type=int, default=1000)
    ap.add_argument("--token-ms", type=float, default=20.0, help="the mock worker's time per token")
    ap.add_argument("--cases", type=lambda v: set(v.split(",")), default={*ORDER, "startup"},
                    help=f"which cases to run, comma-separated: {', '.join(ORDER)}, startup (default all)")
    ap.add_argument("--one-worker", action="store_true",
                    help="send the one-shot cases to the well-behaved streams' own mock worker (default: another)")
    ap.add_argument("--frontend-args", default="", help="extra flags for the frontend (e.g. '--router-mode kv')")
    ap.add_argument("--repeat", type=int, default=1, help="send each one-shot case's bodies this many times")
    ap.add_argument("--verbose", action="store_true", help="print the start of every error answer")
    ap.add_argument("--pause", type=float, default=0.0, help="seconds to wait before the cases (attach a profiler)")
    asyncio.run(amain(ap.parse_args()))


if __name__ == "__main__":
    main()
