"""Runs the model on one step's batch: flat inputs and attention metadata from per-sequence chunks.

A chunk is (new token ids, position of the first one, block table). ``logits_last[b]`` says for how
many of chunk b's last positions logits are wanted: 1 after a prefill chunk or a decode, γ+1 for a
verify step, 0 for a prefill chunk that does not reach the end of its prompt. A verify chunk may be
a token *tree* (``trees[b]``: the parents of its tokens after the first, see
:mod:`workers.speculation.tree`): its tokens sit in consecutive cache slots, but each is rotated to
its depth in the tree and attends only to its ancestors among the chunk.

Async scheduling: a chunk's last token may be one the previous step sampled and the host has not
seen yet. Its place in the chunk holds :data:`PENDING_TOKEN`, and ``last_from`` (the previous
step's sampled tokens on the device, and the row of each chunk's) fills it in on the device, after
the inputs are uploaded and before the forward runs: the host never waits for it.

Under tensor parallelism rank 0's runner is given the :class:`.followers.Followers`: every call
(forward, copy_slots, copy_blocks) is first sent to the follower ranks, whose own runners repeat it
on their shards (the collectives inside the forward keep them in step); the cache holds this rank's
KV heads only. Any failure inside a tensor-parallel call leaves the ranks out of step, so it marks
the group failed (:class:`.parallel.TensorParallelFailed` from then on): the worker must go down.
"""

from __future__ import annotations

import itertools
from contextlib import contextmanager
from typing import Protocol

import torch

from ..speculation.tree import ancestor_mask, tree_depths
from .attention import AttentionMetadata, allocate_kv_cache
from .cuda_graphs import GraphConfig, GraphRunner
from .model import DecoderModel, ModelOutput

PENDING_TOKEN = -1  # a chunk's token still on the device: ``last_from`` replaces it before the forward


class Followers(Protocol):
    """The other ranks of a tensor-parallel model, as rank 0's runner drives them
    (:class:`.followers.Followers`; a protocol here, so that the follower process, which runs a
    runner itself, and this module do not import each other)."""

    def setup(self, num_blocks: int, block_size: int, max_model_len: int | None, graphs) -> None: ...

    def forward(self, chunks, logits_last, hidden_layers, trees) -> None: ...

    def copy_slots(self, src: list[int], dst: list[int]) -> None: ...

    def copy_blocks(self, pairs) -> None: ...


class ModelRunner:
    """Owns the model and its paged KV cache tensors.

    On CPU it keeps only the packed (oneDNN) copies of the model's large linear weights, so that
    they are not held twice; the model is then for inference only. With ``graphs`` (GPU), decode
    and verify steps replay CUDA graphs (:mod:`workers.engine.cuda_graphs`); the cache then has one
    extra scratch block, ``num_blocks``, that padding writes to.
    """

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int, graphs: GraphConfig | None = None,
                 max_model_len: int | None = None, followers: Followers | None = None, *, lora=None):
        self.model = model
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.tp = model.tp
        self.followers = followers
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype
        if self.device.type == "cpu":
            model.release_dense_weights()
        cfg = model.cfg
        extra = 1 if graphs is not None else 0
        self.kv_caches = allocate_kv_cache(cfg.num_layers, num_blocks + extra, block_size, model.num_local_kv_heads,
                                           cfg.head_dim, self.dtype, self.device)
        self.graphs: GraphRunner | None = None
        self.lora = None  # a workers.engine.lora.LoraManager: chunks may then name an adapter slot
        with self._lockstep():
            if followers is not None:  # they build the same cache and capture the same graphs, in step
                followers.setup(num_blocks, block_size, max_model_len, graphs)
            if graphs is not None:
                self.graphs = GraphRunner(model, self.kv_caches, block_size, max_model_len or model.max_positions,
                                          num_blocks, graphs)
                self.graphs.capture_all()
        self.lora = lora  # (after the capture: graphs run the base model only)

    @staticmethod
    def bytes_per_block(model: DecoderModel, block_size: int) -> int:
        """Cache bytes of one block on the rank that caches the most KV heads (under tensor
        parallelism a rank holds only its own heads' keys and values; every rank holds every block)."""
        cfg = model.cfg
        itemsize = next(model.parameters()).element_size()
        return 2 * cfg.num_layers * block_size * model.max_rank_kv_heads * cfg.head_dim * itemsize

    @contextmanager
    def _lockstep(self):
        """A tensor-parallel call: refused once the group failed; any exception fails the group."""
        if not self.tp.enabled:
            yield
            return
        self.tp.check()
        try:
            yield
        except BaseException as exc:
            self.tp.fail(f"rank {self.tp.rank}: {exc!r}")
            raise

    @torch.inference_mode()
    def forward(self, chunks: list[tuple[list[int], int, list[int]]], logits_last: list[int],
                hidden_layers: tuple[int, ...] = (), trees: list[list[int] | None] | None = None,
                last_from: tuple[torch.Tensor, list[int]] | None = None,
                adapters: list[int] | None = None) -> ModelOutput:
        """Run all chunks in one forward pass; logits rows come in chunk order. ``last_from``:
        (tokens [M] long on the device, rows [B]): chunk b's last token is ``tokens[rows[b]]`` where
        ``rows[b] >= 0`` (async scheduling; not under tensor parallelism, whose other ranks get the
        chunks' token ids from the host). ``adapters[b]``: chunk b's LoRA slot (-1 or None: base)."""
        if self.lora is not None:
            self.lora.set_batch(adapters or [-1] * len(chunks), [len(c) for c, _, _ in chunks])
        if last_from is not None and self.followers is not None:
            raise ValueError("device-side inputs (async scheduling) cannot reach tensor-parallel followers")
        with self._lockstep():
            if self.followers is not None:
                self.followers.forward(chunks, logits_last, hidden_layers, trees)
            return self._forward(chunks, logits_last, hidden_layers, trees, last_from)

    def _fill(self, last_from: tuple[torch.Tensor, list[int]] | None, places: list[int]
              ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(where in the flat input ids [m], the tokens that go there [m]) on the device; ``places[b]``:
        chunk b's last token's index in the step's flat (or padded) input ids."""
        if last_from is None:
            return None
        tokens, rows = last_from
        pairs = [(at, row) for at, row in zip(places, rows) if row >= 0]
        if not pairs:
            return None
        index = torch.tensor(pairs, dtype=torch.long)  # [m, 2], one copy up
        if self.device.type == "cuda":  # from pinned memory: a pageable copy may wait for the step before
            index = index.pin_memory()
        index = index.to(self.device, non_blocking=True)
        return index[:, 0], tokens.index_select(0, index[:, 1])

    def _forward(self, chunks, logits_last, hidden_layers, trees, last_from=None) -> ModelOutput:
        trees = trees or [None] * len(chunks)
        has_tree = any(t is not None for t in trees)
        if self.graphs is not None and not (self.lora is not None and self.lora.segments):  # graphs: base only
            shape = self.graphs.shape_for(chunks, logits_last, hidden_layers, trees if has_tree else None)
            if shape is not None:
                q = shape[1]  # the graph's layout: chunk b's tokens from b * q
                fill = self._fill(last_from, [b * q + len(c) - 1 for b, (c, _, _) in enumerate(chunks)])
                return self.graphs.run(chunks, shape, trees, fill)
        tokens: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables, rows = [], [], [], []
        masks = []
        for (chunk, start, table), want, tree in zip(chunks, logits_last, trees):
            first = len(tokens)
            tokens.extend(chunk)
            if tree is None:
                positions.extend(range(start, start + len(chunk)))
                masks.append(None)
            else:  # chunk = root + one token per tree node
                positions.append(start)
                positions.extend(start + d for d in tree_depths(tree))
                masks.append(ancestor_mask(tree))
            query_lens.append(len(chunk))
            context_lens.append(start + len(chunk))
            tables.append(table)
            rows.extend(range(first + len(chunk) - want, first + len(chunk)))
        meta = AttentionMetadata.build(query_lens, context_lens, tables, self.block_size, self.device,
                                       masks if has_tree else None)
        input_ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        if last_from is not None:
            ends = [at - 1 for at in itertools.accumulate(len(c) for c, _, _ in chunks)]
            fill = self._fill(last_from, ends)
            if fill is not None:
                input_ids.index_copy_(0, *fill)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        index = torch.tensor(rows, dtype=torch.long, device=self.device)
        return self.model(input_ids, pos, meta, self.kv_caches, index, hidden_layers)

    @torch.inference_mode()
    def copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Copy single cache slots src → dst ([n] long each) in every layer (accepted tree paths moved
        into place, a whole batch's at once)."""
        with self._lockstep():
            if self.followers is not None:
                self.followers.copy_slots(src.tolist(), dst.tolist())
            self._copy_slots(src, dst)

    def _copy_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for k, v in self.kv_caches:
            flat_k, flat_v = k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])
            flat_k[dst] = flat_k[src]
            flat_v[dst] = flat_v[src]

    @torch.inference_mode()
    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy whole blocks src → dst in every layer (copy-on-write after a rollback)."""
        if not pairs:
            return
        with self._lockstep():
            if self.followers is not None:
                self.followers.copy_blocks(pairs)
            self._copy_blocks(pairs)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        for k, v in self.kv_caches:
            k[dst] = k[src]
            v[dst] = v[src]
