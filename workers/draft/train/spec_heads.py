"""Training Medusa heads and the MLP speculator (:mod:`workers.draft.spec_heads`) on self-distilled data.

A sample's ``hidden`` is the target's last hidden state per position ([T, H], after its final norm).
Chain t drafts after position t + 1: step k reads h_t and the token x_{t+k+1} (teacher-forced; the MLP
speculator reads it, Medusa does not) and predicts x_{t+k+2}. Loss: cross entropy against the
target's greedy token on reply positions, step k weighted 0.8^k (Medusa's λ_k; EAGLE-3 uses the same
decay). For Medusa with a reduced vocabulary the label is mapped into it and tokens outside it are
not counted. The same pass counts, for chains that start in a reply, the leading steps the head gets
right: its greedy acceptance length at γ = steps (teacher forcing is exact for that: a chain's step
k only counts when steps 0..k-1 were right, and then the drafted tokens are the teacher's).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..spec_heads import MedusaHead, MlpSpeculatorHead, SpecHead
from .ttt import STEP_DECAY, StepStats


def spec_head_forward(head: SpecHead, tokens: torch.Tensor, hidden: torch.Tensor, mask: torch.Tensor,
                      target_to_draft: torch.Tensor | None, steps: int) -> StepStats:
    """Loss and acceptance counts of one sequence: tokens [T] long, hidden [T, H] float, mask [T] bool;
    target_to_draft [V] long (Medusa with a token map: draft id per target token, -1 outside) or None."""
    T = tokens.shape[0]
    loss = hidden.new_zeros((), dtype=torch.float32)
    correct, counted = [], []
    alive = None
    starts = mask[2:]  # chain t drafts a reply if its first draft, x_{t+2}, is a reply token
    state = head.init_state(hidden[: max(T - 2, 0)])  # rows t = 0 .. T-3 (chains with a first label)
    for k in range(steps):
        m = T - 2 - k  # chains t < m have the label x_{t+k+2}
        if m <= 0:
            break
        prev, target, in_reply = tokens[k + 1 : k + 1 + m], tokens[k + 2 : k + 2 + m], mask[k + 2 : k + 2 + m]
        if isinstance(head, MedusaHead):
            logits = head.head_logits(state[:m], k)  # [m, draft vocab]
            labels = target if target_to_draft is None else target_to_draft[target]
        elif isinstance(head, MlpSpeculatorHead):
            state = head.stage(state[:m], prev, k)
            logits, labels = head.head[k](state).float(), target
        else:
            raise TypeError(f"cannot train a {type(head).__name__}")
        valid = (labels >= 0) & in_reply
        if bool(valid.any()):
            loss = loss + (STEP_DECAY ** k) * F.cross_entropy(logits[valid], labels[valid])
        with torch.no_grad():
            right = (logits.argmax(-1) == labels) & (labels >= 0)
            alive = right if alive is None else alive[:m] & right
            correct.append(int((alive & starts[:m]).sum()))
            counted.append(int((starts[:m] & in_reply).sum()))
    chains = int(starts.sum())
    return StepStats(loss, correct, counted, chains, sum(correct))


def build_medusa(hidden: int, vocab_size: int, num_heads: int, num_layers: int, lm_head_weight: torch.Tensor,
                 draft_ids: torch.Tensor | None) -> MedusaHead:
    """Medusa's initialisation: residual blocks at zero (identity), every LM head a copy of the
    target's (rows ``draft_ids`` for a reduced vocabulary), so each head starts as the target's own
    next-token guess."""
    head = MedusaHead(hidden, vocab_size, num_heads, num_layers, bias=True,
                      token_map=None if draft_ids is None else draft_ids)
    rows = lm_head_weight if draft_ids is None else lm_head_weight[draft_ids]
    with torch.no_grad():
        for block in head.blocks:
            for layer in block.layers:
                layer.weight.zero_()
                layer.bias.zero_()
        for lm in head.lm_heads:
            lm.weight.copy_(rows)
    return head


def build_mlp(hidden: int, inner: int, vocab_size: int, n_predict: int, embed_weight: torch.Tensor, seed: int,
              tie_weights: bool = True,
              scale_input: bool = True) -> MlpSpeculatorHead:
    """IBM's initialisation (N(0, 1/√inner) for every matrix, unit norms), except that with
    inner = hidden the token embeddings start as the target's. The heads do not start as the
    target's LM head: they read GELU(LN(·)) states, not the target's normed hidden states, and a
    copy starts far worse than chance (cross entropy ≈ 26 nats per step on SmolLM2 against ≈ 11 for
    IBM's initialisation) and spends the whole of a small run recovering."""
    torch.manual_seed(seed)
    head = MlpSpeculatorHead(hidden, inner, vocab_size, n_predict, tie_weights, scale_input)
    with torch.no_grad():
        for p in head.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 1 / inner ** 0.5)
        if inner == hidden:
            for emb in head.emb:
                emb.weight.copy_(embed_weight)
    return head
