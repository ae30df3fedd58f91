"""An agent workload: multi-turn tool-using sessions replayed through the real stack.

Usage: .venv/bin/python bench/agent_bench.py [--sessions bench/prompts/agent_sessions.jsonl] [--max-tokens 48]
       [--tool-latency 0.5] [--workers 2] [--only ...]
       .venv/bin/python bench/agent_bench.py --draft-methods none suffix [--gamma 8] [--max-tokens 160]
       [--speculative-config '{"suffix_decoding_max_tree_depth": 32}'] [--kinds coding ...]

Real etcd and nats-server on loopback, ``--workers`` target workers on the demo model (SmolLM2-135M,
``--threads 1`` each, no speculation) and one ``python -m frontend --router-mode kv``. The sessions
(``bench/prompts/agent_sessions.jsonl``, written by hand for this bench): coding agents that rewrite
files they wrote (each tool result pastes back the model's own previous reply), search agents that
paste search results, support agents under a long shared system prompt. All sessions run at once;
each turn is a streaming chat completion at temperature 0 whose messages are the earlier turns, the
model's actual replies and the next tool output; between turns the agent "runs its tool" for
``--tool-latency`` seconds. Three runs, each on a fresh stack (cold caches):

- ``no session header``: the KV router alone (the baseline);
- ``session header``: every turn carries ``X-Dynamo-Session-ID``;
- ``session header + speculative_prefill``: and ``nvext.agent_hints.speculative_prefill: true``.

Reported per run: TTFT p50/p90 over all turns, next-turn TTFT p50 (turns after the first), ITL p50/p90
(between streamed chunks), session time mean/max, the share of later turns that landed where their
prefix is cached (the reply's ``cached_tokens`` cover the previous turn's whole prompt blocks) and
that stayed on the previous turn's worker (the router's log), the next-turn prefill counts, and
whether every reply equals the first run's (greedy).

Speculation mode (``--draft-methods none suffix``): one run per method, each on a fresh stack, every
turn with its session header and no next-turn prefill. ``none`` is plain decoding (targets at γ = 0,
no draft worker, as ``tandem up --draft-method none``); any other method starts the targets at
``--gamma`` with one draft worker of that method serving them all (``--speculative-config`` goes to
the targets and the draft, draft-only keys to the draft). Reported per session kind (coding, search,
support): session time mean, its ratio to the first method's, completion tokens, tokens per target
step (completion tokens / (verify steps + plain decode steps + 1): what speculation buys a request),
mean accepted length (tokens per verify step, vLLM's), the draft acceptance rate, the decode steps
that ran without a draft by reason (``usage.spec_decode.plain_steps``), and replies equal to the
first method's (greedy: must be all).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import statistics
import sys
import time
import uuid
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from bench.common import wait_for_instances  # noqa: E402
from tests.support.procs import ManagedProcess  # noqa: E402
from tests.support.servers import env_for, free_port, start_servers  # noqa: E402

RUNS = (("no session header", False, False), ("session header", True, False),
        ("session header + speculative_prefill", True, True))
BLOCK = 16  # the workers' KV block size (the default)


def percentile(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def load_sessions(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


async def turn(http: httpx.AsyncClient, model: str, messages: list[dict], rid: str, session: str | None,
               hinted: bool, max_tokens: int) -> dict:
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if hinted:
        body["nvext"] = {"agent_hints": {"speculative_prefill": True}}
    headers = {"X-Request-Id": rid}
    if session:
        headers["X-Dynamo-Session-ID"] = session
    start = time.perf_counter()
    stamps, text, usage = [], [], None
    async with http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            raise RuntimeError(f"turn {rid}: {resp.status_code} {(await resp.aread())[:300]!r}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                usage = chunk["usage"]
            for choice in chunk.get("choices", ()):
                piece = choice.get("delta", {}).get("content")
                if piece:
                    stamps.append(time.perf_counter())
                    text.append(piece)
    return {"rid": rid, "ttft": stamps[0] - start if stamps else float("nan"),
            "itl": [b - a for a, b in zip(stamps, stamps[1:])], "text": "".join(text), "usage": usage}


async def session(http: httpx.AsyncClient, model: str, s: dict, run_tag: str, header: bool, hinted: bool,
                  args) -> dict:
    messages = [{"role": "system", "content": s["system"]}]
    last_reply, turns = "", []
    start = time.perf_counter()
    for k, content in enumerate(s["turns"]):
        messages.append({"role": "user", "content": content.replace("{last_reply}", last_reply)})
        t = await turn(http, model, messages, f"{run_tag}.{s['id']}.t{k}", f"{s['id']}-{run_tag}" if header else None,
                       hinted, args.max_tokens)
        turns.append(t)
        messages.append({"role": "assistant", "content": t["text"]})
        last_reply = t["text"]
        if k + 1 < len(s["turns"]):
            await asyncio.sleep(args.tool_latency)  # the agent runs its tool
    return {"id": s["id"], "kind": s["kind"], "turns": turns, "time": time.perf_counter() - start}


def chosen_workers(log: str) -> dict[str, str]:
    """request id (as sent in X-Request-Id) -> the worker the router chose, from the frontend's DEBUG log."""
    return {m.group(1): m.group(2) for m in re.finditer(r"request (\S+)-[0-9a-f]{8}: chose (\S+)", log)}


TARGET_KEYS = {"num_speculative_tokens", "eagle_topk", "num_steps", "adaptive", "load_aware", "seam", "propose_timeout",
               "propose_min_wait", "hidden_layers", "hidden_plane", "hidden_ring_mib", "draft_lane"}


def split_config(config: dict) -> tuple[dict, dict]:
    """(the targets' keys, the draft's keys) of a --speculative-config (eagle_topk, num_steps: both)."""
    both = {"eagle_topk", "num_steps"}
    return ({k: v for k, v in config.items() if k in TARGET_KEYS},
            {k: v for k, v in config.items() if k not in TARGET_KEYS or k in both})


async def run(name: str, header: bool, hinted: bool, args, sessions: list[dict], etcd, nats_server,
              method: str = "none") -> dict:
    from workers.demo_model import DEMO_NAME, demo_model_dir

    env = env_for(etcd, nats_server, "agent-" + uuid.uuid4().hex[:8])
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    model_dir = str(demo_model_dir())
    health = [free_port() for _ in range(args.workers)]
    on_target, on_draft = split_config(json.loads(args.speculative_config)) if method != "none" else ({}, {})
    spec = (["--num-speculative-tokens", str(args.gamma)] if method != "none" else ["--num-speculative-tokens", "0"])
    spec += ["--speculative-config", json.dumps(on_target)] if on_target else []
    workers = [ManagedProcess("workers.target", ["--model", model_dir, "--served-model-name", DEMO_NAME, "--threads", "1",
                                                 *spec, "--max-model-len", "4096",
                                                 "--lease-ttl", "3", "--health-port", str(health[i])], env,
                              f"target{i}").start()
               for i in range(args.workers)]
    draft_health = free_port()
    if method != "none":
        workers.append(ManagedProcess("workers.draft", ["--draft-method", method, "--served-model-name", DEMO_NAME,
                                                        "--lease-ttl", "3", "--health-port", str(draft_health),
                                                        *(["--speculative-config", json.dumps(on_draft)] if on_draft else [])],
                                      env, f"draft-{method}").start())
    frontend = ManagedProcess("frontend", ["--http-port", str(port), "--router-mode", "kv", "--log-level", "DEBUG",
                                           "--lease-ttl", "3"], env, "frontend").start()
    try:
        frontend.wait_for_log("frontend ready", timeout=60)
        async with httpx.AsyncClient(base_url=url, timeout=600) as http:
            await wait_for_instances(http, DEMO_NAME, args.workers, timeout=180,
                                     why=lambda: "\n".join(w.logs()[-1500:] for w in workers))
            if method != "none":  # every target has its draft stream before the sessions start
                deadline = time.monotonic() + 120
                while not all("speculating with draft worker" in w.logs() for w in workers[:args.workers]):
                    if time.monotonic() > deadline:
                        raise TimeoutError("no draft stream:\n" + "\n".join(w.logs()[-1500:] for w in workers))
                    await asyncio.sleep(0.2)
            for i in range(args.workers):  # warm every worker (first-step costs), then forget the caches' state
                await http.post("/v1/completions", json={"model": DEMO_NAME, "prompt": f"warm {i} " * 4, "max_tokens": 2})
            await asyncio.sleep(1.0)
            tag = uuid.uuid4().hex[:4]
            start = time.perf_counter()

            async def staggered(i: int, s: dict) -> dict:
                await asyncio.sleep(i * args.stagger)
                return await session(http, DEMO_NAME, s, tag, header, hinted, args)

            results = await asyncio.gather(*(staggered(i, s) for i, s in enumerate(sessions)))
            wall = time.perf_counter() - start
            await asyncio.sleep(1.0)  # the last turns' next-turn prefills end
            metrics = (await http.get("/metrics")).text
            on_workers: dict[str, int] = {}  # the workers' own outcomes of next-turn prefills
            draft_metrics = (await http.get(f"http://127.0.0.1:{draft_health}/metrics")).text if method != "none" else ""
            for port_ in health:
                text = (await http.get(f"http://127.0.0.1:{port_}/metrics")).text
                for k, v in re.findall(r'tandem_target_next_turn_prefills_total\{model="[^"]*",outcome="(\w+)"\} (\S+)', text):
                    on_workers[k] = on_workers.get(k, 0) + int(float(v))
        prefills = {k: int(float(v)) for k, v in
                    re.findall(r'tandem_frontend_next_turn_prefills_total\{outcome="(\w+)"\} (\S+)', metrics)}
        chose = chosen_workers(frontend.logs())
        later, landed, stayed = 0, 0, 0
        for r in results:
            for prev, t in zip(r["turns"], r["turns"][1:]):
                later += 1
                need = prev["usage"]["prompt_tokens"] // BLOCK * BLOCK
                landed += t["usage"]["prompt_tokens_details"]["cached_tokens"] >= need
                stayed += chose.get(t["rid"]) is not None and chose.get(t["rid"]) == chose.get(prev["rid"])
        turns = [t for r in results for t in r["turns"]]
        nexts = [t for r in results for t in r["turns"][1:]]
        return {"name": name, "results": results, "wall": wall, "turns": len(turns),
                "ttft_p50": percentile([t["ttft"] for t in turns], 0.5), "ttft_p90": percentile([t["ttft"] for t in turns], 0.9),
                "next_p50": percentile([t["ttft"] for t in nexts], 0.5), "next_p90": percentile([t["ttft"] for t in nexts], 0.9),
                "itl_p50": percentile([x for t in turns for x in t["itl"]], 0.5),
                "itl_p90": percentile([x for t in turns for x in t["itl"]], 0.9),
                "session_mean": statistics.fmean(r["time"] for r in results), "session_max": max(r["time"] for r in results),
                "landed": landed / later, "stayed": stayed / later, "later": later, "prefills": prefills,
                "on_workers": on_workers, "draft_metrics": draft_metrics,
                "prompt_tokens": sum(t["usage"]["prompt_tokens"] for t in turns),
                "cached_tokens": sum(t["usage"]["prompt_tokens_details"]["cached_tokens"] for t in turns)}
    finally:
        frontend.stop(timeout=10)
        for w in workers:
            w.stop(timeout=10)


def spec_counts(turns: list[dict]) -> dict:
    """Completion tokens, verify steps, accepted and drafted tokens and plain steps by reason of ``turns``."""
    out = {"tokens": 0, "drafts": 0, "draft_tokens": 0, "accepted": 0, "plain": {}, "turns": len(turns)}
    for t in turns:
        u = t["usage"]
        out["tokens"] += u["completion_tokens"]
        spec = u.get("spec_decode") or {}
        out["drafts"] += spec.get("num_drafts", 0)
        out["draft_tokens"] += spec.get("draft_tokens", 0)
        out["accepted"] += spec.get("accepted_tokens", 0)
        for why, n in spec.get("plain_steps", {}).items():
            out["plain"][why] = out["plain"].get(why, 0) + n
    # decode steps: the prefill emits each turn's first token; every later step a verify or a plain one
    plain = sum(out["plain"].values())
    out["steps"] = out["drafts"] + plain + out["turns"]
    if not out["drafts"] and not plain:  # no speculation at all (plain decoding): one token a step
        out["steps"] = out["tokens"]
    return out


async def speculation(args, sessions: list[dict], etcd, nats_server) -> None:
    kinds = sorted({s["kind"] for s in sessions}, key=[s["kind"] for s in sessions].index)
    print(f"{len(sessions)} sessions ({', '.join(kinds)}) x {len(sessions[0]['turns'])} turns, all in flight; "
          f"{args.workers} target workers (demo model, 1 thread each); {args.max_tokens} tokens a turn, greedy; "
          f"tool latency {args.tool_latency} s; γ {args.gamma}; speculative config {args.speculative_config}", flush=True)
    runs = []
    for method in args.draft_methods:
        r = await run(method, True, False, args, sessions, etcd, nats_server, method=method)
        runs.append(r)
        print(f"  {method}: wall {r['wall']:.1f} s", flush=True)
        if args.verbose:
            for s in r["results"]:
                print("   ", s["id"], f"{s['time']:.1f} s", [(t["usage"]["prompt_tokens"], t["usage"]["completion_tokens"],
                                                             (t["usage"].get("spec_decode") or {}).get("accepted_tokens"))
                                                            for t in s["turns"]])
            won = re.findall(r'tandem_draft_suffix_won_total\{[^}]*tree="(\w+)"[^}]*\} (\S+)', r["draft_metrics"])
            if won:
                print("    suffix proposals by tree:", dict(won))
    if args.save:
        Path(args.save).write_text(json.dumps({r["name"]: r["results"] for r in runs}, indent=1))
    base = runs[0]
    first = {s["id"]: [t["text"] for t in s["turns"]] for s in base["results"]}
    print("| kind | method | session time mean (s) | vs " + args.draft_methods[0] + " | completion tokens "
          "| tokens per target step | mean accepted length | acceptance rate | plain decode steps by reason "
          "| replies equal |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for kind in [*kinds, "all"]:
        base_time = statistics.fmean(s["time"] for s in base["results"] if kind in ("all", s["kind"]))
        for method, r in zip(args.draft_methods, runs):
            mine = [s for s in r["results"] if kind in ("all", s["kind"])]
            mean = statistics.fmean(s["time"] for s in mine)
            c = spec_counts([t for s in mine for t in s["turns"]])
            same = sum(a == b for s in mine for a, b in zip(first[s["id"]], (t["text"] for t in s["turns"])))
            mal = f"{1 + c['accepted'] / c['drafts']:.2f}" if c["drafts"] else "–"
            rate = f"{c['accepted'] / c['draft_tokens']:.0%}" if c["draft_tokens"] else "–"
            plain = ", ".join(f"{k} {v}" for k, v in sorted(c["plain"].items())) or "–"
            print(f"| {kind} | {method} | {mean:.1f} | {base_time / mean:.2f}× | {c['tokens']} | "
                  f"{c['tokens'] / c['steps']:.2f} | {mal} | {rate} | {plain} | {same} / {c['turns']} |", flush=True)


async def amain(args) -> None:
    sessions = load_sessions(Path(args.sessions))
    if args.kinds:
        sessions = [s for s in sessions if s["kind"] in args.kinds]
    etcd, nats_server = start_servers()
    try:
        if args.draft_methods:
            await speculation(args, sessions, etcd, nats_server)
            return
        print(f"{len(sessions)} sessions x {len(sessions[0]['turns'])} turns, all in flight; {args.workers} target workers "
              f"(demo model, 1 thread each); {args.max_tokens} tokens a turn, greedy; tool latency {args.tool_latency} s",
              flush=True)
        print("| run | TTFT p50 / p90 (ms) | next-turn TTFT p50 / p90 (ms) | ITL p50 / p90 (ms) | session mean / max (s) "
              "| later turns on their cached prefix | on the previous turn's worker | cached / prompt tokens "
              "| next-turn prefills started / prefilled / dropped | replies equal to the first run |")
        print("|---|---|---|---|---|---|---|---|---|---|")
        first = None
        for name, header, hinted in RUNS:
            if args.only and name not in args.only:
                continue
            r = await run(name, header, hinted, args, sessions, etcd, nats_server)
            replies = [t["text"] for s in r["results"] for t in s["turns"]]
            first = first or replies
            same = sum(a == b for a, b in zip(first, replies))
            p = r["prefills"]
            print(f"| {name} | {r['ttft_p50'] * 1000:.0f} / {r['ttft_p90'] * 1000:.0f} | {r['next_p50'] * 1000:.0f} / "
                  f"{r['next_p90'] * 1000:.0f} | {r['itl_p50'] * 1000:.0f} / {r['itl_p90'] * 1000:.0f} | "
                  f"{r['session_mean']:.1f} / {r['session_max']:.1f} | {r['landed']:.0%} of {r['later']} | "
                  f"{r['stayed']:.0%} | {r['cached_tokens']} / {r['prompt_tokens']} | "
                  f"{p.get('started', 0)} / {p.get('prefilled', 0)} / {p.get('dropped', 0)} | "
                  f"{same} / {len(replies)} |", flush=True)
            if hinted:
                print(f"    next-turn prefill outcomes on the workers: {r['on_workers']}", flush=True)
            if args.verbose:
                for s in r["results"]:
                    print("   ", s["id"], [(round(t["ttft"] * 1000), t["usage"]["prompt_tokens"],
                                             t["usage"]["prompt_tokens_details"]["cached_tokens"]) for t in s["turns"]])
    finally:
        etcd.cleanup()
        nats_server.cleanup()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", default=str(ROOT / "bench" / "prompts" / "agent_sessions.jsonl"))
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--tool-latency", type=float, default=0.5, help="seconds an agent's tool takes between turns")
    parser.add_argument("--stagger", type=float, default=0.3, help="seconds between the sessions' starts")
    parser.add_argument("--only", nargs="*", default=None, help="run only these runs (by name)")
    parser.add_argument("--verbose", action="store_true", help="per turn: TTFT, prompt and cached tokens")
    parser.add_argument("--draft-methods", nargs="*", default=None, metavar="METHOD",
                        help="speculation mode: one run per draft method (none: plain decoding), e.g. none suffix")
    parser.add_argument("--gamma", type=int, default=8, help="speculation mode: the targets' γ")
    parser.add_argument("--speculative-config", default="{}", help="speculation mode: JSON for targets and drafts")
    parser.add_argument("--save", default=None, help="speculation mode: every run's sessions and replies as JSON here")
    parser.add_argument("--kinds", nargs="*", default=None, help="only the sessions of these kinds")
    asyncio.run(amain(parser.parse_args()))


if __name__ == "__main__":
    main()
