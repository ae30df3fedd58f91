"""CUDA graphs for an EAGLE head's chain steps, captured at the engine's batch buckets.

After its first pass a chain step runs one pair per sequence — (its newest token, the feature the
head predicted for it) — attending to that sequence's cached pairs: B pairs whose shapes are
fixed by B alone. :class:`HeadGraphs` captures ``head.forward`` for each bucket of
:func:`workers.engine.cuda_graphs.batch_buckets` over static buffers and replays it, so a draft
step costs a few copies and one graph launch instead of a host-built attention metadata and a
kernel per op. The first pass of a proposal (many pairs per sequence) and tree passes run eagerly.

Padding (rows past B, up to the bucket) writes its keys and values to a scratch block no sequence
owns (the cache has one block more than the block manager hands out) and reads only that block,
so it never touches a real sequence's cache; its outputs are dropped. Attention reads tensors only
(:meth:`AttentionMetadata.static`): on CUDA the engine's Triton kernel, baked into the graphs at
capture (eager passes keep the head's own attention). Without CUDA (tests) ``capture=False`` runs
the same static, padded forward eagerly.
"""

from __future__ import annotations

import logging
import time

import torch

from ..engine.attention import AttentionMetadata
from ..engine.cuda_graphs import batch_buckets
from ..engine.model import Attention

log = logging.getLogger(__name__)

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]


class HeadGraphs:
    """Replays ``head.forward`` for B ≤ ``max_batch`` sequences of one new pair each."""

    def __init__(self, head: torch.nn.Module, kv: KvCaches, block_size: int, max_positions: int, scratch_block: int,
                 max_batch: int = 64, capture: bool = True):
        self.head, self.kv = head, kv
        self.block_size, self.scratch_block, self.capture = block_size, scratch_block, capture
        self.buckets = batch_buckets(max_batch)
        self.max_batch = self.buckets[-1]
        self.max_blocks = -(-max_positions // block_size)
        k_cache = kv[0][0]
        device = self.device = k_cache.device
        n = self.max_batch
        param = next(head.parameters())
        self.input_ids = torch.zeros(n, dtype=torch.long, device=device)
        self.positions = torch.zeros(n, dtype=torch.long, device=device)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=device)
        self.token_seq = torch.arange(n, dtype=torch.int32, device=device)  # row b holds sequence b's pair
        self.token_pos = torch.zeros(n, dtype=torch.int32, device=device)
        self.block_tables = torch.full((n, self.max_blocks), scratch_block, dtype=torch.int32, device=device)
        self.features = torch.zeros(n, head.cfg.hidden_size, dtype=param.dtype, device=device)
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph | None, torch.Tensor | None]] = {}
        self._pool = None
        self.replays = 0

    def _forward(self, bucket: int) -> torch.Tensor:
        meta = AttentionMetadata.static(self.slot_mapping[:bucket], self.block_tables[:bucket],
                                        self.token_seq[:bucket], self.token_pos[:bucket], self.block_size)
        return self.head(self.input_ids[:bucket], self.features[:bucket], self.positions[:bucket], meta, self.kv)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first (one memory pool); eager entries without capture."""
        started = time.perf_counter()
        if not self.capture:
            self.graphs = {b: (None, None) for b in self.buckets}
            return
        from ..engine.triton_attention import paged_attention_triton

        attentions = [m for m in self.head.modules() if isinstance(m, Attention)]
        eager_fns = [m.attention_fn for m in attentions]
        for m in attentions:  # graphs need an attention that reads only tensors: the engine's kernel
            m.attention_fn = paged_attention_triton
        stream = torch.cuda.Stream(self.device)  # one for every warm-up: cuBLAS keeps a workspace per stream
        try:
            for bucket in reversed(self.buckets):
                self._reset(bucket)
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # compile the Triton kernel, warm up cuBLAS outside capture
                    for _ in range(2):
                        self._forward(bucket)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    out = self._forward(bucket)
                self._pool = graph.pool()
                self.graphs[bucket] = (graph, out)
        finally:
            for m, fn in zip(attentions, eager_fns):
                m.attention_fn = fn
            self.head.rotary._last = None  # tables gathered during capture live in the graphs' pool
        self._reset(self.max_batch)
        log.info("captured %d CUDA graphs of the draft head (batch ≤ %d) in %.1fs", len(self.graphs), self.max_batch,
                 time.perf_counter() - started)

    def _reset(self, bucket: int) -> None:
        """Every row of the bucket a padding row."""
        self.input_ids[:bucket].zero_()
        self.positions[:bucket].zero_()
        self.slot_mapping[:bucket].fill_(self.scratch_block * self.block_size)
        self.token_pos[:bucket].zero_()
        self.block_tables[:bucket].fill_(self.scratch_block)

    def fits(self, qlens: list[int], tables: list[list[int]]) -> bool:
        """Whether a step of sequences with ``qlens`` new pairs and these block tables replays here
        (one pair each, B ≤ max, tables within the static width)."""
        return (0 < len(qlens) <= self.max_batch and all(q == 1 for q in qlens)
                and all(len(t) <= self.max_blocks for t in tables))

    @torch.inference_mode()
    def run(self, ids: list[int], features: torch.Tensor, positions: list[int], tables: list[list[int]]) -> torch.Tensor:
        """One pair per sequence: token ids [B], features [B, H] (on the device), positions [B] and
        block tables (each covering its position) -> the head's outputs [B, H]."""
        b, bs = len(ids), self.block_size
        bucket = next(x for x in self.buckets if x >= b)
        scratch_slot = self.scratch_block * bs
        slots = [table[p // bs] * bs + p % bs for table, p in zip(tables, positions)]
        host_tables = torch.full((bucket, self.max_blocks), self.scratch_block, dtype=torch.int32)
        for row, table in enumerate(tables):
            host_tables[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
        pad = bucket - b
        self.input_ids[:bucket].copy_(torch.tensor(ids + [0] * pad))
        self.positions[:bucket].copy_(torch.tensor(positions + [0] * pad))
        self.token_pos[:bucket].copy_(torch.tensor(positions + [0] * pad, dtype=torch.int32))
        self.slot_mapping[:bucket].copy_(torch.tensor(slots + [scratch_slot] * pad))
        self.block_tables[:bucket].copy_(host_tables)
        self.features[:b].copy_(features)
        graph, out = self.graphs[bucket] if bucket in self.graphs else (None, None)
        if graph is not None:
            graph.replay()
        else:
            out = self._forward(bucket)
        self.replays += 1
        return out[:b].clone()
