"""One request's state inside the engine: its tokens, how many have KV in the cache, its blocks."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from runtime.kv_hash import ROOT_HASH, block_hash
from runtime.messages import SamplingParams

if TYPE_CHECKING:
    from .grammar import Grammar


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    """``token_ids`` = prompt, then tokens generated elsewhere (migration), then ours.

    ``num_computed`` tokens have their KV in ``block_table``'s blocks; ``block_hashes[i]`` is the
    chained hash of full block i once computed (what the prefix cache knows it by).

    Async scheduling: ``num_pending`` tokens were sampled by a launched step but are not yet in
    ``token_ids`` (their values are still on the device); they count as uncomputed tokens for the
    next step, whose input they are. ``ends_at_pending``: the last of them ends the sequence whatever
    it is (max_tokens, the context length, a prefill-only request's first token), so nothing is
    scheduled after it.
    """

    request_id: str
    token_ids: list[int]
    num_prompt_tokens: int  # the request's prompt (usage.prompt_tokens)
    num_prefilled_outputs: int  # output_ids carried in by a migrated request
    params: SamplingParams
    stop_ids: frozenset[int] = frozenset()
    generator: torch.Generator | None = None
    num_computed: int = 0
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)
    num_registered: int = 0  # leading blocks already offered to the prefix cache
    num_cached_tokens: int = -1  # prefix-cache hit at first admission; -1 until admitted
    num_generated: int = 0
    status: SeqStatus = SeqStatus.WAITING
    grammar: Grammar | None = None  # structured output: every sampled token obeys its mask
    num_pending: int = 0
    ends_at_pending: bool = False
    prefill_only: bool = False  # a prefill worker's request: ends after its first token, KV handed off
    handed_off: bool = False  # it did: its blocks are parked for a decode worker (engine.handoff.Handoffs)
    queued_at: float = field(default_factory=time.monotonic)  # when it joined the engine
    scheduled_at: float | None = None  # when it was first scheduled (None: not yet)
    lora: str | None = None  # the LoRA adapter it runs with (None: the base model)
    lora_slot: int = -1  # its adapter's device slot while it runs (workers.engine.lora.LoraManager)
    hash_root: int = ROOT_HASH  # where its block-hash chain starts: per adapter (runtime.kv_hash.chain_root)
    priority: int = 0  # vLLM's: lower is served first; 0 unless the engine schedules by priority

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        if self.ends_at_pending:
            return 0
        return len(self.token_ids) + self.num_pending - self.num_computed

    @property
    def is_finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

    def full_block_hashes(self, block_size: int, upto: int) -> list[int]:
        """Hashes of the full blocks among the first ``upto`` tokens (extends ``block_hashes``)."""
        full = upto // block_size
        parent = self.block_hashes[-1] if self.block_hashes else self.hash_root
        for i in range(len(self.block_hashes), full):
            parent = block_hash(parent, self.token_ids[i * block_size : (i + 1) * block_size])
            self.block_hashes.append(parent)
        return self.block_hashes[:full]

    def reset_for_recompute(self) -> None:
        """After preemption: no blocks, nothing computed (hashes stay valid: same tokens)."""
        self.num_computed = 0
        self.block_table = []
        self.num_registered = 0
        self.status = SeqStatus.WAITING
