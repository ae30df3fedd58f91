"""What a target accepts from a draft worker: draft workers are untrusted input.

At the handshake (:func:`hello_ack_problem`) a draft is refused unless what it announces fits the
target: the hidden layers it reads are among those the target offers, its hidden-state dtype is
one the wire knows, its vocabulary (when it says) is the target's, and its γ is not negative. A
refused draft changes nothing on the target. Afterwards a proposal is used only if every field is
sane for the request it answers (:func:`proposal_problem`); otherwise it is dropped whole (the
sequence decodes plainly that step) and the reason is counted. The checks are on plain Python
values, before any tensor is built from them.
"""

from __future__ import annotations

import math

from .payloads import ROOT, DraftOutput

HIDDEN_DTYPES = ("", "float32", "float16", "bfloat16")  # "" = as the target has them
PROB_SLACK = 1e-3  # a sparse distribution may sum to 1 + this (float32 rounding on the draft side)


def proposal_problem(prop: DraftOutput, asked: int, vocab_size: int) -> str | None:
    """Why ``prop`` cannot be used for a request of at most ``asked`` tokens, or None if it can.

    Checked: token ids in [0, vocab_size); no more tokens than asked; ``parents`` empty or one per
    token, each ROOT or an earlier index; ``distributions`` empty or one per token, each with as
    many ids as probabilities, ids in the vocabulary, probabilities finite in [0, 1] summing to at
    most 1, and a positive probability on the token it carries (a token drawn from q has q(x) > 0);
    ``confidence`` empty or one finite value in [0, 1] per token (1 + ``PROB_SLACK`` at most: rounding).
    """
    tokens = prop.token_ids
    if len(tokens) > asked:
        return "too_long"
    if any(not 0 <= t < vocab_size for t in tokens):
        return "token_id"
    parents = prop.parents
    if parents and (len(parents) != len(tokens) or any(not ROOT <= p < i for i, p in enumerate(parents))):
        return "parents"
    dists = prop.distributions
    if dists:
        if len(dists) != len(tokens):
            return "distributions"
        for token, dist in zip(tokens, dists):
            if len(dist.ids) != len(dist.probs) or any(not 0 <= i < vocab_size for i in dist.ids):
                return "distributions"
            if any(not (math.isfinite(p) and 0.0 <= p <= 1.0) for p in dist.probs):
                return "probabilities"
            if sum(dist.probs) > 1.0 + PROB_SLACK:
                return "probabilities"
            if not any(i == token and p > 0 for i, p in zip(dist.ids, dist.probs)):
                return "probabilities"
    conf = prop.confidence
    # (a probability computed in float32 or bf16 may round a hair above 1: as much slack as distributions get)
    if conf and (len(conf) != len(tokens) or any(not (math.isfinite(c) and 0.0 <= c <= 1.0 + PROB_SLACK) for c in conf)):
        return "confidence"
    return None


def hello_ack_problem(layers: list[int], dtype: str, vocab_size: int, max_num_speculative_tokens: int,
                      offered_layers: tuple[int, ...], target_vocab_size: int) -> tuple[str, str] | None:
    """Why a draft that announced (``layers``, ``dtype``, ``vocab_size``, ``max_num_speculative_tokens``)
    cannot serve a target offering ``offered_layers`` with ``target_vocab_size`` tokens, as (a
    metric label, a sentence), or None."""
    missing = sorted(set(layers) - set(offered_layers))
    if missing:
        return "hidden_layers", (f"it reads hidden layers {missing} that this target does not offer (offered: "
                f"{list(offered_layers) or 'none'}; start the target with --speculative-config's hidden_layers to offer them)")
    if dtype not in HIDDEN_DTYPES:
        return "hidden_dtype", f"its hidden-state dtype {dtype!r} is not one of {list(HIDDEN_DTYPES[1:])}"
    if vocab_size and vocab_size != target_vocab_size:
        return "vocab_size", f"its vocabulary has {vocab_size} tokens, this target's {target_vocab_size}"
    if max_num_speculative_tokens < 0:
        return "num_speculative_tokens", f"it announced max_num_speculative_tokens={max_num_speculative_tokens}"
    return None
