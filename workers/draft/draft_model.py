"""Drafting with a smaller language model of the target's tokenizer, on the engine's paged KV cache.

Each sequence keeps one token list: the ``committed`` tokens the target confirmed, followed by a
speculative tail the draft generated (with the distribution each tail token was drawn from). KV is
computed for a prefix of that list. A verdict keeps the longest prefix of the tail that matches
what the target emitted and rolls the rest back (blocks truncated). A proposal reuses tail tokens
that are still consistent, which is how drafting ahead pays off: :meth:`predraft` extends the tail
while the target verifies, assuming every draft (and the draft's own guess of the bonus token) is
accepted; if that assumption holds, the next proposal is ready without any model call.

Sampled drafts come from q = softmax(logits / T) restricted to its top ``max_support`` tokens (and
the request's top_k), renormalised; that exact q travels with the proposal, so the target's
rejection test stays exact. Greedy requests draft greedily and send no distributions.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch

from ..engine.block_manager import BlockManager
from ..engine.model import DecoderModel
from ..engine.model_runner import ModelRunner
from .proposer import DraftInput, DraftOutput, SamplingSpec, SparseDist, VerifyResult, grow_blocks, sample_draft

log = logging.getLogger(__name__)


@dataclass
class _Seq:
    tokens: list[int] = field(default_factory=list)  # committed + speculative tail
    committed: int = 0
    computed: int = 0  # tokens[:computed] have KV in the cache
    blocks: list[int] = field(default_factory=list)
    dists: list[SparseDist | None] = field(default_factory=list)  # one per tail token
    sampling: SamplingSpec = SamplingSpec()
    generator: torch.Generator | None = None

    @property
    def tail(self) -> list[int]:
        return self.tokens[self.committed :]


class DraftModelProposer:
    """A draft LM with its own paged KV cache and rollback."""

    method = "draft_model"
    hidden_layers: list[int] = []

    def __init__(self, model: DecoderModel, num_blocks: int, block_size: int = 16, max_support: int = 64):
        self.model = model
        self.runner = ModelRunner(model, num_blocks, block_size)
        self.blocks = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.block_size = block_size
        self.max_support = max_support
        self.max_len = model.max_positions
        self._seqs: dict[str, _Seq] = {}
        self.forward_calls = 0

    # ------------------------------------------------------------------ protocol

    def propose(self, batch: list[DraftInput]) -> list[DraftOutput]:
        for item in batch:
            seq = self._seqs.get(item.seq_id)
            if seq is None:
                seq = self._seqs[item.seq_id] = _Seq(sampling=item.sampling)
                if item.sampling.seed is not None:
                    seq.generator = torch.Generator().manual_seed(item.sampling.seed)
            seq.sampling = item.sampling
            if item.new_tokens:
                self._rollback(seq, seq.committed)
                seq.tokens.extend(item.new_tokens)
                seq.committed = len(seq.tokens)
        wanted = {item.seq_id: item.num_tokens for item in batch}
        self._extend(wanted)
        out = []
        for item in batch:
            seq = self._seqs[item.seq_id]
            n = min(item.num_tokens, len(seq.tail))
            dists = [] if seq.sampling.greedy else [d for d in seq.dists[:n]]
            out.append(DraftOutput(item.seq_id, item.round, seq.tail[:n], dists))
        return out

    def predraft(self, seq_ids: list[str], num_tokens: int) -> None:
        """Extend the tails of ``seq_ids`` to ``num_tokens`` tokens, ahead of the next request."""
        self._extend({s: num_tokens for s in seq_ids if s in self._seqs})

    def verified(self, results: list[VerifyResult]) -> None:
        for result in results:
            seq = self._seqs.get(result.seq_id)
            if seq is None:
                continue
            tail, emitted = seq.tail, result.emitted_tokens
            same = 0
            while same < min(len(tail), len(emitted)) and tail[same] == emitted[same]:
                same += 1
            if same == len(emitted):  # the tail continues what the target emitted: keep the rest
                seq.committed += same
                seq.dists = seq.dists[same:]
                continue
            self._rollback(seq, seq.committed + same)
            seq.tokens.extend(emitted[same:])
            seq.committed = len(seq.tokens)

    def release(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            seq = self._seqs.pop(seq_id, None)
            if seq is not None and seq.blocks:
                self.blocks.free(seq.blocks)

    def __len__(self) -> int:
        return len(self._seqs)

    # ------------------------------------------------------------------ internals

    def _rollback(self, seq: _Seq, length: int) -> None:
        """Drop tokens (and their KV) past ``length``."""
        del seq.tokens[length:]
        seq.dists = seq.dists[: max(0, length - seq.committed)]
        if seq.computed > length:
            seq.computed = length
            copies = self.blocks.truncate(seq.blocks, length)
            self.runner.copy_blocks(copies)


    def _extend(self, wanted: dict[str, int]) -> None:
        """Generate until every listed sequence has the wanted number of tail tokens (batched)."""
        while True:
            active = [(sid, self._seqs[sid]) for sid, n in wanted.items()
                      if len(self._seqs[sid].tail) < n and len(self._seqs[sid].tokens) < self.max_len - 1]
            ready = []
            for sid, seq in active:
                if not seq.tokens:
                    wanted[sid] = 0
                    continue
                seq.computed = min(seq.computed, len(seq.tokens) - 1)  # something to run
                # The last token's KV is computed in the same pass that samples the next token.
                if grow_blocks(self.blocks, seq.blocks, len(seq.tokens)):
                    ready.append(seq)
                else:
                    log.warning("draft KV cache full: no proposal for %s this round", sid)
                    wanted[sid] = 0
            if not ready:
                return
            chunks = [(seq.tokens[seq.computed :], seq.computed, seq.blocks) for seq in ready]
            out = self.runner.forward(chunks, [1] * len(ready))
            self.forward_calls += 1
            for seq, logits in zip(ready, out.logits):
                seq.computed = len(seq.tokens)
                token, dist = sample_draft(logits, seq.sampling, seq.generator, self.max_support)
                seq.tokens.append(token)
                seq.dists.append(dist)
