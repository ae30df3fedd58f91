"""Lossless speculative rejection sampling, as pure tensor functions.

Speculative sampling (Leviathan et al., arXiv 2211.17192; Chen et al., arXiv 2302.01318). For one
sequence with draft tokens x_1..x_γ drawn from draft distributions q_1..q_γ, and target
distributions p_1..p_{γ+1} from ONE forward pass over the γ+1 positions:

- accepted tokens: for i = 1..γ, accept x_i with probability min(1, p_i(x_i) / q_i(x_i)); stop at the
  first rejection.
- recovered token: at the first rejected position i, emit a sample of normalize(max(0, p_i − q_i)).
- bonus token: if all γ are accepted, emit a sample of p_{γ+1}.

Every emitted token is then distributed exactly as the target alone would sample it. A draft that
sends no distribution is treated as one-hot on its token (q_i(x_i) = 1), which makes the rule
"accept with probability p_i(x_i), else sample p_i with x_i removed". Greedy rows (temperature 0)
use the exact-match rule: accept while x_i == argmax p_i, then emit argmax of the next p.

Randomness comes in as tensors (``uniforms`` for the accept tests, ``exponentials`` for sampling by
the exponential race argmax(p / E), E ~ Exp(1); only one token per row is ever sampled, so one
[V] draw per row suffices), so callers control seeds per request and tests can
replay draws.
"""

from __future__ import annotations

import torch

from .payloads import PAD  # marks positions after the last emitted token


def sparse_to_dense(ids: torch.Tensor, probs: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Scatter sparse distributions into dense ones.

    ids, probs: [..., k] (ids < 0 are padding)  ->  [..., vocab_size]
    """
    dense = torch.zeros(*ids.shape[:-1], vocab_size, dtype=probs.dtype, device=probs.device)
    valid = ids >= 0
    dense.scatter_add_(-1, ids.clamp(min=0), torch.where(valid, probs, torch.zeros_like(probs)))
    return dense


def rejection_sample(
    target_probs: torch.Tensor,  # [B, G+1, V] float, the target's sampling distributions
    draft_tokens: torch.Tensor,  # [B, G] int64, padded with PAD past num_draft
    draft_probs: torch.Tensor | None,  # [B, G, V] float, or None: every draft is one-hot
    num_draft: torch.Tensor,  # [B] int64, γ of each row (0..G)
    greedy: torch.Tensor,  # [B] bool, rows sampled at temperature 0
    uniforms: torch.Tensor,  # [B, G] float in [0, 1)
    exponentials: torch.Tensor,  # [B, V] float, Exp(1) draws for the one final token of each row
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, G+1] with PAD after the last emitted one, num_accepted [B]).

    Row b emits num_accepted[b] + 1 tokens: the accepted drafts, then one recovered or bonus token.
    """
    batch, draft_len = draft_tokens.shape
    positions = torch.arange(draft_len, device=draft_tokens.device)
    valid = positions[None, :] < num_draft[:, None]  # [B, G]
    safe_tokens = draft_tokens.clamp(min=0)

    p_tok = target_probs[:, :draft_len].gather(-1, safe_tokens[..., None]).squeeze(-1)  # [B, G]
    if draft_probs is None:
        q_tok = torch.ones_like(p_tok)
    else:
        q_tok = draft_probs.gather(-1, safe_tokens[..., None]).squeeze(-1)  # [B, G]
    # u < p/q, written without division: p = q = 0 rejects (no NaN); q = 0 < p accepts, the min(1, p/q) limit.
    accept_sampled = uniforms * q_tok < p_tok
    accept_greedy = draft_tokens == target_probs[:, :draft_len].argmax(-1)
    accept = torch.where(greedy[:, None], accept_greedy, accept_sampled) & valid
    num_accepted = accept.long().cumprod(-1).sum(-1)  # [B]: length of the accepted prefix

    # The distribution of the final token at position k = num_accepted.
    rows = torch.arange(batch, device=draft_tokens.device)
    p_final = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < num_draft  # [B]: the final token is recovered, not a bonus
    k_draft = num_accepted.clamp(max=max(draft_len - 1, 0))
    if draft_len == 0:
        residual = p_final
    else:
        if draft_probs is None:
            q_final = torch.zeros_like(p_final)
            q_final[rows, safe_tokens[rows, k_draft]] = 1.0
        else:
            q_final = draft_probs[rows, k_draft]
        residual = (p_final - q_final).clamp(min=0)
        # p == q at that position makes rejection impossible; guard the 0/0 anyway.
        mass = residual.sum(-1, keepdim=True)
        residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_final)
    final_dist = torch.where(rejected[:, None], residual, p_final)  # [B, V]

    race = final_dist / exponentials
    final_sampled = race.argmax(-1)
    final_greedy = p_final.argmax(-1)
    final = torch.where(greedy, final_greedy, final_sampled)  # [B]

    out = torch.full((batch, draft_len + 1), PAD, dtype=torch.long, device=draft_tokens.device)
    keep = torch.arange(draft_len + 1, device=draft_tokens.device)[None, :] < num_accepted[:, None]
    out[:, :draft_len] = torch.where(keep[:, :draft_len], draft_tokens, torch.full_like(draft_tokens, PAD))
    out[rows, num_accepted] = final
    return out, num_accepted


def random_inputs(
    batch: int, draft_len: int, vocab: int, generators: list[torch.Generator | None] | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Uniforms [B, G] and exponentials [B, V], drawn per row from that row's generator."""
    uniforms = torch.empty(batch, draft_len)
    exponentials = torch.empty(batch, vocab)
    for b in range(batch):
        gen = generators[b] if generators else None
        uniforms[b].uniform_(generator=gen)
        exponentials[b].exponential_(generator=gen)
    return uniforms, exponentials
