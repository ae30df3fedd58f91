"""The one logits pipeline: raw model logits in, each request's sampling scores out.

Plain sampling and speculative verification both read their distributions from here, so a draft
is verified against exactly the distribution the target would have sampled from, under every
parameter. A *row* is one logits row: the next token after a sequence's last committed token
(``depth`` 0), or after a verified draft node ``depth`` tokens further on, whose draft ancestors
(``drafted``, in order) then count as generated tokens for min_tokens and the penalties.

Per row, in order (the order vLLM v1 applies them):

1. ``min_tokens``: the request's stop tokens get -inf until min_tokens are out;
2. ``logit_bias``: added per token id;
3. penalties over the output so far (migrated outputs, generated tokens, the row's draft
   ancestors): ``repetition_penalty`` r (also over the prompt; a positive logit is divided by r, a
   negative one multiplied), then ``frequency_penalty`` · count and ``presence_penalty`` · [count > 0]
   subtracted (OpenAI's definitions);
4. structured outputs: tokens the grammar forbids get -inf;
5. temperature (greedy rows keep their logits: argmax is all they use);
6. ``min_p``: tokens whose probability is below min_p × the most likely one's get -inf;
7. ``top_k`` then ``top_p`` (steps 5-7 are :func:`.sampling.temper`).

Steps a batch does not need cost nothing: a batch of greedy rows without penalties, bias or
grammar returns the logits as they are. Every step that runs is one batched tensor op over the
rows that need it; the Python work is building flat index lists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from runtime.messages import is_greedy

from .sampling import apply_token_bitmask, temper
from .sequence import Sequence


@dataclass(frozen=True)
class Row:
    """One logits row: the distribution after ``seq``'s committed tokens and ``depth`` draft tokens
    (0 for a plain row); ``drafted``: those draft tokens, needed only when the request has penalties."""

    seq: Sequence
    depth: int = 0
    drafted: tuple[int, ...] = ()


def penalised(seq: Sequence) -> bool:
    """Whether ``seq``'s rows need its output so far (a penalty is set)."""
    p = seq.params
    return p.presence_penalty != 0 or p.frequency_penalty != 0 or p.repetition_penalty != 1


def process(logits: torch.Tensor, rows: list[Row], masks: torch.Tensor | None = None,
            mask_rows: list[int] | None = None) -> tuple[torch.Tensor, list[bool]]:
    """Scores for every row, and which rows are greedy.

    logits [R, V] float32 (one row per ``rows`` entry; modified only when it is not returned as is);
    masks [M, W] int32: grammar bitmasks for rows ``mask_rows`` (see :mod:`.grammar`), or None.
    Returns (scores [R, V], greedy [R]): a greedy row's next token is argmax(scores); any other
    row's distribution is softmax(scores).
    """
    greedy = [is_greedy(r.seq.params.temperature) for r in rows]
    device = logits.device
    scores = logits
    owned = False

    def writable() -> torch.Tensor:
        nonlocal scores, owned
        if not owned:
            scores, owned = scores.clone(), True
        return scores

    # 1. min_tokens: stop tokens are banned until enough tokens are out
    ban_r, ban_t = [], []
    for i, r in enumerate(rows):
        seq = r.seq
        if seq.stop_ids and seq.num_generated + r.depth < seq.params.min_tokens:
            ban_r.extend([i] * len(seq.stop_ids))
            ban_t.extend(seq.stop_ids)
    if ban_r:
        writable()[torch.tensor(ban_r, device=device), torch.tensor(ban_t, device=device)] = float("-inf")
    # 2. logit_bias
    bias_r, bias_t, bias_v = [], [], []
    for i, r in enumerate(rows):
        for token, value in r.seq.params.logit_bias.items():
            bias_r.append(i)
            bias_t.append(token)
            bias_v.append(value)
    if bias_r:
        writable().index_put_((torch.tensor(bias_r, device=device), torch.tensor(bias_t, device=device)),
                              torch.tensor(bias_v, dtype=scores.dtype, device=device), accumulate=True)
    # 3. penalties
    with_penalties = [i for i, r in enumerate(rows) if penalised(r.seq)]
    if with_penalties:
        _apply_penalties(writable(), [rows[i] for i in with_penalties], with_penalties)
    # 4. structured outputs
    if masks is not None and mask_rows:
        apply_token_bitmask(writable(), masks, None if len(mask_rows) == len(rows) else mask_rows)
    sampled = [i for i, g in enumerate(greedy) if not g]
    if not sampled:
        return scores, greedy
    # 5. temperature, 6. min_p, 7. top-k / top-p: on the sampled rows only
    params = [rows[i].seq.params for i in sampled]
    index = None if len(sampled) == len(rows) else torch.tensor(sampled, device=device)
    part = scores if index is None else scores[index]  # [S, V] (a gather copies)
    part = temper(part, torch.tensor([p.temperature for p in params]),  # host tensors: temper moves them
                  torch.tensor([p.top_k for p in params], dtype=torch.long), torch.tensor([p.top_p for p in params]),
                  torch.tensor([p.min_p for p in params]) if any(p.min_p > 0 for p in params) else None)
    if index is None:
        return part, greedy
    out = writable()
    out[index] = part
    return out, greedy


def _apply_penalties(scores: torch.Tensor, rows: list[Row], at: list[int]) -> None:
    """Repetition, frequency and presence penalties on rows ``at`` of scores [R, V], in place."""
    device, vocab = scores.device, scores.shape[-1]
    out_r, out_t, prompt_r, prompt_t = [], [], [], []
    for j, r in enumerate(rows):
        seq = r.seq
        output = seq.token_ids[seq.num_prompt_tokens : seq.num_prompt_tokens + seq.num_prefilled_outputs
                               + seq.num_generated]
        output = list(output) + list(r.drafted)
        out_r.extend([j] * len(output))
        out_t.extend(output)
        if seq.params.repetition_penalty != 1:
            prompt_r.extend([j] * seq.num_prompt_tokens)
            prompt_t.extend(seq.token_ids[: seq.num_prompt_tokens])
    counts = torch.zeros(len(rows), vocab, device=device)  # [P, V]: each token's count in the output
    if out_r:
        counts.index_put_((torch.tensor(out_r, device=device), torch.tensor(out_t, device=device)),
                          torch.ones(len(out_r), device=device), accumulate=True)
    index = torch.tensor(at, device=device)
    part = scores[index]  # [P, V]
    if any(r.seq.params.repetition_penalty != 1 for r in rows):  # decided on the host: no device sync
        rep = torch.tensor([r.seq.params.repetition_penalty for r in rows], device=device)[:, None]
        seen = counts > 0
        if prompt_r:
            seen[torch.tensor(prompt_r, device=device), torch.tensor(prompt_t, device=device)] = True
        part = torch.where(seen, torch.where(part > 0, part / rep, part * rep), part)
    freq = torch.tensor([r.seq.params.frequency_penalty for r in rows], device=device)[:, None]
    pres = torch.tensor([r.seq.params.presence_penalty for r in rows], device=device)[:, None]
    part = part - freq * counts - pres * (counts > 0).to(part.dtype)
    scores[index] = part
