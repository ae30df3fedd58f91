"""The speculation config: one typed schema behind ``--speculative-config`` on the target worker, the
draft worker and ``tandem up`` alike.

vLLM users arrive with ``--speculative-config '{"method": "eagle3", "model": "HEAD",
"num_speculative_tokens": 3}'``; every key vLLM defines that Tandem implements keeps vLLM's name
and meaning, and Tandem's own settings sit beside them. Each worker reads the keys about its side
and ignores the other side's, so ``tandem up`` hands the same JSON to both (one config, two readers);
an unknown key is an error naming it, so nothing a user asked for is dropped silently.

γ, the draft tokens a target verifies a round, is ``num_speculative_tokens`` here and everywhere in
the code. Light to import: pydantic only.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, field_validator, model_validator

from runtime.settings import Group, build, parse_group
from workers.speculation.methods import BENCH_METHODS, METHODS

FLAG = "--speculative-config"
PASSED_AS_FLAGS = ("method", "model", "draft_tensor_parallel_size")  # a launcher's own flags carry these


class SpeculativeConfig(Group):
    """``--speculative-config``'s keys. The comments say who reads each: (both), (target) or (draft)."""

    # --- what drafts (draft; `tandem up` also picks the method and head for its drafts from these)
    method: str | None = None  # eagle3, eagle, medusa, mlp_speculator, ngram, suffix, draft_model ("[ngram]" too)
    model: str | None = None  # the head or draft model directory
    draft_tensor_parallel_size: Literal[1] | None = None  # vLLM's; a draft runs on one device here

    # --- how much and in what shape (both)
    num_speculative_tokens: int = Field(4, ge=0)  # γ: draft tokens verified a round (0: no speculation)
    eagle_topk: int | None = Field(None, ge=1)  # draft trees: children per node (1: chains; unset: the draft's, 1)
    num_steps: int | None = Field(None, ge=0)  # draft trees: depth (unset: the draft's, from γ)

    # --- the target's policy and seam (target)
    adaptive: bool = True  # γ adapts per request to its recent acceptance (else always γ)
    load_aware: bool = True  # each step drafts what maximises the batch's expected tokens/s, down to none
    seam: Literal["pipelined", "sync"] = "pipelined"  # drafts stream ahead, or each round waits for its answer
    propose_timeout: float = Field(2.0, gt=0)  # the most seconds a round waits for proposals
    propose_min_wait: float = Field(0.02, gt=0)  # the least seconds a round waits, however fast the steps
    hidden_layers: str = "auto"  # offered to drafts that read them: auto, none, or a comma list (0..L)
    hidden_plane: Literal["auto", "shm", "stream", "inline"] = "auto"  # how hidden states reach drafts
    hidden_ring_mib: int = Field(64, ge=1)  # the shared-memory ring per draft stream (plane shm)
    draft_lane: Literal["auto", "off"] = "auto"  # a same-host draft's messages on a Unix socket
    draft_streams: int = Field(4, ge=1)  # draft workers a target streams to at once; each sequence speculates with one
    draft_tls_ca: str | None = None  # reach drafts over TLS trusting this CA ('system': the system roots)
    draft_tls_cert: str | None = None  # mutual TLS: this target's certificate
    draft_tls_key: str | None = None  # and its key

    # --- the draft's own (draft)
    max_num_speculative_tokens: int = Field(16, ge=1)  # the most a target may ask of this draft a round
    draft_lora: str = ""  # the LoRA adapter this draft was trained against: targets give it that adapter's requests
    overlap: bool = True  # draft ahead while the target verifies (methods that can)
    stage_alternatives: int = Field(1, ge=0)  # pipelined seam: guessed bonus tokens per rejected position
    eagle_pipelined: bool = False  # an EAGLE head stages for the pipelined seam (else the synchronous one)
    prompt_lookup_min: int = Field(1, ge=1)  # ngram: shortest n-gram matched (vLLM's name)
    prompt_lookup_max: int = Field(4, ge=1)  # ngram: longest n-gram matched (vLLM's name)
    suffix_decoding_max_tree_depth: int = Field(24, ge=2)  # suffix: deepest match and draft (vLLM's name)
    suffix_decoding_max_spec_factor: float = Field(1.0, gt=0)  # suffix: draft up to factor x match length
    suffix_decoding_min_token_prob: float = Field(0.1, ge=0, le=1)  # suffix: stop below this probability
    suffix_decoding_max_cached_requests: int = Field(10_000, ge=0)  # suffix: outputs kept across requests
    suffix_decoding_max_cached_nodes: int = Field(500_000, ge=1)  # suffix: the global tree's node bound
    # benchmarks only (method oracle): replays known outputs with a chosen error rate and cost
    oracle_file: str | None = None
    oracle_error_rate: float = Field(0.0, ge=0, le=1)
    oracle_vocab_size: int = Field(49152, ge=1)
    oracle_token_cost_ms: float = Field(0.0, ge=0)

    @field_validator("method")
    @classmethod
    def _method(cls, method: str | None) -> str | None:
        if method == "[ngram]":  # vLLM's old spelling
            return "ngram"
        if method is not None and method not in (*METHODS, *BENCH_METHODS):
            raise ValueError(f"must be one of {', '.join(METHODS)}, got {method!r}")
        return method

    @field_validator("hidden_layers")
    @classmethod
    def _layers(cls, spec: str) -> str:
        if spec not in ("auto", "none"):
            try:
                [int(x) for x in spec.split(",")]
            except ValueError:
                raise ValueError(f"must be auto, none or a comma list of layers, got {spec!r}") from None
        return spec

    @model_validator(mode="after")
    def _together(self) -> SpeculativeConfig:
        problem = self.method_problem(self.draft_method)
        if problem:
            raise ValueError(problem)
        if self.propose_min_wait > self.propose_timeout:
            raise ValueError("'propose_min_wait' must be at most 'propose_timeout'")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError("'prompt_lookup_min' must not exceed 'prompt_lookup_max'")
        if self.model is not None and not self.model:
            raise ValueError("'model' must be a path")
        return self

    # ------------------------------------------------------------------ reading it

    @property
    def draft_method(self) -> str | None:
        """``method``, or vLLM's guess from ``model`` (a name with eagle3 is eagle3, with eagle- eagle,
        with medusa medusa, anything else draft_model); None when neither is given."""
        if self.method is not None or self.model is None:
            return self.method
        low = self.model.lower()
        return ("eagle3" if "eagle3" in low else "eagle" if "eagle-" in low else
                "medusa" if "medusa" in low else "draft_model")

    @property
    def tree(self) -> tuple[int, int]:
        """(children per node, depth) the target asks of its drafts (0: the draft's setting)."""
        return self.eagle_topk or 0, self.num_steps or 0

    def method_problem(self, method: str | None) -> str | None:
        """Why the keys given do not fit ``method`` (one method's keys given for another: they would do
        nothing); None when they fit or the method is not known here."""
        for prefix, owner in (("prompt_lookup_", "ngram"), ("suffix_decoding_", "suffix"), ("oracle_", "oracle")):
            given = sorted(key for key in self.model_fields_set if key.startswith(prefix))
            if given and method is not None and method != owner:
                return f"{', '.join(repr(k) for k in given)} apply to method {owner}, not {method}"
        return None

    def draft_only_keys(self) -> list[str]:
        """The keys given that only a draft worker reads (an error where a stack runs no drafts)."""
        return sorted(key for key in self.model_fields_set if key in DRAFT_KEYS)

    @property
    def tls_given(self) -> bool:
        return bool(self.draft_tls_ca or self.draft_tls_cert or self.draft_tls_key)

    def given(self) -> dict:
        """The keys set away from their defaults, as JSON would carry them (for passing on)."""
        return self.model_dump(exclude_defaults=True)


def speculative_config(text: str | dict | None = None, env: str | None = None, **flags) -> SpeculativeConfig:
    """``--speculative-config``'s value (JSON, ``@PATH`` or a dict; ``env``: ``TANDEM_SPECULATIVE_CONFIG``,
    whose keys apply beneath it) with the keys that have flags of their own (``flags``: e.g.
    ``num_speculative_tokens`` from ``--num-speculative-tokens``; None: not given) read onto it. A flag
    and a key that disagree are an error naming both."""
    spec = parse_group(SpeculativeConfig, FLAG, text, env)
    given = spec.model_fields_set
    changes = {}
    for key, value in flags.items():
        if value is None:
            continue
        if key in given and getattr(spec, key) != value:
            flag = "--" + key.replace("_", "-")
            raise ValueError(f"{flag} {value} disagrees with {FLAG}'s {key!r} {getattr(spec, key)!r}")
        changes[key] = value
    return build(SpeculativeConfig, FLAG, **{**spec.model_dump(exclude_unset=True), **changes}) if changes else spec


DRAFT_KEYS = frozenset({"max_num_speculative_tokens", "overlap", "stage_alternatives", "eagle_pipelined",
                        *(name for name in SpeculativeConfig.model_fields
                          if name.startswith(("prompt_lookup_", "suffix_decoding_", "oracle_")))})

SPECULATIVE_CONFIG_HELP = (
    "vLLM's speculative config as JSON (or @FILE): one schema for the target, the draft and tandem up, each "
    "reading its own keys (docs/speculative.md lists them): method, model and num_speculative_tokens (γ) as "
    "vLLM's; eagle_topk and num_steps (trees); the target's adaptive, load_aware, seam, propose_timeout, "
    "propose_min_wait, hidden_layers, hidden_plane, hidden_ring_mib, draft_lane, draft_streams, draft_tls_ca/cert/key; the "
    "draft's max_num_speculative_tokens, draft_lora, overlap, stage_alternatives, eagle_pipelined, prompt_lookup_min/max, "
    "suffix_decoding_*, oracle_*. An unknown key is an error")
