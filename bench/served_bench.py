"""What a new user of ``make run`` sees: the default demo stack (``tandem up``: SmolLM2 target + the
bundled EAGLE-3 draft, separate processes) against the same stack with ``--draft-method none``, on
hand-written natural chat prompts, greedy, batch 1, through the OpenAI HTTP API.

Usage: .venv/bin/python bench/served_bench.py [--prompts N] [--rounds 2] [--max-tokens 96]
       [--prompts-file bench/prompts/natural_chat.jsonl] [--spec-args "--num-speculative-tokens 4"]
       [--tiny-target [--tiny-eagle3]] [--spec-seam sync|pipelined] [--json results.json]

``--tiny-target`` serves, in both stacks, a random 2-layer Llama (hidden 64, the demo tokenizer, built
in code with a fixed seed and saved under the cache) instead of the demo model, on repetitive prompts
(``bench/prompts/repetitive.jsonl``) unless ``--prompts-file`` says otherwise: a target fast enough
that the draft seam, not the verify pass, decides what speculation costs (with e.g. ``--spec-args
"--draft-method ngram --no-load-aware-speculation"``). ``--tiny-eagle3`` gives the speculative stack
an EAGLE-3 head with random weights built to match that target (``--draft-method eagle3
--draft-model DIR``, the default draft method, saved under the cache; the target offers it layers 0, 1
and 2 through ``TANDEM_SPECULATIVE_CONFIG``'s hidden_layers): its drafts are nearly never
accepted, so with the default (load-aware) policy the speculative stack should cost what the plain one
does. ``--spec-seam`` sets the speculative stack's
target seam (``TANDEM_SPECULATIVE_CONFIG``'s seam), ``--draft-lane`` whether its draft stream's messages
take the fast lane (its draft_lane). The speculative stack's target is scraped (``/metrics``) after the
warm-up and at the end: the share of its busy time spent waiting on drafts over the measured rounds
(``tandem_target_draft_wait_seconds_total`` / ``tandem_target_busy_seconds_total``) is reported, and
on the pipelined seam how many sequence steps with streamed proposals found one that fits and how
many proposals came late (what the target backs a draft off on: ``workers/target/draft_watch.py``).

Both stacks are started at once by ``tandem up`` (each with its own etcd and NATS, on free loopback
ports); the speculative one gets ``--spec-args`` appended (e.g. ``--draft-model DIR`` to serve another
EAGLE-3 head). After one warm-up request per stack, every round sends each prompt (each line of the
prompts file is ``{"messages": [...]}``) to ``/v1/chat/completions`` with ``temperature: 0`` and
``max_tokens``, not streamed, one request at a time: to the plain stack and to the speculative stack
in turn, the order alternating every prompt (and flipping between rounds), so a slow spell of this
shared machine hits both alike. A request is timed wall-clock from send to the full response
(prefill included: what a client sees).

Reported per round and overall: completion tokens / total request time of each stack and their
ratio (spec / plain), the live mean acceptance length 1 + accepted / drafts summed over requests
(vLLM's definition, :func:`runtime.spec_stats.mean_accepted_length`), acceptance per draft position
(accepted_per_pos / drafts), the plain-step reasons (decode steps that ran without a draft, from
``usage.spec_decode.plain_steps``) summed, and how many speculative outputs equal the plain output
for the same prompt (greedy speculation is meant to be lossless). ``--json`` adds per-prompt rows.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import httpx  # noqa: E402

from runtime.spec_stats import acceptance_rate, mean_accepted_length  # noqa: E402
from tests.support.procs import ManagedProcess, descendants, proc_table  # noqa: E402

HOST = "127.0.0.1"
STACKS = ("plain", "spec")
WARMUP = [{"role": "user", "content": "Hello! Who are you?"}]


DEFAULT_PROMPTS = str(ROOT / "bench" / "prompts" / "natural_chat.jsonl")


def tiny_target() -> Path:
    """A random 2-layer Llama (hidden 64, seed 0, weights drawn with std 0.05: its greedy text often falls
    into short loops, which an n-gram draft can follow) with the demo tokenizer, saved once under the cache."""
    from runtime.config import cache_dir
    from workers.demo_model import demo_model_dir

    path = cache_dir() / "tiny-llama-h64-l2-init05"
    if (path / "model.safetensors").exists():
        return path
    import shutil

    import torch
    import transformers as tf

    demo = demo_model_dir()
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=2048,
                         tie_word_embeddings=False, initializer_range=0.05)  # greedy text falls into short loops
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(tmp)
    for item in demo.iterdir():
        if item.is_file() and not item.name.startswith(".") and item.name not in ("config.json", "model.safetensors"):
            shutil.copy(item, tmp / item.name)
    tmp.rename(path)
    return path


def tiny_eagle3_head(target: Path) -> Path:
    """A random EAGLE-3 head (seed 0, weights drawn with std 0.1) for :func:`tiny_target`: hidden 64, one
    layer, the target's aux layers 0, 1 and 2, a draft vocabulary of the first 4,096 target ids; saved once
    under the cache. Its drafts are guesses the target nearly never accepts."""
    from runtime.config import cache_dir

    path = cache_dir() / "tiny-llama-h64-l2-init05-eagle3-random"
    if (path / "model.safetensors").exists():
        return path
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((target / "config.json").read_text())
    hidden, inter, heads, kv_heads = (cfg["hidden_size"], cfg["intermediate_size"], cfg["num_attention_heads"],
                                      cfg["num_key_value_heads"])
    head_dim, draft_vocab = hidden // heads, 4096
    gen = torch.Generator().manual_seed(0)

    def w(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * 0.1

    p = "midlayer."
    state = {"fc.weight": w(hidden, 3 * hidden), "norm.weight": torch.ones(hidden),
             "lm_head.weight": w(draft_vocab, hidden), "d2t": torch.zeros(draft_vocab, dtype=torch.long),
             p + "self_attn.q_proj.weight": w(heads * head_dim, 2 * hidden),
             p + "self_attn.k_proj.weight": w(kv_heads * head_dim, 2 * hidden),
             p + "self_attn.v_proj.weight": w(kv_heads * head_dim, 2 * hidden),
             p + "self_attn.o_proj.weight": w(hidden, heads * head_dim),
             p + "mlp.gate_proj.weight": w(inter, hidden), p + "mlp.up_proj.weight": w(inter, hidden),
             p + "mlp.down_proj.weight": w(hidden, inter), p + "input_layernorm.weight": torch.ones(hidden),
             p + "hidden_norm.weight": torch.ones(hidden), p + "post_attention_layernorm.weight": torch.ones(hidden)}
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True)
    save_file(state, str(tmp / "model.safetensors"))
    (tmp / "config.json").write_text(json.dumps({
        "model_type": "llama", "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": hidden,
        "intermediate_size": inter, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
        "num_hidden_layers": 1, "vocab_size": cfg["vocab_size"], "rms_norm_eps": 1e-6,
        "max_position_embeddings": cfg["max_position_embeddings"], "draft_vocab_size": draft_vocab,
        "target_hidden_size": hidden, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}}))
    tmp.rename(path)
    return path


# --- processes ---------------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


class Stack:
    """One ``tandem up`` on free loopback ports, and every process it starts."""

    def __init__(self, name: str, extra: list[str], startup_timeout: float, env: dict[str, str] | None = None):
        self.name = name
        self.port = free_port()
        args = ["up", "--http-port", str(self.port), "--host", HOST, "--etcd-port", str(free_port()),
                "--nats-port", str(free_port()), "--startup-timeout", f"{startup_timeout:g}", *extra]
        self.argv = [sys.executable, "-m", "deploy.cli", *args]
        self.proc = ManagedProcess("deploy.cli", args, {**os.environ, **(env or {})}, name=f"served-bench-{name}")
        self.url = f"http://{HOST}:{self.port}"
        self.model: str | None = None
        self._known: dict[int, str] = {}  # the launcher's descendants seen so far (pid -> start time)

    def start(self) -> Stack:
        self.proc.start()
        return self

    def remember_children(self) -> None:
        if self.proc.alive():
            self._known.update(descendants(self.proc.pid))

    def poll_ready(self, client: httpx.Client) -> bool:
        """True once /health lists a model (the first one listed becomes ``self.model``)."""
        self.remember_children()
        if not self.proc.alive():
            raise RuntimeError(f"{self.name} stack (tandem up) exited with {self.proc.proc.returncode}; "
                               f"log {self.proc.log_path}:\n{self.proc.logs()[-4000:]}")
        try:
            r = client.get(f"{self.url}/health", timeout=2)
            models = r.json().get("models", []) if r.status_code == 200 else []
        except (httpx.TransportError, ValueError):
            return False
        if models:
            self.model = models[0]
            return True
        return False

    def draft_metrics(self) -> dict[str, float]:
        """The draft worker's propose calls: how many and their seconds in all, from its /metrics."""
        found = re.search(r"draft\S*\s+pid\s+\d+\s+health (http://\S+)/health", self.proc.logs())
        if found is None:
            return {}
        try:
            text = httpx.get(f"{found.group(1)}/metrics", timeout=5).text
        except httpx.HTTPError:
            return {}
        out = {}
        for name in ("count", "sum"):
            m = re.search(rf"^tandem_draft_proposal_seconds_{name}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            if m:
                out[name] = float(m.group(1))
        m = re.search(r"^process_cpu_seconds_total (\S+)$", text, re.M)
        if m:
            out["cpu_seconds"] = float(m.group(1))
        return out

    def target_metrics(self) -> dict[str, float]:
        """The target worker's step-loop counters (busy and draft-wait seconds) from its /metrics."""
        found = re.search(r"target\S*\s+pid\s+\d+\s+health (http://\S+)/health", self.proc.logs())
        if found is None:
            return {}
        text = httpx.get(f"{found.group(1)}/metrics", timeout=5).text
        out = {}
        for name in ("busy_seconds", "draft_wait_seconds", "draft_flush_seconds", "engine_steps",
                     "draft_proposals_streamed", "draft_proposals_late", "draft_staged_lookups", "draft_staged_fits"):
            m = re.search(rf"^tandem_target_{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M)
            if m:
                out[name] = float(m.group(1))
        m = re.search(r"^process_cpu_seconds_total (\S+)$", text, re.M)  # (all its threads: a measure of work)
        if m:
            out["cpu_seconds"] = float(m.group(1))
        for name in ("fixed", "per_token", "per_verify", "speculating"):  # the target's fitted step-cost model
            m = re.search(rf"^tandem_target_step_cost_{name}_seconds(?:{{[^}}]*}})? (\S+)$", text, re.M)
            if m:
                out[f"cost_{name}"] = float(m.group(1))
        return out

    def terminate(self) -> None:
        """SIGTERM the launcher (it stops its children tier by tier)."""
        self.remember_children()
        self.proc.signal(signal.SIGTERM)

    def finish(self, timeout: float) -> None:
        """Wait for the launcher; then SIGKILL it and anything it started that is still alive."""
        if self.proc.proc is not None:
            try:
                self.proc.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                print(f"[{self.name}] tandem up still running {timeout:.0f}s after SIGTERM: SIGKILL", file=sys.stderr)
                self.proc.kill()
        table = proc_table()
        for pid, started in self._known.items():  # each child runs in its own process group
            if pid in table and table[pid][1] == started:
                for kill in (lambda: os.killpg(pid, signal.SIGKILL), lambda: os.kill(pid, signal.SIGKILL)):
                    try:
                        kill()
                    except (ProcessLookupError, PermissionError):
                        pass


def start_stacks(stacks: list[Stack], timeout: float) -> None:
    for s in stacks:
        s.start()
        print(f"[{s.name}] {shlex.join(s.argv)}\n[{s.name}] log: {s.proc.log_path}", flush=True)
    deadline = time.monotonic() + timeout
    pending = list(stacks)
    with httpx.Client() as client:
        while pending:
            pending = [s for s in pending if not s.poll_ready(client)]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{', '.join(s.name for s in pending)} not ready within {timeout:.0f}s")
            time.sleep(0.5)
    for s in stacks:
        s.remember_children()
        print(f"[{s.name}] ready at {s.url} serving {s.model!r}", flush=True)


def stop_stacks(stacks: list[Stack], timeout: float = 120.0) -> None:
    for s in stacks:
        s.terminate()
    for s in stacks:
        s.finish(timeout)


# --- requests ----------------------------------------------------------------------------------------


def chat(client: httpx.Client, stack: Stack, messages: list[dict], max_tokens: int, timeout: float) -> dict:
    body = {"model": stack.model, "messages": messages, "temperature": 0, "max_tokens": max_tokens, "stream": False}
    started = time.perf_counter()
    r = client.post(f"{stack.url}/v1/chat/completions", json=body, timeout=timeout)
    seconds = time.perf_counter() - started
    if r.status_code != 200:
        raise RuntimeError(f"{stack.name}: HTTP {r.status_code}: {r.text[:500]}")
    out = r.json()
    usage = out.get("usage") or {}
    return {"seconds": seconds, "text": out["choices"][0]["message"].get("content") or "",
            "finish_reason": out["choices"][0].get("finish_reason"),
            "completion_tokens": usage.get("completion_tokens", 0), "prompt_tokens": usage.get("prompt_tokens", 0),
            "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0),
            "spec_decode": usage.get("spec_decode")}


def load_prompts(path: Path, limit: int | None) -> list[list[dict]]:
    prompts = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if not isinstance(row.get("messages"), list) or not row["messages"]:
            raise ValueError(f"{path}:{n}: expected {{\"messages\": [...]}}")
        prompts.append(row["messages"])
    return prompts[:limit] if limit else prompts


# --- summaries ---------------------------------------------------------------------------------------


def spec_sums(rows: list[dict]) -> dict:
    """usage.spec_decode summed over requests (requests without it counted apart)."""
    drafts = draft_tokens = accepted = missing = 0
    per_pos: list[int] = []
    plain: dict[str, int] = {}
    for row in rows:
        s = row["spec_decode"]
        if s is None:
            missing += 1
            continue
        drafts += s.get("num_drafts", 0)
        draft_tokens += s.get("draft_tokens", 0)
        accepted += s.get("accepted_tokens", 0)
        pos = s.get("accepted_per_pos", [])
        per_pos += [0] * (len(pos) - len(per_pos))
        for i, n in enumerate(pos):
            per_pos[i] += n
        for why, n in (s.get("plain_steps") or {}).items():
            plain[why] = plain.get(why, 0) + n
    return {"num_drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
            "accepted_per_pos": per_pos, "plain_steps": plain, "requests_without_spec_decode": missing,
            "acceptance_rate": acceptance_rate(accepted, draft_tokens),
            "mean_accepted_length": mean_accepted_length(accepted, drafts),
            "acceptance_per_pos": [n / drafts for n in per_pos] if drafts else []}


def summarise(pairs: list[dict]) -> dict:
    out: dict = {"requests": len(pairs)}
    for name in STACKS:
        rows = [p[name] for p in pairs]
        tokens = sum(r["completion_tokens"] for r in rows)
        seconds = sum(r["seconds"] for r in rows)
        out[name] = {"completion_tokens": tokens, "seconds": seconds,
                     "tokens_per_s": tokens / seconds if seconds else None, "spec_decode": spec_sums(rows)}
    plain_tps, spec_tps = out["plain"]["tokens_per_s"], out["spec"]["tokens_per_s"]
    out["speedup"] = spec_tps / plain_tps if plain_tps and spec_tps else None
    out["outputs_equal"] = sum(p["equal"] for p in pairs)
    return out


def fmt(x: float | None, spec: str = ".2f") -> str:
    return "–" if x is None else format(x, spec)


def table(summaries: list[tuple[str, dict]]) -> str:
    lines = ["| round | plain tok/s | spec tok/s | speedup | drafts | mean acceptance length | acceptance per position "
             "| plain-step reasons | spec output = plain |",
             "|---|---|---|---|---|---|---|---|---|"]
    for label, s in summaries:
        sd = s["spec"]["spec_decode"]
        per_pos = " / ".join(f"{a:.2f}" for a in sd["acceptance_per_pos"]) or "–"
        reasons = ", ".join(f"{k} {v}" for k, v in sorted(sd["plain_steps"].items())) or "none"
        lines.append(f"| {label} | {fmt(s['plain']['tokens_per_s'], '.1f')} | {fmt(s['spec']['tokens_per_s'], '.1f')} "
                     f"| {fmt(s['speedup'])}x | {sd['num_drafts']} | {fmt(sd['mean_accepted_length'])} | {per_pos} "
                     f"| {reasons} | {s['outputs_equal']}/{s['requests']} |")
    return "\n".join(lines)


# --- main --------------------------------------------------------------------------------------------


def run(args: argparse.Namespace) -> dict:
    prompts = load_prompts(Path(args.prompts_file), args.prompts)
    if not prompts:
        raise SystemExit(f"no prompts in {args.prompts_file}")
    # Convert the demo model once up front, so the two launchers do not race to write the cache.
    subprocess.run([sys.executable, "-m", "workers.demo_model"], cwd=ROOT, check=True, capture_output=True)
    spec_extra = shlex.split(args.spec_args)
    model = ["--model", str(tiny_target())] if args.tiny_target else []
    if args.tiny_eagle3:
        spec_extra = ["--draft-method", "eagle3", "--draft-model", str(tiny_eagle3_head(tiny_target())), *spec_extra]
    keys = {"seam": args.spec_seam} if args.spec_seam else {}
    if args.draft_lane:
        keys["draft_lane"] = args.draft_lane
    if args.tiny_eagle3:  # a 2-layer target offers only its last layer by default; the head reads three
        keys["hidden_layers"] = "0,1,2"
    # beneath the launcher's own --speculative-config, key by key
    seam = {"TANDEM_SPECULATIVE_CONFIG": json.dumps(keys)} if keys else {}
    stacks = {"plain": Stack("plain", model + ["--draft-method", "none"], args.startup_timeout),
              "spec": Stack("spec", model + spec_extra, args.startup_timeout, seam)}
    waits: dict[str, dict] = {}
    warmup: dict[str, dict] = {}
    pairs: list[dict] = []
    try:
        start_stacks(list(stacks.values()), args.startup_timeout + 60)
        with httpx.Client() as client:
            for name, stack in stacks.items():  # warm-up: first forward passes, the draft stream opens
                warmup[name] = chat(client, stack, WARMUP, args.max_tokens, args.request_timeout)
                print(f"[{name}] warm-up: {warmup[name]['completion_tokens']} tokens in "
                      f"{warmup[name]['seconds']:.2f}s, spec_decode {warmup[name]['spec_decode']}", flush=True)
            waits["before"] = stacks["spec"].target_metrics()
            waits["plain_before"] = stacks["plain"].target_metrics()
            waits["draft_before"] = stacks["spec"].draft_metrics()
            print(f"\n{len(prompts)} prompts x {args.rounds} rounds, max_tokens {args.max_tokens}, greedy, batch 1; "
                  f"spec stack: tandem up {shlex.join(spec_extra) or '(defaults)'}\n", flush=True)
            for rnd in range(args.rounds):
                for i, messages in enumerate(prompts):
                    order = STACKS if (i + rnd) % 2 == 0 else STACKS[::-1]
                    pair = {"round": rnd + 1, "prompt": i, "first": order[0]}
                    for name in order:
                        pair[name] = chat(client, stacks[name], messages, args.max_tokens, args.request_timeout)
                    pair["equal"] = pair["spec"]["text"] == pair["plain"]["text"]
                    pairs.append(pair)
                    sd = pair["spec"]["spec_decode"] or {}
                    print(f"  round {rnd + 1} prompt {i + 1}/{len(prompts)}: plain "
                          f"{pair['plain']['completion_tokens']} tok {pair['plain']['seconds']:.2f}s, spec "
                          f"{pair['spec']['completion_tokens']} tok {pair['spec']['seconds']:.2f}s, "
                          f"{sd.get('num_drafts', 0)} drafts, mean acc len {fmt(sd.get('mean_accepted_length'))}, "
                          f"plain steps {sd.get('plain_steps', {})}"
                          f"{'' if pair['equal'] else ', OUTPUT DIFFERS'}", flush=True)
            waits["after"] = stacks["spec"].target_metrics()
            waits["plain_after"] = stacks["plain"].target_metrics()
            waits["draft_after"] = stacks["spec"].draft_metrics()
    finally:
        # a second Ctrl-C (or a SIGTERM) must not cut the stop short and orphan the stacks
        old = {sig: signal.signal(sig, signal.SIG_IGN) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            stop_stacks(list(stacks.values()))
        finally:
            for sig, handler in old.items():
                signal.signal(sig, handler)
    summaries = [(f"{r}", summarise([p for p in pairs if p["round"] == r])) for r in range(1, args.rounds + 1)]
    summaries.append(("all", summarise(pairs)))
    print(table(summaries))
    share = None
    before, after = waits.get("before", {}), waits.get("after", {})
    if "busy_seconds" in before and "busy_seconds" in after:
        busy = after["busy_seconds"] - before["busy_seconds"]
        wait = after.get("draft_wait_seconds", 0.0) - before.get("draft_wait_seconds", 0.0)
        share = wait / busy if busy > 0 else None
        print(f"\nspec stack's target over the measured rounds: busy {busy:.2f} s, waiting on drafts {wait:.3f} s "
              f"({fmt(None if share is None else 100 * share, '.1f')} % of busy time)")
    staged = {k: after.get(f"draft_{k}", 0.0) - before.get(f"draft_{k}", 0.0)
              for k in ("proposals_streamed", "proposals_late", "staged_lookups", "staged_fits")}
    if staged["staged_lookups"] > 0:  # pipelined: the draft's use and pace, as the target judges them
        print(f"pipelined seam: {staged['staged_fits']:.0f} of {staged['staged_lookups']:.0f} sequence steps with "
              f"streamed proposals found one that fits; {staged['proposals_late']:.0f} of "
              f"{staged['proposals_streamed']:.0f} proposals came late")
    step_ms = {}
    for name, (b0, b1) in {"plain": (waits.get("plain_before", {}), waits.get("plain_after", {})),
                           "spec": (before, after)}.items():
        steps = b1.get("engine_steps", 0.0) - b0.get("engine_steps", 0.0)
        if steps > 0 and "busy_seconds" in b1:
            step_ms[name] = 1e3 * (b1["busy_seconds"] - b0["busy_seconds"]) / steps
    d0, d1 = waits.get("draft_before", {}), waits.get("draft_after", {})
    calls = d1.get("count", 0.0) - d0.get("count", 0.0)
    if calls > 0:  # how long the draft worker takes per call (a late one is of no use to the target)
        print(f"draft worker: {calls:.0f} drafting calls, {1e3 * (d1['sum'] - d0['sum']) / calls:.2f} ms each on average")
    # CPU time per engine step (all of a process's threads), less noisy than the busy time on a shared
    # machine: the spec stack's target and its draft worker against the plain stack's target
    cpu_ms = {}
    spec_steps = after.get("engine_steps", 0.0) - before.get("engine_steps", 0.0)
    for name, (b0, b1, steps) in {
            "plain target": (waits.get("plain_before", {}), waits.get("plain_after", {}),
                             waits.get("plain_after", {}).get("engine_steps", 0.0)
                             - waits.get("plain_before", {}).get("engine_steps", 0.0)),
            "spec target": (before, after, spec_steps),
            "draft": (waits.get("draft_before", {}), waits.get("draft_after", {}), spec_steps)}.items():
        if steps > 0 and "cpu_seconds" in b0 and "cpu_seconds" in b1:
            cpu_ms[name] = 1e3 * (b1["cpu_seconds"] - b0["cpu_seconds"]) / steps
    if cpu_ms:
        print("CPU ms per engine step (of the stack's own target): "
              + ", ".join(f"{k} {v:.2f}" for k, v in cpu_ms.items()))
    flush_ms = None
    if "spec" in step_ms and "draft_flush_seconds" in after:  # of the spec step: handing news to the draft
        steps = after["engine_steps"] - before.get("engine_steps", 0.0)
        flush_ms = 1e3 * (after["draft_flush_seconds"] - before.get("draft_flush_seconds", 0.0)) / steps
    if step_ms:  # where a speculative step's time goes: its loop's busy time per step, the fitted cost model
        cost = {k[5:]: 1e3 * v for k, v in after.items() if k.startswith("cost_")}
        print("target busy ms per engine step: " + ", ".join(f"{k} {v:.2f}" for k, v in step_ms.items())
              + (f" (of which {flush_ms:.3f} handing the news to the draft stream)" if flush_ms is not None else "")
              + ("; spec target's fitted step cost (ms): " + ", ".join(f"{k} {v:.3f}" for k, v in cost.items())
                 if cost else ""))
    return {"config": {"prompts_file": args.prompts_file, "prompts": len(prompts), "rounds": args.rounds,
                       "max_tokens": args.max_tokens, "spec_args": spec_extra, "model": stacks["spec"].model,
                       "plain_model": stacks["plain"].model, "tiny_target": args.tiny_target,
                       "spec_seam": args.spec_seam, "tiny_eagle3": args.tiny_eagle3},
            "draft_wait_share": share, "staged": staged, "target_step_ms": step_ms, "target_flush_ms": flush_ms, "cpu_ms_per_step": cpu_ms,
            "rounds": {label: s for label, s in summaries if label != "all"}, "overall": summaries[-1][1],
            "warmup": warmup, "per_prompt": pairs}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts-file", default=DEFAULT_PROMPTS,
                    help='JSON lines, each {"messages": [...]}')
    ap.add_argument("--prompts", type=int, default=None, help="use the first N prompts (default: all)")
    ap.add_argument("--rounds", type=int, default=2, help="passes over the prompts (default 2)")
    ap.add_argument("--max-tokens", type=int, default=96, help="max_tokens per request (default 96)")
    ap.add_argument("--spec-args", default="",
                    help='extra flags for the speculative stack\'s tandem up, e.g. "--draft-model DIR"')
    ap.add_argument("--startup-timeout", type=float, default=900.0, help="seconds for both stacks to serve")
    ap.add_argument("--request-timeout", type=float, default=120.0, help="seconds per request")
    ap.add_argument("--json", default=None, help="write the results (with per-prompt rows) here")
    ap.add_argument("--tiny-target", action="store_true",
                    help="serve a random 2-layer Llama (hidden 64, the demo tokenizer) built in code, on repetitive "
                         "prompts unless --prompts-file is given")
    ap.add_argument("--tiny-eagle3", action="store_true",
                    help="with --tiny-target: the speculative stack drafts with a random-weight EAGLE-3 head built "
                         "for that target (drafts nearly never accepted)")
    ap.add_argument("--spec-seam", choices=["sync", "pipelined"], default=None,
                    help="the speculative stack's target seam (--speculative-config's seam; default: the target's default)")
    ap.add_argument("--draft-lane", choices=["auto", "off"], default=None,
                    help="the speculative stack's target: its draft stream's messages on a Unix socket (auto) or on "
                         "gRPC (off) (--speculative-config's draft_lane; default: the target's default, auto)")
    args = ap.parse_args()
    if args.tiny_target and args.prompts_file == DEFAULT_PROMPTS:
        args.prompts_file = str(ROOT / "bench" / "prompts" / "repetitive.jsonl")
    if args.tiny_eagle3 and not args.tiny_target:
        ap.error("--tiny-eagle3 needs --tiny-target")
    if args.rounds < 1 or (args.prompts is not None and args.prompts < 1) or args.max_tokens < 1:
        ap.error("--rounds, --prompts and --max-tokens must be >= 1")

    def on_sigterm(*_: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, on_sigterm)  # stop the stacks as on Ctrl-C
    try:
        result = run(args)
    except KeyboardInterrupt:
        sys.exit("interrupted; stacks stopped")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
        print(f"\nJSON: {args.json}")


if __name__ == "__main__":
    main()
