"""Whether a generate request can be served: the one check the frontend and every worker run.

Contract: :func:`validate_request` returns ``None`` for a request a worker with ``vocab_size`` tokens
and a context of ``max_model_len`` can serve, or raises :class:`~runtime.errors.InvalidRequest` whose
``field`` names the offending parameter. Fields are named as :class:`~runtime.messages.SamplingParams`
spells them (which is OpenAI's spelling too), the prompt as ``prompt`` and an output grammar as
``response_format``; a caller whose API spells one differently passes ``names`` (the frontend:
``messages`` for a chat prompt, ``max_completion_tokens``, ``guided_regex``, ...).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

from .errors import InvalidRequest
from .messages import SamplingParams

MAX_LOGPROBS = 20  # top logprobs per token, OpenAI's limit
PENALTY_LIMIT = 2.0  # presence_penalty and frequency_penalty lie in [-2, 2] (OpenAI's range)
LOGIT_BIAS_LIMIT = 100.0  # a logit_bias value lies in [-100, 100] (OpenAI's range)


def validate_request(token_ids: Sequence[int], params: SamplingParams, output_ids: Sequence[int] = (), *,
                     vocab_size: int | None, max_model_len: int, structured_outputs: bool = False,
                     names: Mapping[str, str] | None = None) -> None:
    """Raise :class:`InvalidRequest` naming the field unless the request can be served.

    ``output_ids``: tokens already generated elsewhere (a migrated request); they count against the
    context like the prompt. ``vocab_size`` None leaves token ids unchecked (a worker with no model).
    ``structured_outputs``: whether the caller can enforce ``params.structured``. ``names`` maps
    ``prompt``, ``max_tokens`` and ``structured`` to the caller's names for them.
    """
    names = names or {}
    prompt, max_name = names.get("prompt", "prompt"), names.get("max_tokens", "max_tokens")
    if not token_ids:
        raise InvalidRequest("the prompt has no tokens", prompt)
    if vocab_size is not None:
        _check_ids(token_ids, vocab_size, prompt)
        _check_ids(output_ids, vocab_size, "output_ids")
        _check_ids(params.stop_token_ids, vocab_size, "stop_token_ids")
    length = len(token_ids) + len(output_ids)
    what, has = ("the prompt and the output so far", "have") if output_ids else ("the prompt", "has")
    if length >= max_model_len:
        raise InvalidRequest(f"{what} {has} {length} tokens; the model's context length is {max_model_len}", prompt)
    if params.max_tokens < 0:
        raise InvalidRequest(f"{max_name} must be >= 0, got {params.max_tokens}", max_name)
    if length + params.max_tokens > max_model_len:
        raise InvalidRequest(f"{what} ({length} tokens) plus {max_name} ({params.max_tokens}) exceeds the model's "
                             f"context length of {max_model_len}", max_name)
    if params.min_tokens < 0:
        raise InvalidRequest(f"min_tokens must be >= 0, got {params.min_tokens}", "min_tokens")
    if params.min_tokens > params.max_tokens:
        raise InvalidRequest(f"min_tokens ({params.min_tokens}) exceeds {max_name} ({params.max_tokens})", "min_tokens")
    if not (math.isfinite(params.temperature) and params.temperature >= 0):
        raise InvalidRequest(f"temperature must be >= 0, got {params.temperature}", "temperature")
    if not 0 < params.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {params.top_p}", "top_p")
    if params.top_k < 0:
        raise InvalidRequest(f"top_k must be >= 0 (0: off), got {params.top_k}", "top_k")
    if not 0 <= params.min_p <= 1:
        raise InvalidRequest(f"min_p must be in [0, 1], got {params.min_p}", "min_p")
    for name in ("presence_penalty", "frequency_penalty"):
        value = getattr(params, name)
        if not -PENALTY_LIMIT <= value <= PENALTY_LIMIT:
            raise InvalidRequest(f"{name} must be in [-{PENALTY_LIMIT:g}, {PENALTY_LIMIT:g}], got {value}", name)
    if not (math.isfinite(params.repetition_penalty) and params.repetition_penalty > 0):
        raise InvalidRequest(f"repetition_penalty must be > 0 (1: off), got {params.repetition_penalty}",
                             "repetition_penalty")
    if params.logit_bias:
        _check_logit_bias(params.logit_bias, vocab_size)
    if params.logprobs is not None and not 0 <= params.logprobs <= MAX_LOGPROBS:
        raise InvalidRequest(f"logprobs must be in [0, {MAX_LOGPROBS}], got {params.logprobs}", "logprobs")
    if params.structured is not None:
        grammar = names.get("structured", "response_format")
        if not structured_outputs:
            raise InvalidRequest("this model's workers do not support structured outputs", grammar)
        # a finished grammar allows only EOS: it must end the output, and may not be banned
        if params.ignore_eos:
            raise InvalidRequest(f"'ignore_eos' cannot be combined with '{grammar}'", "ignore_eos")
        if params.min_tokens:
            raise InvalidRequest(f"'min_tokens' cannot be combined with '{grammar}'", "min_tokens")


def _check_ids(token_ids: Sequence[int], vocab_size: int, field: str) -> None:
    # min and max run in C: a 100k-token prompt costs about a millisecond, not a Python loop
    if token_ids and (min(token_ids) < 0 or max(token_ids) >= vocab_size):
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise InvalidRequest(f"token id {bad} in '{field}' is outside the vocabulary (size {vocab_size})", field)


def _check_logit_bias(bias: Mapping[int, float], vocab_size: int | None) -> None:
    if vocab_size is not None:
        _check_ids(list(bias), vocab_size, "logit_bias")
    for token, value in bias.items():
        if not -LOGIT_BIAS_LIMIT <= value <= LOGIT_BIAS_LIMIT:
            raise InvalidRequest(f"logit_bias of token {token} must be in [-{LOGIT_BIAS_LIMIT:g}, "
                                 f"{LOGIT_BIAS_LIMIT:g}], got {value}", "logit_bias")
