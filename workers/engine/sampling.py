"""Sampling as pure tensor functions; every tensor argument carries its shape in a comment.

Rules: temperature 0 is greedy (argmax, no randomness). Otherwise logits are divided by the
temperature, then top-k keeps the k largest (0 = off), then top-p keeps the smallest set of
tokens whose probability reaches p (the most likely token always stays), and a token is drawn
from the renormalised distribution. A row with its own ``torch.Generator`` draws only from it, so
a seeded request samples the same tokens whatever else shares its batch: the draw is
``argmax(p / E)`` with E ~ Exponential(1) i.i.d. per token, which picks token i with probability p_i.
"""

from __future__ import annotations

import numpy as np
import torch

from runtime.messages import is_greedy

__all__ = ["apply_token_bitmask", "apply_top_k_top_p", "argmax_rows", "exponentials", "is_greedy", "logprobs_of",
           "sample", "temper", "uniforms"]

ARGMAX_BLOCK = 128  # vocabularies are padded to multiples of 64 or 128 (32000, 49152, 128256, 151936)


def argmax_rows(scores: torch.Tensor) -> torch.Tensor:
    """scores [R, V] -> [R] long, exactly ``scores.argmax(-1)`` (the first index of a row's maximum;
    NaN counts as the maximum, as there). On a CPU, torch's argmax over a long row runs several times
    slower than its max (it tracks an index per element), so rows of a vocabulary are split into
    blocks of 128: the first block holding the row's maximum (the argmax of the blocks' maxima), then
    the first maximum within it. A 5-row verify or a batch of 8 takes 30–40 µs instead of 170–190 µs
    over 49,152 tokens (2 threads, the 2-core VM). A single row, a CUDA tensor or an odd vocabulary
    takes torch's argmax."""
    rows, vocab = scores.shape
    if (scores.device.type != "cpu" or rows < 2 or vocab % ARGMAX_BLOCK or vocab < 32 * ARGMAX_BLOCK
            or not scores.is_contiguous()):
        return scores.argmax(dim=-1)
    blocks = scores.view(rows, vocab // ARGMAX_BLOCK, ARGMAX_BLOCK)  # [R, V/B, B]
    block = blocks.amax(dim=-1).argmax(dim=-1)  # [R] the first block holding the row's maximum
    within = blocks[torch.arange(rows), block].argmax(dim=-1)  # [R]
    return block * ARGMAX_BLOCK + within


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Mask (to -inf) tokens outside each row's top-k / nucleus.

    logits [B, V] float; top_k [B] long (0 = keep all); top_p [B] float in (0, 1]. Returns [B, V].
    """
    sorted_logits, order = logits.sort(dim=-1, descending=True)  # [B, V]
    vocab = logits.shape[-1]
    k = torch.where(top_k > 0, top_k.clamp(max=vocab), torch.full_like(top_k, vocab))  # [B]
    ranks = torch.arange(vocab, device=logits.device)[None, :]  # [1, V]
    remove = ranks >= k[:, None]  # [B, V]
    probs = sorted_logits.masked_fill(remove, float("-inf")).softmax(dim=-1)  # [B, V]
    before = probs.cumsum(dim=-1) - probs  # [B, V] mass of strictly more likely tokens
    remove |= before >= top_p[:, None]  # rank 0 has before == 0 < top_p: never removed
    sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def temper(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           min_p: torch.Tensor | None = None) -> torch.Tensor:
    """Scores of sampled rows: logits / temperature, then min_p, then top-k and top-p (-inf outside).

    logits [S, V] float; temperature [S] (> 0); top_k [S] long (0 = off); top_p [S] in (0, 1];
    min_p [S] in [0, 1] or None (off). Returns [S, V]; softmax of a row is its distribution. The
    parameters may be CPU tensors for device logits: which steps run is decided on the host (no
    device sync), then they move to the logits' device.
    """
    device = logits.device
    use_min_p = min_p is not None and bool((min_p > 0).any())
    truncate = bool((top_k > 0).any()) or bool((top_p < 1).any())
    scores = logits / temperature.to(device, non_blocking=True)[:, None]
    if use_min_p:
        probs = scores.softmax(-1)
        floor = min_p.to(device, non_blocking=True)[:, None] * probs.amax(-1, keepdim=True)
        scores = scores.masked_fill(probs < floor, float("-inf"))
    if truncate:
        scores = apply_top_k_top_p(scores, top_k.to(device, non_blocking=True), top_p.to(device, non_blocking=True))
    return scores


def exponentials(rows: int, vocab: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[rows, vocab] Exp(1) draws: seeded rows from their own generator, the rest in one draw."""
    out = torch.empty(rows, vocab, device=device)
    free = [i for i, g in enumerate(generators) if g is None]
    if len(free) == rows:
        return out.exponential_()
    if free:
        out[free] = torch.empty(len(free), vocab, device=device).exponential_()
    for i, gen in enumerate(generators):
        if gen is not None:
            out[i].exponential_(generator=gen)
    return out


def uniforms(rows: int, width: int, generators: list[torch.Generator | None], device) -> torch.Tensor:
    """[rows, width] U[0, 1) draws: seeded rows from their own generator, the rest in one draw."""
    out = torch.empty(rows, width, device=device)
    if all(g is None for g in generators):
        return out.uniform_()
    for i, gen in enumerate(generators):
        out[i].uniform_(generator=gen)
    return out


def sample(scores: torch.Tensor, greedy: list[bool], generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row.

    scores [B, V] float32 from :func:`workers.engine.logits.process` (or :func:`temper`); greedy: per
    row, argmax instead of a draw; generators: one per row (None = the global RNG). Returns tokens
    [B] long.
    """
    tokens = argmax_rows(scores)  # [B]
    rows = [i for i, g in enumerate(greedy) if not g]
    if not rows:
        return tokens
    probs = (scores if len(rows) == len(greedy) else scores[rows]).softmax(dim=-1)  # [R, V]
    noise = exponentials(len(rows), scores.shape[-1], [generators[i] for i in rows], scores.device)
    drawn = argmax_rows(probs / noise)
    if len(rows) == len(greedy):
        return drawn
    tokens[rows] = drawn
    return tokens


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int] | None = None) -> torch.Tensor:
    """Forbid (-inf) every token whose bit is 0, in place: a grammar's mask (see :mod:`.grammar`).

    logits [B, V] float; bitmask [R, W] int32 on the CPU with 32·W >= V, bit j of word w for token
    32·w + j; rows: the R rows of ``logits`` the masks belong to (None: all B, R == B). Returns logits.
    """
    vocab = logits.shape[-1]
    if logits.is_cuda:  # unpacked on the device: only the packed words travel
        bits = torch.arange(32, dtype=torch.int32, device=logits.device)  # [32]
        words = bitmask.to(logits.device, non_blocking=True)  # [R, W]
        forbidden = ((words[:, :, None] >> bits) & 1).flatten(1)[:, :vocab] == 0  # [R, V]
    else:  # numpy's unpackbits is several times faster than the shifts on a CPU (little-endian words)
        unpacked = np.unpackbits(bitmask.numpy().view(np.uint8), axis=-1, bitorder="little")  # [R, 32·W]
        forbidden = torch.from_numpy(unpacked[:, :vocab]) == 0  # [R, V]
    if rows is None:
        logits.masked_fill_(forbidden, float("-inf"))
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].masked_fill(forbidden, float("-inf"))
    return logits


def logprobs_of(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Log-probabilities of the model's raw distribution (before temperature / top-k / top-p).

    logits [B, V]; tokens [B]. Returns (chosen [B], top_ids [B, k], top_logprobs [B, k]).
    """
    logp = logits.float().log_softmax(dim=-1)  # [B, V]
    chosen = logp.gather(-1, tokens[:, None])[:, 0]  # [B]
    top_vals, top_ids = logp.topk(k, dim=-1) if k > 0 else (logp[:, :0], tokens[:, None][:, :0])
    return chosen, top_ids, top_vals
