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

__all__ = ["apply_token_bitmask", "apply_top_k_top_p", "is_greedy", "logprobs_of", "mask_tokens", "sample"]


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


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
           generators: list[torch.Generator | None]) -> torch.Tensor:
    """One token per row.

    logits [B, V] float32; temperature [B] (0 = greedy); top_k [B] long; top_p [B];
    generators: one per row (None = the global RNG). Returns tokens [B] long.
    """
    greedy = is_greedy(temperature)  # [B]
    tokens = logits.argmax(dim=-1)  # [B]
    if bool(greedy.all()):
        return tokens
    rows = (~greedy).nonzero().flatten().tolist()
    scaled = logits[rows] / temperature[rows, None]  # [R, V]
    if bool((top_k[rows] > 0).any()) or bool((top_p[rows] < 1).any()):
        scaled = apply_top_k_top_p(scaled, top_k[rows], top_p[rows])
    probs = scaled.softmax(dim=-1)  # [R, V]
    noise = torch.empty_like(probs)  # [R, V]
    for i, row in enumerate(rows):
        noise[i].exponential_(generator=generators[row])
    tokens[rows] = (probs / noise).argmax(dim=-1)
    return tokens


def mask_tokens(logits: torch.Tensor, rows: list[int], token_ids: list[list[int]]) -> torch.Tensor:
    """Forbid ``token_ids[i]`` in row ``rows[i]`` (e.g. stop tokens before min_tokens), in place.

    logits [B, V]; returns logits.
    """
    for row, ids in zip(rows, token_ids):
        if ids:
            logits[row, ids] = float("-inf")
    return logits


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
