"""vLLM's ``--speculative-config`` JSON, read onto ``tandem up``'s draft flags.

vLLM users arrive with ``--speculative-config '{"method": "eagle3", "model": "HEAD", "num_speculative_tokens": 3}'``.
Each key this launcher understands maps onto a flag of its own (below); any other key is an error
naming it, so that nothing a user asked for is silently dropped.

=============================  ==================================================================
key                            flag
=============================  ==================================================================
``method``                     ``--draft-method`` (eagle, eagle3, medusa, mlp_speculator, ngram,
                               suffix, draft_model; ``[ngram]``, vLLM's old spelling, too)
``model``                      ``--draft-model`` (the head or draft model directory)
``num_speculative_tokens``     ``--num-speculative-tokens``
``prompt_lookup_max`` / _min   ngram: the draft worker's ``--ngram-max`` / ``--ngram-min``
``draft_tensor_parallel_size`` must be 1 (a draft runs on one device here)
=============================  ==================================================================

Without ``method``, vLLM's guess from ``model``: a name with ``eagle3`` is eagle3, with ``eagle-``
eagle, with ``medusa`` medusa, anything else draft_model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from workers.draft.methods import METHODS

KEYS = ("method", "model", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min",
        "draft_tensor_parallel_size")


@dataclass(frozen=True)
class SpeculativeConfig:
    """What a ``--speculative-config`` asked for, as ``tandem up``'s flags name it (None: not given)."""

    draft_method: str
    draft_model: str | None = None
    num_speculative_tokens: int | None = None
    ngram_max: int | None = None
    ngram_min: int | None = None

    def draft_args(self) -> tuple[str, ...]:
        """The draft worker's flags that only this config sets."""
        out: list[str] = []
        if self.ngram_max is not None:
            out += ["--ngram-max", str(self.ngram_max)]
        if self.ngram_min is not None:
            out += ["--ngram-min", str(self.ngram_min)]
        return tuple(out)


def _int(config: dict, key: str, least: int) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise ValueError(f"--speculative-config: {key!r} must be an integer >= {least}, got {value!r}")
    return value


def parse_speculative_config(text: str) -> SpeculativeConfig:
    """``text`` (vLLM's JSON) as :class:`SpeculativeConfig`; ``ValueError`` naming the key at fault."""
    try:
        config = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"--speculative-config is not JSON: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"--speculative-config must be a JSON object, got {type(config).__name__}")
    unknown = [key for key in config if key not in KEYS]
    if unknown:
        raise ValueError(f"--speculative-config: unsupported key {unknown[0]!r} (this launcher reads "
                         f"{', '.join(KEYS)})")
    model = config.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise ValueError(f"--speculative-config: 'model' must be a path, got {model!r}")
    method = config.get("method")
    if method == "[ngram]":
        method = "ngram"
    if method is None:
        if model is None:
            raise ValueError("--speculative-config needs 'method' (or a 'model' to guess it from)")
        low = model.lower()
        method = ("eagle3" if "eagle3" in low else "eagle" if "eagle-" in low else
                  "medusa" if "medusa" in low else "draft_model")
    if method not in METHODS:
        raise ValueError(f"--speculative-config: 'method' must be one of {', '.join(METHODS)}, got {method!r}")
    tp = _int(config, "draft_tensor_parallel_size", 1)
    if tp not in (None, 1):
        raise ValueError(f"--speculative-config: 'draft_tensor_parallel_size' {tp} is not supported (a draft worker "
                         f"runs on one device; start more drafts with --drafts)")
    spec = SpeculativeConfig(method, model, _int(config, "num_speculative_tokens", 0),
                             _int(config, "prompt_lookup_max", 1), _int(config, "prompt_lookup_min", 1))
    if (spec.ngram_max is not None or spec.ngram_min is not None) and method != "ngram":
        raise ValueError(f"--speculative-config: 'prompt_lookup_max'/'prompt_lookup_min' apply to method ngram, "
                         f"not {method}")
    if spec.ngram_max is not None and spec.ngram_min is not None and spec.ngram_min > spec.ngram_max:
        raise ValueError("--speculative-config: 'prompt_lookup_min' must not exceed 'prompt_lookup_max'")
    return spec
