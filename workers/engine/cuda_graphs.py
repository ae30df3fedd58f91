"""CUDA graphs for decode and verify steps, captured at batch-size buckets (as vLLM and SGLang do).

A decode step of B sequences, or a verify step of B sequences with up to Q = γ+1 new tokens
each, is the same computation every time up to the values in a few tensors. :class:`GraphRunner`
captures the model's forward once per (bucket, Q, hidden layers) over static input buffers and
replays it, so a step costs one graph launch instead of hundreds of kernel launches.

Padding. A batch of B sequences runs in the smallest bucket ≥ B; the static layout is
[bucket, Q] tokens, row b holding sequence b's q_b ≤ Q new tokens left-aligned. Padding tokens
(the rest of a row, and the rows past B) write their keys and values to a *scratch block* that
no sequence owns (the cache has one block more than the block manager hands out), and padded
rows' block tables point only at it, so padding never touches a real sequence's cache; its
outputs are computed and dropped. Real tokens attend only to keys up to their own position in
their own blocks, so what padding computes cannot reach them.

Query lengths. The engine captures every verify length 2 … γ+1 (chains) beside decode (1): adaptive
γ and load-aware budgets produce them all, and padding a q-token verify to the γ+1 graph cost 1.4-1.8×
the exact graph's replay at batch 64 on an H200 (1.02× at batch 1; ``bench/gpu_bench.py``'s padding
table). Tree verify graphs exist at γ+1 only, and smaller trees pad to it.

Only uniform steps are graphed: every sequence wants logits for all of its new tokens (decode:
1 of 1; verify: q_b of q_b). Prefill chunks and mixed batches run eagerly. Graphs share one
memory pool, captured largest first; outputs are copied out before the next replay.

Token trees (``GraphConfig.trees``): a verify step in which some sequence's draft is a tree runs a
second graph per (bucket, Q) whose attention also reads static per-token tree masks (``tree_base``
and packed ``tree_bits``, see :class:`~workers.engine.attention.AttentionMetadata`). A tree's tokens
sit in consecutive cache slots but are rotated to their depth, so that graph's positions (rotary)
and token positions (slots, causal limit) are uploaded separately; chains in the same batch attend
causally (tree base past their own position).

Without CUDA (tests), ``capture=False`` runs the same static, padded forward eagerly: the
bucketing and padding logic is then checked on CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from ..speculation.tree import ancestor_mask, tree_depths
from .attention import AttentionMetadata
from .model import DecoderModel, ModelOutput

log = logging.getLogger(__name__)

KvCaches = list[tuple[torch.Tensor, torch.Tensor]]


def batch_buckets(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then multiples of 8 up to 64 and of 32 beyond, ending at ``max_batch``."""
    if max_batch <= 0:
        raise ValueError(f"max_batch must be positive, got {max_batch}")
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    sizes += [s for s in range(8, min(max_batch, 64) + 1, 8)]
    sizes += [s for s in range(96, max_batch + 1, 32)]
    if not sizes or sizes[-1] != max_batch:
        sizes.append(max_batch)
    return tuple(sorted(set(sizes)))


@dataclass(frozen=True)
class GraphConfig:
    """What to capture: batch buckets up to ``max_batch``; query lengths (1 = decode, γ+1 = verify)."""

    max_batch: int
    query_lens: tuple[int, ...] = (1,)
    hidden_layers: tuple[int, ...] = ()
    capture: bool = True  # False: run the static forward eagerly (CPU tests)
    trees: bool = False  # also graphs for verify steps with token trees (query lengths > 1)

    def __post_init__(self):
        if self.max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {self.max_batch}")
        if not self.query_lens or min(self.query_lens) <= 0:
            raise ValueError(f"query_lens must be positive, got {self.query_lens}")


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph | None
    output: ModelOutput | None  # the graph's static outputs (capture) or None (eager)


class GraphRunner:
    """Runs uniform decode/verify batches of ``model`` through captured graphs.

    ``kv_caches`` must have ``scratch_block`` as a block no sequence owns (padding writes there).
    """

    def __init__(self, model: DecoderModel, kv_caches: KvCaches, block_size: int, max_model_len: int,
                 scratch_block: int, config: GraphConfig):
        if not model.static_capable:
            raise ValueError("CUDA graphs need an attention function that reads only tensors (Triton)")
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.config = config
        self.buckets = batch_buckets(config.max_batch)
        self.query_lens = tuple(sorted(set(config.query_lens)))
        self.max_blocks = -(-max_model_len // block_size)
        self.scratch_block = scratch_block
        device = kv_caches[0][0].device
        self.device = device
        n = self.buckets[-1] * self.query_lens[-1]
        self.max_tokens = n
        # The static inputs live in two device buffers, so that a step's inputs go up in two copies
        # from pinned host mirrors: long [3, n] = (token ids, positions, cache slots) and int32
        # [token's sequence (n) | token's position (n) | block tables (max bucket × max blocks)].
        cuda = device.type == "cuda"
        self._long = torch.zeros((3, n), dtype=torch.long, device=device)
        self._int = torch.zeros(2 * n + self.buckets[-1] * self.max_blocks, dtype=torch.int32, device=device)
        self._host_long = torch.zeros(self._long.shape, dtype=torch.long, pin_memory=cuda)
        self._host_int = torch.zeros(self._int.shape, dtype=torch.int32, pin_memory=cuda)
        self._host_long_np, self._host_int_np = self._host_long.numpy(), self._host_int.numpy()
        self._host_long_np[2].fill(scratch_block * block_size)
        self._host_int_np[2 * n:].fill(scratch_block)
        self._long.copy_(self._host_long)
        self._int.copy_(self._host_int)
        self.input_ids, self.positions, self.slot_mapping = self._long[0], self._long[1], self._long[2]
        self.token_seq, self.token_pos = self._int[:n], self._int[n : 2 * n]
        self.block_tables = self._int[2 * n :].view(self.buckets[-1], self.max_blocks)
        # token trees: int32 [tree base (n) | tree bits (n × words)], its own pinned mirror and copy
        self.tree_words = -(-self.query_lens[-1] // 32)
        self._tree = torch.zeros(n * (1 + self.tree_words), dtype=torch.int32, device=device)
        self._host_tree = torch.zeros(self._tree.shape, dtype=torch.int32, pin_memory=cuda)
        self._host_tree_np = self._host_tree.numpy()
        self.tree_base = self._tree[:n]
        self.tree_bits = self._tree[n:].view(n, self.tree_words)
        self._table_width = [0] * self.buckets[-1]  # columns of each host table row not holding the scratch block
        self._uploaded = torch.cuda.Event() if cuda else None  # the host mirrors are free once it has passed
        self.graphs: dict[tuple[int, int, tuple[int, ...], bool], _Graph] = {}
        self._pool = None
        # one side stream for every capture's warm-up: cuBLAS keeps a workspace (32 MiB on Hopper) per
        # stream it ran on, so a stream per graph held 32 MiB per graph for the process's life
        self._warmup = torch.cuda.Stream(device) if cuda and config.capture else None
        self.replays = 0

    # ------------------------------------------------------------------ capture

    def capture_all(self) -> None:
        """Capture every bucket × query length (and tree variant) for the configured hidden layers,
        largest first."""
        started = time.perf_counter()
        hidden = tuple(sorted(set(self.config.hidden_layers)))
        for q in reversed(self.query_lens):
            for tree in ((False, True) if self.config.trees and q == self.query_lens[-1] > 1 else (False,)):
                for bucket in reversed(self.buckets):
                    self._graph(bucket, q, hidden, tree)
        if self.config.capture:
            log.info("captured %d CUDA graphs (batch ≤ %d, query lengths %s, trees %s) in %.1fs", len(self.graphs),
                     self.buckets[-1], self.query_lens, self.config.trees, time.perf_counter() - started)

    def _meta(self, bucket: int, q: int, tree: bool) -> AttentionMetadata:
        n = bucket * q
        trees = (self.tree_base[:n], self.tree_bits[:n, : -(-q // 32)]) if tree else (None, None)
        return AttentionMetadata.static(self.slot_mapping[:n], self.block_tables[:bucket], self.token_seq[:n],
                                        self.token_pos[:n], self.block_size, *trees)

    def _forward(self, bucket: int, q: int, hidden: tuple[int, ...], tree: bool) -> ModelOutput:
        n = bucket * q
        return self.model(self.input_ids[:n], self.positions[:n], self._meta(bucket, q, tree), self.kv_caches, None,
                          hidden)

    def _graph(self, bucket: int, q: int, hidden: tuple[int, ...], tree: bool = False) -> _Graph:
        key = (bucket, q, hidden, tree)
        found = self.graphs.get(key)
        if found is not None:
            return found
        if not self.config.capture:
            entry = _Graph(None, None)
        else:
            self._reset_padding(bucket, q)
            with torch.inference_mode():
                stream = self._warmup
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):  # compile the Triton kernels and warm up cuBLAS outside capture
                    for _ in range(2):
                        self._forward(bucket, q, hidden, tree)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self._pool):
                    output = self._forward(bucket, q, hidden, tree)
            self._pool = graph.pool()
            entry = _Graph(graph, output)
        self.graphs[key] = entry
        return entry

    def _reset_padding(self, bucket: int, q: int) -> None:
        """Every token of the bucket a padding token (capture-time inputs)."""
        n = bucket * q
        self.input_ids[:n].zero_()
        self.positions[:n].zero_()
        self.slot_mapping[:n].fill_(self.scratch_block * self.block_size)
        self.token_seq[:n].zero_()
        self.token_pos[:n].zero_()
        self.block_tables[:bucket].fill_(self.scratch_block)
        self.tree_base[:n].fill_(1)
        self.tree_bits[:n].zero_()

    # ------------------------------------------------------------------ running

    def shape_for(self, chunks: list[tuple[list[int], int, list[int]]], logits_last: list[int],
                  hidden_layers: Iterable[int], trees: list[list[int] | None] | None = None
                  ) -> tuple[int, int, tuple[int, ...], bool] | None:
        """The (bucket, Q, hidden, tree) graph that serves this batch, or None if it must run eagerly.
        ``trees[b]``: the parents of chunk b's draft tokens (a token tree), or None."""
        if not chunks or len(chunks) > self.buckets[-1]:
            return None
        tree = trees is not None and any(t is not None for t in trees)
        if tree and not self.config.trees:
            return None
        longest = 0
        for (tokens, _, _), want in zip(chunks, logits_last):
            if want != len(tokens):  # a prefill chunk, or one that wants only some rows
                return None
            longest = max(longest, want)
        # chains: the smallest captured length that holds the batch; trees: the longest (their graphs
        # carry mask buffers, captured at one length only)
        q = next((x for x in self.query_lens if x >= longest), None)
        if tree and q is not None:
            q = self.query_lens[-1]
        if q is None or (tree and q == 1):
            return None
        bucket = next(b for b in self.buckets if b >= len(chunks))
        return bucket, q, tuple(sorted(set(hidden_layers))), tree

    @torch.inference_mode()
    def run(self, chunks: list[tuple[list[int], int, list[int]]], shape: tuple[int, int, tuple[int, ...], bool],
            trees: list[list[int] | None] | None = None,
            fill: tuple[torch.Tensor, torch.Tensor] | None = None) -> ModelOutput:
        """Run a batch :meth:`shape_for` accepted; output rows are the chunks' tokens in order.
        ``fill``: (index [m], tokens [m]) on the device, input ids written over the uploaded ones
        (tokens the previous step sampled that the host has not seen: async scheduling). The hidden
        rows and slots returned may be views of the graph's buffers: read them before the next run."""
        bucket, q, hidden, tree = shape
        entry = self._graph(bucket, q, hidden, tree)  # captures on first use of a new shape
        self._upload(chunks, bucket, q, trees if tree else None)
        if fill is not None:  # queued behind the upload's copy, before the replay
            self.input_ids.index_copy_(0, *fill)
        if entry.graph is not None:
            entry.graph.replay()
            out = entry.output
        else:
            out = self._forward(bucket, q, hidden, tree)
        self.replays += 1
        rows = [b * q + j for b, (tokens, _, _) in enumerate(chunks) for j in range(len(tokens))]
        slots = self._long[2]
        if rows[-1] == len(rows) - 1:  # every chunk fills its row (decode, full verify): copy a slice
            # The hidden rows and their slots stay views of the graph's buffers (valid until the next
            # replay): the engine copies them into its hidden store at once, so a copy here would
            # only add a copy per offered layer to every step.
            k = len(rows)
            return ModelOutput(out.logits[:k].clone(), {layer: h[:k] for layer, h in out.hidden.items()}, slots[:k])
        index = torch.tensor(rows, dtype=torch.long).to(self.device, non_blocking=True)
        return ModelOutput(out.logits.index_select(0, index),
                           {layer: h.index_select(0, index) for layer, h in out.hidden.items()},
                           slots.index_select(0, index))

    def _upload(self, chunks: list[tuple[list[int], int, list[int]]], bucket: int, q: int,
                trees: list[list[int] | None] | None = None) -> None:
        """Write the step's padded inputs into the pinned host mirrors and copy them up (two copies; a
        tree step a third, its masks)."""
        n, bs, size = bucket * q, self.block_size, self.max_tokens
        scratch_slot = self.scratch_block * bs
        if self._uploaded is not None:
            self._uploaded.synchronize()  # the previous step's copies have read the mirrors
        ids, pos, slots, tpos = [0] * n, [0] * n, [scratch_slot] * n, [0] * n
        seq_of = [b for b in range(bucket) for _ in range(q)]
        tables = self._host_int_np[2 * size :].reshape(-1, self.max_blocks)
        width = self._table_width
        for b, (tokens, start, table) in enumerate(chunks):
            base = b * q
            for j, token in enumerate(tokens):
                p = start + j
                ids[base + j], pos[base + j], tpos[base + j] = token, p, p
                slots[base + j] = table[p // bs] * bs + p % bs
            tables[b, : len(table)] = table
            if width[b] > len(table):
                tables[b, len(table) : width[b]] = self.scratch_block
            width[b] = len(table)
        for b in range(len(chunks), bucket):  # padding rows read only the scratch block
            if width[b]:
                tables[b, : width[b]] = self.scratch_block
                width[b] = 0
        if trees is not None:
            self._upload_trees(chunks, trees, q, n, pos, tpos)
        host_long, host_int = self._host_long_np, self._host_int_np
        host_long[0, :n], host_long[1, :n], host_long[2, :n] = ids, pos, slots
        host_int[:n], host_int[size : size + n] = seq_of, tpos
        self._long.copy_(self._host_long, non_blocking=True)
        used = 2 * size + bucket * self.max_blocks
        self._int[:used].copy_(self._host_int[:used], non_blocking=True)
        if trees is not None:
            self._tree.copy_(self._host_tree, non_blocking=True)
        if self._uploaded is not None:
            self._uploaded.record()

    def _upload_trees(self, chunks, trees: list[list[int] | None], q: int, n: int, pos: list[int],
                      tpos: list[int]) -> None:
        """Tree masks and depth positions of a tree step into the host mirror: a tree chunk's tokens
        see every key before its root and, from the root on, only their ancestors (and themselves);
        every other token (chains, padding) attends causally (tree base past its own position)."""
        words = self.tree_words
        base = self._host_tree_np[: self.max_tokens]
        bits = self._host_tree_np[self.max_tokens :].reshape(self.max_tokens, words)
        base[:n] = [p + 1 for p in tpos]
        bits[:n] = 0
        for b, ((tokens, start, _), parents) in enumerate(zip(chunks, trees)):
            if parents is None:
                continue
            row = b * q
            for i, depth in enumerate(tree_depths(parents)):
                pos[row + 1 + i] = start + depth  # rotated to its depth, stored in the next slot
            mask = ancestor_mask(parents).numpy()  # [k+1, k+1] bool over the chunk's own keys
            k1 = mask.shape[0]
            padded = np.zeros((k1, words * 32), dtype=np.uint8)
            padded[:, :k1] = mask
            packed = np.packbits(padded, axis=-1, bitorder="little").view(np.int32)  # [k+1, words]
            base[row : row + k1] = start
            bits[row : row + k1] = packed
