"""EAGLE-3 training with training-time test (Li et al., arXiv 2503.01840), as pure tensor functions
over one sequence, on the parameters of :class:`workers.draft.eagle.Eagle3Head`.

Notation: tokens x_0..x_{T-1}; g_t = the target's three hidden states at position t (concatenated);
chain t drafts after position t. Step 0 of chain t sits at position t and reads the pair
(x_{t+1}, f_t = fc(g_t)); step k sits at position t+k and reads (x_{t+k+1}, o^{k-1}_t), the head's own
output of step k-1 (teacher-forced tokens, drafted features — what the head sees when it drafts).
Step k of chain t predicts x_{t+k+2}.

Attention at step k, as at inference: the query of chain t sees the step-0 keys of positions
u ≤ t (computed from target features, like the committed prefix of the cache) and the keys of
its own chain's steps 1..k (the drafted tail) — the diagonal of each step's keys:

    scores = [ q_k · K_0ᵀ (masked to u ≤ t)  |  q_k · K_j[t] for j = 1..k ]      [m, heads, T' + k]

Loss: cross entropy against the target's greedy token (self-distilled replies are the target's
argmax), mapped into the draft vocabulary; tokens outside it and positions outside the replies are
not counted; step k weighs 0.8^k (EAGLE-3). The same pass counts, for chains that start in a
reply, how many leading steps the head gets right: the greedy acceptance length it would reach.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..eagle import Eagle3Head

STEP_DECAY = 0.8


@dataclass
class StepStats:
    loss: torch.Tensor  # scalar, weighted over steps (with grad)
    correct: list[int]  # per step: chains whose step-k token was right (and all before it)
    counted: list[int]  # per step: chains that have a label at step k
    chains: int  # chains that start in a reply (acceptance length denominator)
    accepted: int  # Σ over those chains of leading correct steps


def _attention(head: Eagle3Head, x: torch.Tensor, positions: torch.Tensor, cache: list, prefix: torch.Tensor,
               step: int) -> torch.Tensor:
    """One step's attention for all chains. x [m, 2H]; cache: per earlier step (K, V) [n_j, Hkv, D]."""
    attn = head.midlayer.self_attn
    cfg = head.cfg
    m, h, hkv, d = x.shape[0], cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    qkv = attn.qkv_proj(x).view(m, h + 2 * hkv, d)
    q, k, v = qkv.split([h, hkv, hkv], dim=1)
    q = head.rotary.rotate(positions, q)
    k = head.rotary.rotate(positions, k)
    cache.append((k, v))
    group = h // hkv
    qg = q.view(m, hkv, group, d) * attn.scale  # [m, Hkv, G, D]
    k0, v0 = cache[0]  # step-0 keys of positions 0..n0-1
    s0 = torch.einsum("mkgd,nkd->mkgn", qg, k0)  # [m, Hkv, G, n0]
    s0 = s0.masked_fill(~prefix[:, None, None, :], float("-inf"))
    diag_k = [kj[:m] for kj, _ in cache[1:]]  # steps 1..step: chain t's own keys
    diag_v = [vj[:m] for _, vj in cache[1:]]
    if diag_k:
        sd = torch.stack([torch.einsum("mkgd,mkd->mkg", qg, kj) for kj in diag_k], dim=-1)  # [m, Hkv, G, step]
        p = torch.cat([s0, sd], dim=-1).softmax(-1)
        o = torch.einsum("mkgn,nkd->mkgd", p[..., : s0.shape[-1]], v0)
        o = o + torch.einsum("mkgj,jmkd->mkgd", p[..., s0.shape[-1] :], torch.stack(diag_v))
    else:
        o = torch.einsum("mkgn,nkd->mkgd", s0.softmax(-1), v0)
    return attn.o_proj(o.reshape(m, h * d))


def _step(head: Eagle3Head, embeds: torch.Tensor, features: torch.Tensor, positions: torch.Tensor, cache: list,
          prefix: torch.Tensor, step: int) -> torch.Tensor:
    """The midlayer on m chains: embeds, features [m, H] → the next features [m, H] (before the norm)."""
    layer = head.midlayer
    normed = layer.hidden_norm(features)
    residual = normed if layer.norm_before_residual else features
    x = torch.cat((layer.input_layernorm(embeds), normed), dim=-1)
    x = _attention(head, x, positions, cache, prefix, step) + residual
    return x + layer.mlp(layer.post_attention_layernorm(x))


def step_features(head: Eagle3Head, embed: torch.nn.Embedding, tokens: torch.Tensor, hidden: torch.Tensor,
                  steps: int) -> list[torch.Tensor]:
    """The head's output features per step: step k gives [T-1-k, H], row t = chain t at position t+k."""
    T = tokens.shape[0]
    n0 = T - 1
    features = head.project([hidden[:n0]])  # [n0, H]
    embeds = embed(tokens)  # [T, H]
    positions = torch.arange(T, device=tokens.device)
    prefix = positions[:n0][None, :] <= positions[:n0][:, None]  # [n0, n0]: u <= t
    cache: list = []
    outs = []
    for k in range(steps):
        m = n0 - k  # chains with a step k
        if m <= 1:
            break
        features = _step(head, embeds[k + 1 : k + 1 + m], features[:m], positions[k : k + m], cache, prefix[:m], k)
        outs.append(features)
    return outs


def ttt_forward(head: Eagle3Head, embed: torch.nn.Embedding, tokens: torch.Tensor, hidden: torch.Tensor,
                mask: torch.Tensor, target_to_draft: torch.Tensor, steps: int) -> StepStats:
    """Loss and acceptance counts of one sequence.

    tokens [T] long; hidden [T, 3·H_target] float; mask [T] bool (reply tokens);
    target_to_draft [V] long (draft id of each target token, -1 outside the draft vocabulary).
    """
    T = tokens.shape[0]
    n0 = T - 1  # chains 0..T-2 (chain t reads x_{t+1})
    loss = tokens.new_zeros((), dtype=torch.float32)
    correct, counted = [], []
    alive = None  # chains whose steps so far were all right
    starts = mask[2:]  # [T-2]: chain t drafts a reply if its first draft, x_{t+2}, is a reply token
    for k, out in enumerate(step_features(head, embed, tokens, hidden, steps)):
        m = out.shape[0]
        # chain t at step k predicts x_{t+k+2}: labels exist for t < T-k-2 = m-1
        logits = head.lm_head(head.norm(out[: m - 1]))  # [m-1, draft vocab]
        target = tokens[k + 2 : k + 1 + m]  # [m-1]
        labels = target_to_draft[target]
        valid = (labels >= 0) & mask[k + 2 : k + 1 + m]
        if bool(valid.any()):
            ce = F.cross_entropy(logits[valid], labels[valid])
            loss = loss + (STEP_DECAY ** k) * ce
        with torch.no_grad():
            right = (logits.argmax(-1) == labels) & (labels >= 0)
            alive = right if alive is None else alive[: m - 1] & right
            chain_ok = alive & starts[: m - 1]
            correct.append(int(chain_ok.sum()))
            counted.append(int((starts[: m - 1] & mask[k + 2 : k + 1 + m]).sum()))  # chains with a step-k label
    chains = int(starts.sum())
    return StepStats(loss, correct, counted, chains, sum(correct))


def draft_vocabulary(counts: torch.Tensor, size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The ``size`` most frequent target tokens (ties: lower id), sorted.

    counts [V] → (draft_ids [size] long, d2t [size] long with target = draft + d2t[draft],
    t2d [V] bool)."""
    size = min(size, counts.shape[0])
    order = sorted(range(counts.shape[0]), key=lambda i: (-int(counts[i]), i))[:size]
    draft_ids = torch.tensor(sorted(order), dtype=torch.long)
    d2t = draft_ids - torch.arange(size)
    t2d = torch.zeros(counts.shape[0], dtype=torch.bool)
    t2d[draft_ids] = True
    return draft_ids, d2t, t2d


def coverage_order(counts: torch.Tensor) -> torch.Tensor:
    """Target ids from most to least frequent in ``counts`` (ties: lower id), the order
    :func:`draft_vocabulary` takes them in."""
    return torch.sort(-counts.long(), stable=True).indices


def coverage_curve(counts: torch.Tensor, held_counts: torch.Tensor, sizes) -> dict[int, float]:
    """Share of the held-out tokens ``held_counts`` [V] that the draft vocabulary of each size in
    ``sizes``, chosen from ``counts`` [V], holds."""
    total = int(held_counts.sum())
    cum = held_counts[coverage_order(counts)].double().cumsum(0)
    return {int(n): (float(cum[min(int(n), cum.shape[0]) - 1]) / total if total else 0.0) for n in sizes}


def size_for_coverage(counts: torch.Tensor, held_counts: torch.Tensor, coverage: float, cap: int,
                      multiple: int = 64) -> int:
    """The smallest draft vocabulary (a multiple of ``multiple``, at most ``cap``) whose tokens, the
    most frequent of ``counts``, hold at least ``coverage`` of the held-out tokens ``held_counts``."""
    if not 0 < coverage <= 1:
        raise ValueError(f"coverage must be in (0, 1], got {coverage}")
    total = int(held_counts.sum())
    if total == 0:
        raise ValueError("no held-out tokens to size the draft vocabulary on")
    cum = held_counts[coverage_order(counts)].double().cumsum(0) / total
    reached = torch.nonzero(cum >= coverage - 1e-12)
    if reached.numel() == 0:
        return min(cap, counts.shape[0])
    n = int(reached[0]) + 1
    return min(cap, -(-n // multiple) * multiple, counts.shape[0])
