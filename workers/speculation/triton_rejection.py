"""Triton kernel for :func:`workers.speculation.rejection.rejection_sample` (same inputs, same outputs).

One program per sequence. It walks the γ drafts in order (accept x_i if u_i·q_i(x_i) < p_i(x_i), or
if x_i is the argmax of p_i for greedy rows) and then picks the final token in one pass over the
vocabulary in BLOCK_V chunks: argmax of r / E with r = max(0, p − q) after a rejection, r = p for a
bonus token (argmax is scale-free, so r needs no normalisation), or argmax p for greedy rows.

Runs on CUDA; tests run it on CPU with ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .payloads import PAD


@triton.jit
def _argmax_row(row_ptr, V, BLOCK_V: tl.constexpr):
    """(max value, first index of it) of row_ptr[0:V]."""
    offs = tl.arange(0, BLOCK_V)
    best_v = float("-inf")
    best_i = 0
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        vals = tl.load(row_ptr + idx, mask=idx < V, other=float("-inf"))
        chunk_v = tl.max(vals, axis=0)
        chunk_i = tl.min(tl.where(vals == chunk_v, idx, V), axis=0)
        better = chunk_v > best_v
        best_i = tl.where(better, chunk_i, best_i)
        best_v = tl.where(better, chunk_v, best_v)
    return best_v, best_i


@triton.jit
def _rejection_kernel(
    target_ptr,  # [B, G+1, V] float32
    draft_tok_ptr,  # [B, G] int64
    draft_prob_ptr,  # [B, G, V] float32 (unused without HAS_DRAFT_PROBS)
    num_draft_ptr,  # [B] int64
    greedy_ptr,  # [B] int8
    unif_ptr,  # [B, G] float32
    exp_ptr,  # [B, V] float32
    out_ptr,  # [B, G+1] int64, pre-filled with PAD
    nacc_ptr,  # [B] int64
    G,
    V,
    HAS_DRAFT_PROBS: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    b = tl.program_id(0).to(tl.int64)
    nd = tl.load(num_draft_ptr + b)
    greedy = tl.load(greedy_ptr + b) != 0
    accepted = nd * 0
    alive = nd * 0 + 1
    for i in range(0, G):
        tok = tl.load(draft_tok_ptr + b * G + i)
        tok_safe = tl.maximum(tok, 0)
        row = target_ptr + (b * (G + 1) + i) * V
        p = tl.load(row + tok_safe)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_prob_ptr + (b * G + i) * V + tok_safe)
        else:
            q = 1.0
        u = tl.load(unif_ptr + b * G + i)
        _, arg = _argmax_row(row, V, BLOCK_V)
        ok = tl.where(greedy, arg == tok, u * q < p) & (i < nd) & (alive == 1)
        accepted += ok.to(tl.int64)
        alive = tl.where(ok, alive, 0)
        tl.store(out_ptr + b * (G + 1) + i, tok, mask=ok)

    rejected = accepted < nd
    kd = tl.minimum(accepted, tl.maximum(G - 1, 0))
    last_tok = tl.load(draft_tok_ptr + b * G + kd)  # G == 0: a dummy -1 (see the wrapper)
    p_row = target_ptr + (b * (G + 1) + accepted) * V
    offs = tl.arange(0, BLOCK_V)
    best_r, arg_r = float("-inf"), 0
    best_s, arg_s = float("-inf"), 0
    best_p, arg_p = float("-inf"), 0
    mass = 0.0
    for start in range(0, V, BLOCK_V):
        idx = start + offs
        m = idx < V
        p = tl.load(p_row + idx, mask=m, other=0.0)
        if HAS_DRAFT_PROBS:
            q = tl.load(draft_prob_ptr + (b * G + kd) * V + idx, mask=m, other=0.0)
        else:
            q = tl.where(idx == last_tok, 1.0, 0.0)
        r = tl.where(rejected, tl.maximum(p - q, 0.0), p)
        e = tl.load(exp_ptr + b * V + idx, mask=m, other=1.0)
        mass += tl.sum(tl.where(m, r, 0.0), axis=0)
        score_r = tl.where(m, r / e, float("-inf"))
        score_s = tl.where(m, p / e, float("-inf"))
        score_p = tl.where(m, p, float("-inf"))
        cv = tl.max(score_r, axis=0)
        ci = tl.min(tl.where(score_r == cv, idx, V), axis=0)
        arg_r = tl.where(cv > best_r, ci, arg_r)
        best_r = tl.maximum(cv, best_r)
        cv = tl.max(score_s, axis=0)
        ci = tl.min(tl.where(score_s == cv, idx, V), axis=0)
        arg_s = tl.where(cv > best_s, ci, arg_s)
        best_s = tl.maximum(cv, best_s)
        cv = tl.max(score_p, axis=0)
        ci = tl.min(tl.where(score_p == cv, idx, V), axis=0)
        arg_p = tl.where(cv > best_p, ci, arg_p)
        best_p = tl.maximum(cv, best_p)
    sampled = tl.where(mass > 0, arg_r, arg_s)  # p == q there: rejection was impossible; sample p
    final = tl.where(greedy, arg_p, sampled)
    tl.store(out_ptr + b * (G + 1) + accepted, final.to(tl.int64))
    tl.store(nacc_ptr + b, accepted)


def rejection_sample_triton(
    target_probs: torch.Tensor,  # [B, G+1, V]
    draft_tokens: torch.Tensor,  # [B, G]
    draft_probs: torch.Tensor | None,  # [B, G, V] or None
    num_draft: torch.Tensor,  # [B]
    greedy: torch.Tensor,  # [B] bool
    uniforms: torch.Tensor,  # [B, G]
    exponentials: torch.Tensor,  # [B, V]
    block_v: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`workers.speculation.rejection.rejection_sample`."""
    batch, draft_len = draft_tokens.shape
    vocab = target_probs.shape[-1]
    out = torch.full((batch, draft_len + 1), PAD, dtype=torch.long, device=target_probs.device)
    nacc = torch.zeros(batch, dtype=torch.long, device=target_probs.device)
    target = target_probs.float().contiguous()
    # With γ = 0 (or no draft probabilities) the kernel still forms pointers into these; give it
    # valid memory: one -1 token, and the target's own rows (at least V floats) for the probabilities.
    tokens = draft_tokens.long().contiguous() if draft_len else torch.full((1,), PAD, dtype=torch.long, device=target.device)
    probs = draft_probs.float().contiguous() if draft_probs is not None and draft_len else target
    _rejection_kernel[(batch,)](
        target, tokens, probs, num_draft.long().contiguous(),
        greedy.to(torch.int8).contiguous(), uniforms.float().contiguous(), exponentials.float().contiguous(),
        out, nacc, draft_len, vocab, HAS_DRAFT_PROBS=draft_probs is not None and draft_len > 0,
        BLOCK_V=min(block_v, triton.next_power_of_2(vocab)),
    )
    return out, nacc
