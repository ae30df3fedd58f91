"""Lossless rejection sampling over a token tree, as pure tensor functions.

The recursive multi-candidate rule (SpecInfer, Miao et al., arXiv 2305.09781; EAGLE, Li et al.,
arXiv 2401.15077; Recursive Speculative Decoding, Jeon et al., arXiv 2402.14160). The target scores
every node of the tree in ONE forward pass; p_n is its distribution after node n (node 0 = the root,
the last committed token; node i + 1 = draft token i, see :mod:`.tree`). Starting at the root with
residual r = p_root, and for a node whose children carry tokens x_1..x_k drawn from q_1..q_k:

- accepted token: try the children in index order; accept x_j with probability min(1, r(x_j) / q_j(x_j)),
  then move to that child with r = p_child and repeat one level deeper.
- rejected child: r ← normalize(max(0, r − q_j)), and try the next sibling with that residual.
- final token: when no child of the current node is accepted (or it has none), emit a sample of r —
  the residual after every rejected sibling (the recovered token), or p_node itself at a leaf (the
  bonus token).

Every emitted token is then distributed exactly as the target alone would sample it, provided each
q_j is the distribution x_j really was drawn from given the prefix and its earlier siblings:

- siblings drawn i.i.d. from q (with replacement; tokens may repeat): every q_j = q;
- siblings drawn without replacement: q_j = q with x_1..x_{j-1} removed and renormalized;
- deterministic candidates (e.g. the draft's top-k): q_j is one-hot on x_j, which is what
  ``draft_probs=None`` means — "accept with probability r(x_j), else remove x_j from r".

With one child per node this is exactly :func:`~.rejection.rejection_sample` on a chain. Greedy rows
(temperature 0) accept the first child whose token equals argmax p_node, then emit argmax of the p of
the node they stop at.

Randomness comes in as tensors, as in :mod:`.rejection`: one uniform per node for its accept test and
one [V] Exp(1) draw per row for the final token, sampled by the exponential race argmax(r / E);
:func:`~.rejection.random_inputs` (batch, N, vocab) draws both.
"""

from __future__ import annotations

import torch

from .payloads import PAD  # marks positions after the last emitted token


def child_table(parent_nodes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Children of every node, in the order tried, and the depth of every node.

    parent_nodes: [B, N] (parent node of node i + 1, -1 past a row's tokens)
      ->  children [B, N+1, K] node indices (-1 where a node has fewer than K children; K = the most
          children of any node), depth [B, N+1] (0 for the root and for nodes past a row's tokens)
    """
    batch, num_tokens = parent_nodes.shape
    device = parent_nodes.device
    valid = parent_nodes >= 0  # [B, N]
    parent = parent_nodes.clamp(min=0)
    rank = torch.zeros(batch, num_tokens, dtype=torch.long, device=device)  # [B, N]: index among siblings
    seen = torch.zeros(batch, num_tokens + 1, dtype=torch.long, device=device)  # children counted so far
    depth = torch.zeros(batch, num_tokens + 1, dtype=torch.long, device=device)
    for i in range(num_tokens):  # topological order: a parent's depth is known before its children's
        rank[:, i] = seen.gather(1, parent[:, i : i + 1]).squeeze(1)
        seen.scatter_add_(1, parent[:, i : i + 1], valid[:, i : i + 1].long())
        depth[:, i + 1] = torch.where(valid[:, i], depth.gather(1, parent[:, i : i + 1]).squeeze(1) + 1, 0)
    width = int(seen.max()) if num_tokens else 0
    children = torch.full((batch, num_tokens + 1, width), -1, dtype=torch.long, device=device)
    b, i = valid.nonzero(as_tuple=True)
    children[b, parent[b, i], rank[b, i]] = i + 1
    return children, depth


def tree_rejection_sample(
    target_probs: torch.Tensor,  # [B, N+1, V] float, the target's distribution after each node
    draft_tokens: torch.Tensor,  # [B, N] int64, padded with PAD past each row's tokens
    parent_nodes: torch.Tensor,  # [B, N] int64, parent node of node i + 1 (0 = root), -1 past a row's tokens
    draft_probs: torch.Tensor | None,  # [B, N, V] float (given the earlier siblings), or None: every draft one-hot
    greedy: torch.Tensor,  # [B] bool, rows sampled at temperature 0
    uniforms: torch.Tensor,  # [B, N] float in [0, 1), one per node's accept test
    exponentials: torch.Tensor,  # [B, V] float, Exp(1) draws for the one final token of each row
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns (tokens [B, D+1] with PAD after the last emitted one, path [B, D], num_accepted [B]).

    D is the greatest depth of any tree in the batch. Row b emits num_accepted[b] + 1 tokens: the
    accepted drafts along one root-to-node path, then one recovered or bonus token. ``path`` holds the
    accepted draft token indices (0-based, node - 1) in order, PAD after them.
    """
    batch, num_tokens = draft_tokens.shape
    vocab = target_probs.shape[-1]
    device = draft_tokens.device
    rows = torch.arange(batch, device=device)
    children, depth = child_table(parent_nodes)  # [B, N+1, K], [B, N+1]
    max_depth = int(depth.max())
    safe_tokens = draft_tokens.clamp(min=0)

    cur = torch.zeros(batch, dtype=torch.long, device=device)  # [B]: node reached so far
    residual = target_probs[:, 0]  # [B, V]: r, the distribution the final token would be drawn from
    descending = torch.ones(batch, dtype=torch.bool, device=device)  # no sibling group exhausted yet
    path = torch.full((batch, max_depth), PAD, dtype=torch.long, device=device)
    for level in range(max_depth):
        best = target_probs[rows, cur].argmax(-1)  # [B]: the greedy rows' choice at this node
        moved = torch.zeros(batch, dtype=torch.bool, device=device)
        for k in range(children.shape[-1]):
            node = children[rows, cur, k]  # [B]
            trying = descending & ~moved & (node > 0)
            tok = (node - 1).clamp(min=0)  # [B]: draft token index of the child tried
            x = safe_tokens[rows, tok]  # [B]
            if draft_probs is None:
                q = torch.nn.functional.one_hot(x, vocab).to(residual.dtype)
            else:
                q = draft_probs[rows, tok]  # [B, V]
            q_x = q.gather(-1, x[:, None]).squeeze(-1)
            r_x = residual.gather(-1, x[:, None]).squeeze(-1)
            # u < r/q, written without division so r = q = 0 rejects instead of comparing with NaN.
            accept_sampled = uniforms[rows, tok] * q_x < r_x
            accept = trying & torch.where(greedy, x == best, accept_sampled)
            rejected = trying & ~accept & ~greedy

            # r ← normalize(max(0, r − q)); r == q makes rejection impossible, guard the 0/0 anyway.
            left = (residual - q).clamp(min=0)
            mass = left.sum(-1, keepdim=True)
            left = torch.where(mass > 0, left / mass.clamp(min=1e-30), residual)
            residual = torch.where(rejected[:, None], left, residual)
            residual = torch.where(accept[:, None], target_probs[rows, node.clamp(min=0)], residual)
            cur = torch.where(accept, node, cur)
            path[:, level] = torch.where(accept, tok, path[:, level])
            moved |= accept
        descending &= moved
    num_accepted = (path >= 0).sum(-1)  # [B]

    final_sampled = (residual / exponentials).argmax(-1)
    final_greedy = target_probs[rows, cur].argmax(-1)
    final = torch.where(greedy, final_greedy, final_sampled)  # [B]

    out = torch.full((batch, max_depth + 1), PAD, dtype=torch.long, device=device)
    out[:, :max_depth] = torch.where(path >= 0, safe_tokens.gather(1, path.clamp(min=0)), PAD)
    out[rows, num_accepted] = final
    return out, path, num_accepted
