"""Mock engine worker: serves ``target.generate`` like a real worker, with no model.

Usage: python -m workers.mock --served-model-name mock --token-latency-ms 5
       (etcd / NATS / namespace from --etcd/--nats/--namespace or TANDEM_ETCD/TANDEM_NATS/TANDEM_NAMESPACE)

It registers an instance and a model card (pointing at a real tokenizer), streams token deltas
with configurable prompt-processing and per-token latency, keeps a toy prefix cache that publishes
real KV ``stored``/``removed`` events and reports cached prompt tokens, publishes load, and
simulates speculative decoding with a configurable acceptance rate (publishing the counters).
With ``--max-num-seqs`` it runs at most that many requests at once and queues the rest, first come
first served, or by each request's ``priority`` (lower first, then arrival) with
``--scheduling-policy priority``, as a real worker admits them (the mock preempts nothing).

Output tokens echo the prompt's non-special tokens (cycled), so detokenized output is readable;
with temperature > 0 they are drawn from the prompt's tokens with the request's seed.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import itertools
import json
import logging
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path

import msgspec

from runtime import Runtime
from runtime.config import EnvParser, add_runtime_args, apply_env_defaults, config_from_args
from runtime.events import TOPIC_KV, TOPIC_KV_DUMP, TOPIC_LOAD, TOPIC_SPEC_STATS
from runtime.flags import SERVED_MODEL_NAME
from runtime.kv_hash import ROOT_HASH, block_hashes, stored_events
from runtime.messages import (
    GenerateRequest,
    KvDumpRequest,
    KvEvent,
    KvEventKind,
    LoadEvent,
    ModelCard,
    SpecUsage,
    TokenDelta,
    TopLogprob,
    Usage,
    is_greedy,
)
from runtime.service import check_log_level, exit_on_bad_config, run_service
from runtime.spec_stats import SpecCounters
from runtime.validation import validate_request

log = logging.getLogger(__name__)

Publish = Callable[[str, object], Awaitable[None]]


class ToyPrefixCache:
    """A block-hash LRU cache that emits the KV events a real paged cache would.

    Blocks are kept in an OrderedDict (oldest first). A chain is touched leaf-first, so parents are
    always more recent than their children and eviction never orphans a cached child.
    """

    def __init__(self, worker_id: str, num_blocks: int, block_size: int):
        self.worker_id = worker_id
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, int] = OrderedDict()  # hash -> parent hash
        self._pinned: dict[int, int] = {}  # hash -> number of running requests using it
        self._event_id = 0
        self.events: list[KvEvent] = []  # pending, drained by the worker

    def __len__(self) -> int:
        return len(self._blocks)

    def _event(self, kind: str, hashes: list[int], parent: int | None = None) -> None:
        self._event_id += 1
        self.events.append(KvEvent(self.worker_id, self._event_id, kind, hashes, parent, self.block_size))

    def match(self, hashes: list[int]) -> int:
        """How many leading blocks of ``hashes`` are cached."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def acquire(self, hashes: list[int]) -> int:
        """Cache every block of the chain (pinning it); returns how many were already cached."""
        cached = self.match(hashes)
        new = hashes[cached:]
        for h in hashes:  # pin first, so making room never evicts the matched prefix
            self._pinned[h] = self._pinned.get(h, 0) + 1
        self._make_room(len(new))
        for i in range(cached, len(hashes)):
            self._blocks[hashes[i]] = hashes[i - 1] if i else ROOT_HASH
        for h in reversed(hashes):
            self._blocks.move_to_end(h)
        if new:
            self._event(KvEventKind.STORED, new, hashes[cached - 1] if cached else None)
        return cached

    def release(self, hashes: list[int]) -> None:
        for h in hashes:
            left = self._pinned.get(h, 0) - 1
            if left <= 0:
                self._pinned.pop(h, None)
            else:
                self._pinned[h] = left

    def _make_room(self, needed: int) -> None:
        over = len(self._blocks) + needed - self.num_blocks
        if over <= 0:
            return
        removed = []
        for h in list(self._blocks):
            if len(removed) >= over:
                break
            if h not in self._pinned:
                del self._blocks[h]
                removed.append(h)
        if removed:
            self._event(KvEventKind.REMOVED, removed)

    def clear(self) -> None:
        self._blocks.clear()
        self._event(KvEventKind.CLEARED, [])

    def dump(self) -> list[KvEvent]:
        """The whole cache as ``stored`` events, one block each (parents before children)."""
        out = stored_events(self.worker_id, self.block_size, self._blocks, self._event_id + 1)
        self._event_id += len(out)
        return out


def special_token_ids(tokenizer_dir: Path) -> tuple[set[int], list[int]]:
    """(ids of special tokens, eos ids) read from tokenizer.json / tokenizer_config.json."""
    special, eos = set(), []
    tok_json = tokenizer_dir / "tokenizer.json"
    by_content = {}
    if tok_json.exists():
        for added in json.loads(tok_json.read_text()).get("added_tokens", []):
            by_content[added["content"]] = added["id"]
            if added.get("special"):
                special.add(added["id"])
    cfg = tokenizer_dir / "tokenizer_config.json"
    if cfg.exists():
        eos_token = json.loads(cfg.read_text()).get("eos_token")
        if isinstance(eos_token, dict):
            eos_token = eos_token.get("content")
        if eos_token in by_content:
            eos.append(by_content[eos_token])
    return special, eos


class MockWorker:
    """The ``generate`` handler and its background publishers; plain values in."""

    def __init__(
        self,
        worker_id: str,
        publish: Publish,
        *,
        token_latency: float = 0.0,
        latency_per_running: float = 0.0,
        prefill_latency_per_token: float = 0.0,
        block_size: int = 16,
        num_blocks: int = 4096,
        context_length: int = 2048,
        acceptance_rate: float = 0.0,
        num_speculative_tokens: int = 0,
        draft_id: str = "mock-draft",
        special_ids: set[int] = frozenset(),
        eos_ids: list[int] = (),
        stats_interval: float = 0.5,
        epoch: float | None = None,
        max_num_seqs: int = 0,
        scheduling_policy: str = "fcfs",
    ):
        if not 0.0 <= acceptance_rate <= 1.0:
            raise ValueError(f"acceptance_rate must be in [0, 1], got {acceptance_rate}")
        if token_latency < 0 or latency_per_running < 0:
            raise ValueError("token latencies must be >= 0")
        if max_num_seqs < 0 or scheduling_policy not in ("fcfs", "priority"):
            raise ValueError("max_num_seqs must be >= 0 and scheduling_policy fcfs or priority")
        self.worker_id = worker_id
        self._publish = publish
        self.token_latency = token_latency
        self.latency_per_running = latency_per_running  # a batched engine's step grows with its batch
        self.prefill_latency_per_token = prefill_latency_per_token
        self.context_length = context_length
        self.acceptance_rate = acceptance_rate
        self.num_speculative_tokens = num_speculative_tokens
        self.draft_id = draft_id
        self.special_ids = set(special_ids)
        self.eos_ids = list(eos_ids)
        self.cache = ToyPrefixCache(worker_id, num_blocks, block_size)
        self.epoch = epoch or time.time()
        self.counters = SpecCounters(accepted_per_pos=[0] * num_speculative_tokens)
        self._stats_dirty = False
        self._stats_interval = stats_interval
        self.running = 0
        self.max_num_seqs = max_num_seqs  # 0: no limit
        self.by_priority = scheduling_policy == "priority"
        self._waiting: list[tuple[int, int, asyncio.Future]] = []  # (priority or 0, arrival, wake-up)
        self._arrivals = itertools.count()
        self.cancelled = 0  # handlers cancelled by their client (tests assert on it)
        self._tasks: list[asyncio.Task] = []

    async def start(self) -> None:
        self.cache.clear()
        await self._flush_kv()
        self._tasks.append(asyncio.create_task(self._periodic(), name="mock-publishers"))

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def on_dump_request(self, _request: KvDumpRequest) -> None:
        for event in self.cache.dump():
            await self._publish(TOPIC_KV, event)

    async def _flush_kv(self) -> None:
        events, self.cache.events = self.cache.events, []
        for event in events:
            await self._publish(TOPIC_KV, event)

    def load(self) -> LoadEvent:
        return LoadEvent(self.worker_id, running=self.running, queued=len(self._waiting),
                         active_blocks=len(self.cache._pinned), total_blocks=self.cache.num_blocks,
                         free_blocks=self.cache.num_blocks - len(self.cache), timestamp=time.time(),
                         max_num_seqs=self.max_num_seqs)

    async def _admit(self, priority: int) -> None:
        """Take a running slot, waiting for one in (priority, arrival) or arrival order."""
        if not self.max_num_seqs or (self.running < self.max_num_seqs and not self._waiting):
            self.running += 1
            return
        wake = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiting, (priority if self.by_priority else 0, next(self._arrivals), wake))
        try:
            await wake
        except asyncio.CancelledError:
            if wake.done() and not wake.cancelled():
                self._leave()  # admitted just as its client left
            else:
                self._waiting = [w for w in self._waiting if w[2] is not wake]
                heapq.heapify(self._waiting)
            raise

    def _leave(self) -> None:
        self.running -= 1
        while self._waiting and (not self.max_num_seqs or self.running < self.max_num_seqs):
            *_, wake = heapq.heappop(self._waiting)
            if not wake.done():
                self.running += 1
                wake.set_result(None)

    async def _periodic(self) -> None:
        ticks = 0
        while True:
            await asyncio.sleep(self._stats_interval)
            ticks += 1
            try:
                if self._stats_dirty or ticks % 10 == 0:
                    self._stats_dirty = False
                    event = self.counters.event(self.worker_id, self.draft_id, self.epoch, "mock")
                    await self._publish(TOPIC_SPEC_STATS, event)
                await self._publish(TOPIC_LOAD, self.load())
            except Exception as exc:  # NATS reconnecting: try again next tick
                log.debug("mock publish failed: %r", exc)

    async def generate(self, req: GenerateRequest, ctx):
        """Token ids in, token deltas out; the last delta has the finish reason and usage. Every sampling
        parameter is validated like a real worker's; the logits processors have nothing to act on here,
        and a grammar is refused (echoing the prompt cannot follow one)."""
        validate_request(req.token_ids, req.sampling, req.output_ids, vocab_size=None,
                         max_model_len=self.context_length)
        sp = req.sampling
        prompt = list(req.token_ids) + list(req.output_ids)
        hashes = block_hashes(prompt, self.cache.block_size)
        await self._admit(req.priority)
        cached_blocks = self.cache.acquire(hashes)
        try:
            await self._flush_kv()
            cached = cached_blocks * self.cache.block_size
            if self.prefill_latency_per_token:
                await asyncio.sleep(self.prefill_latency_per_token * (len(prompt) - cached))
            pool = [t for t in req.token_ids if t not in self.special_ids] or [t for t in req.token_ids]
            rng = random.Random(sp.seed) if sp.seed is not None else random.Random()
            drafted = self.num_speculative_tokens if req.num_speculative_tokens is None else req.num_speculative_tokens
            spec = SpecUsage(draft_id=req.draft_id or self.draft_id) if drafted > 0 else None
            stop_ids = set(sp.stop_token_ids) | (set() if sp.ignore_eos else set(self.eos_ids))
            produced, finish = 0, "length"
            while produced < sp.max_tokens:
                step = 1
                if drafted > 0:
                    accepted = 0
                    while accepted < drafted and rng.random() < self.acceptance_rate:
                        accepted += 1
                    self.counters.observe_draft(drafted, accepted)
                    self._stats_dirty = True
                    per_pos = list(spec.accepted_per_pos) or [0] * drafted
                    for i in range(accepted):
                        per_pos[i] += 1
                    spec = msgspec.structs.replace(spec, num_drafts=spec.num_drafts + 1,
                                                   num_draft_tokens=spec.num_draft_tokens + drafted,
                                                   num_accepted_tokens=spec.num_accepted_tokens + accepted,
                                                   accepted_per_pos=per_pos)
                    step = accepted + 1
                delay = self.token_latency + self.latency_per_running * (self.running - 1)
                if delay:
                    await asyncio.sleep(delay)
                tokens = []
                for _ in range(min(step, sp.max_tokens - produced)):
                    index = len(req.output_ids) + produced
                    token = pool[index % len(pool)] if is_greedy(sp.temperature) else rng.choice(pool)
                    tokens.append(token)
                    produced += 1
                    if token in stop_ids and produced >= sp.min_tokens:
                        finish = "stop"
                        break
                delta = TokenDelta(token_ids=tokens)
                if sp.logprobs is not None:
                    delta = TokenDelta(tokens, [-0.25] * len(tokens),
                                       [[TopLogprob(t, -0.25)] + [TopLogprob(t + k, -2.0 - k) for k in range(1, sp.logprobs)]
                                        for t in tokens] if sp.logprobs else None)
                if finish == "stop" or produced >= sp.max_tokens:
                    usage = Usage(len(req.token_ids), len(req.output_ids) + produced, cached, spec)
                    yield msgspec.structs.replace(delta, finish_reason=finish, usage=usage)
                    return
                yield delta
            yield TokenDelta(finish_reason=finish, usage=Usage(len(req.token_ids), len(req.output_ids), cached, spec))
        except asyncio.CancelledError:
            self.cancelled += 1
            log.info("request %s: cancelled after client left", ctx.request_id)
            raise
        finally:
            self.cache.release(hashes)
            self._leave()


def build_parser() -> argparse.ArgumentParser:
    parser = EnvParser(prog="python -m workers.mock", description="Tandem mock engine worker")
    add_runtime_args(parser)
    SERVED_MODEL_NAME.add(parser, "--model-name", dest="model_name", default=["mock"])
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: the demo SmolLM2 tokenizer)")
    parser.add_argument("--token-latency-ms", type=float, default=5.0, help="time per generated token (0 = as fast as possible)")
    parser.add_argument("--token-latency-per-running-ms", type=float, default=0.0,
                        help="extra time per generated token for each other request running here (a batched "
                             "engine's step grows with its batch; 0: latency independent of load)")
    parser.add_argument("--prefill-latency-ms", type=float, default=0.0, help="time per uncached prompt token")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per simulated KV cache block")
    parser.add_argument("--num-blocks", type=int, default=4096, help="simulated KV cache blocks")
    parser.add_argument("--max-model-len", "--context-length", dest="context_length", type=int, default=2048,
                        help="context length")
    parser.add_argument("--acceptance-rate", type=float, default=0.7, help="simulated per-token draft acceptance")
    parser.add_argument("--num-speculative-tokens", type=int, default=4, help="simulated γ (0 disables speculation)")
    parser.add_argument("--draft-id", default="mock-draft", help="draft id reported in spec-decode stats")
    parser.add_argument("--max-num-seqs", type=int, default=0,
                        help="requests run at once; the rest wait (0: no limit)")
    parser.add_argument("--scheduling-policy", default="fcfs", choices=("fcfs", "priority"),
                        help="the order waiting requests start in: fcfs, or priority (the request's priority, lower "
                             "first, then arrival)")
    parser.add_argument("--stats-interval", type=float, default=0.5, help="seconds between load/stats events")
    parser.add_argument("--drain-timeout", type=float, default=30.0, help="seconds open requests get on SIGTERM")
    parser.add_argument("--log-level", default=None, help="DEBUG, INFO, WARNING or ERROR (default INFO)")
    return apply_env_defaults(parser)


def parse_args(argv=None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


async def amain(args: argparse.Namespace) -> None:
    if args.tokenizer:
        tokenizer_dir = Path(args.tokenizer)
    else:
        from workers.demo_model import demo_tokenizer_dir

        tokenizer_dir = await asyncio.to_thread(demo_tokenizer_dir)
    special, eos = special_token_ids(tokenizer_dir)
    config = config_from_args(args, drain_timeout=args.drain_timeout)
    async with Runtime.connect(config) as rt:
        worker = MockWorker(
            rt.instance_id,
            rt.publish,
            token_latency=args.token_latency_ms / 1000,
            latency_per_running=args.token_latency_per_running_ms / 1000,
            prefill_latency_per_token=args.prefill_latency_ms / 1000,
            block_size=args.block_size,
            num_blocks=args.num_blocks,
            context_length=args.context_length,
            acceptance_rate=args.acceptance_rate,
            num_speculative_tokens=args.num_speculative_tokens,
            draft_id=args.draft_id,
            special_ids=special,
            eos_ids=eos,
            stats_interval=args.stats_interval,
            epoch=rt.started_at,
            max_num_seqs=args.max_num_seqs,
            scheduling_policy=args.scheduling_policy,
        )
        await worker.start()
        await rt.subscribe(TOPIC_KV_DUMP, KvDumpRequest, lambda req: asyncio.ensure_future(worker.on_dump_request(req)))
        await rt.register_model(ModelCard(
            name=args.model_name[0],
            aliases=[n for n in dict.fromkeys(args.model_name[1:]) if n != args.model_name[0]],
            role="target",
            tokenizer_path=str(tokenizer_dir),
            context_length=args.context_length,
            kv_block_size=args.block_size,
            spec_method="mock" if args.num_speculative_tokens else "",
            num_speculative_tokens=args.num_speculative_tokens,
            eos_token_ids=eos,
        ))
        # The instance record goes last: once it is visible, the model card is there too.
        await rt.serve("target", "generate", worker.generate, GenerateRequest, role="target",
                       model=args.model_name[0])
        log.info("mock worker %s ready: model %s", rt.instance_id, " ".join(args.model_name))
        await rt.wait_for_shutdown()
        await worker.stop()


def main(argv=None) -> None:
    args = parse_args(argv)

    def tokenizer() -> None:
        if args.tokenizer and not Path(args.tokenizer).exists():
            raise ValueError(f"--tokenizer {args.tokenizer} does not exist")
        if args.max_num_seqs < 0:
            raise ValueError("--max-num-seqs must be >= 0")
        if args.token_latency_ms < 0 or args.token_latency_per_running_ms < 0:
            raise ValueError("--token-latency-ms and --token-latency-per-running-ms must be >= 0")

    exit_on_bad_config("python -m workers.mock", tokenizer, lambda: check_log_level(args.log_level),
                       lambda: config_from_args(args, drain_timeout=args.drain_timeout))
    run_service(lambda: amain(args), args.log_level)


if __name__ == "__main__":
    main()
