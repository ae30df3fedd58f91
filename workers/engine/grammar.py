"""Structured outputs in the engine: one grammar matcher per constrained request, as a token mask.

The grammar engine is llguidance (github.com/guidance-ai/llguidance: Rust, no Python dependencies,
a token-mask API and JSON Schema, regex and Lark front ends). A :class:`GrammarBackend` per worker
holds the tokenizer info, built from the model directory's ``tokenizer.json`` and checked against
the detokenizer (:mod:`runtime.grammar_tokenizer`; about 0.3 s for a 49k vocabulary, paid once at
the worker's start, so that a tokenizer llguidance misreads stops the start), and a small cache
of compiled grammars: every request gets its own :class:`Grammar`, a copy of the cached matcher.

Masks are bitmasks, int32 [rows, ceil(V / 32)]: bit j of word w allows token 32·w + j
(llguidance's layout; :func:`~.sampling.apply_token_bitmask` turns a mask into -inf logits).

Speculative verification (:meth:`Grammar.fill_draft`): a verify step scores node 0 (the last
committed token) and node i + 1 (draft token i) in one pass. Row n of the mask is the grammar's
mask after the tokens on the path from the root to node n, computed by walking copies of the
matcher down the draft tree. A draft token its parent row forbids gets probability 0 under the
masked target distribution (and greedy's masked argmax is never that token), so it is rejected and
nothing below it can be accepted: the rows under it are left allowing everything. Drafts never
touch the request's own matcher; :meth:`Grammar.accept` advances it by the tokens committed.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

import torch

from runtime import structured
from runtime.errors import InvalidRequest
from runtime.grammar_tokenizer import grammar_tokenizer
from runtime.messages import StructuredOutput

log = logging.getLogger(__name__)

CACHE_SIZE = 64  # compiled grammars kept per worker (most traffic repeats a few schemas)
FIELD = "response_format"  # the parameter an invalid grammar is reported against


def grammar_text(spec: StructuredOutput) -> str:
    """The llguidance grammar of ``spec`` (:func:`runtime.structured.grammar_text`, the frontend's recipe
    too); raises :class:`InvalidRequest` for a spec without exactly one field or a refused schema."""
    try:
        return structured.grammar_text(spec)
    except ValueError as exc:
        raise InvalidRequest(f"invalid structured output: {exc}", field=FIELD) from None


class GrammarBackend:
    """Tokenizer info and compiled grammars of one worker; plain values in. Thread-safe: request
    handlers compile in threads while the engine step uses the grammars it was given."""

    def __init__(self, tokenizer_file: str, vocab_size: int, eos_token_ids: Sequence[int]):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        if not eos_token_ids:
            raise ValueError("a grammar needs at least one EOS token to end on")
        self.tokenizer_file = tokenizer_file
        self.vocab_size = vocab_size
        self.eos_token_ids = sorted(eos_token_ids)
        self.words = (vocab_size + 31) // 32
        self._tokenizer = None
        self._cache: OrderedDict[tuple, object] = OrderedDict()
        self._lock = threading.Lock()

    @classmethod
    def for_model_dir(cls, model_dir: str | Path, vocab_size: int, eos_token_ids: Sequence[int]) -> GrammarBackend | None:
        """The backend of a model directory; None without a ``tokenizer.json``, EOS ids or llguidance."""
        path = Path(model_dir) / "tokenizer.json"
        if not path.exists() or not eos_token_ids:
            log.info("structured outputs off: %s", "no EOS token" if path.exists() else f"no {path}")
            return None
        try:
            import llguidance  # noqa: F401
        except ImportError:
            log.info("structured outputs off: llguidance is not installed")
            return None
        return cls(str(path), vocab_size, eos_token_ids)

    def tokenizer(self):
        """llguidance's tokenizer info (built once, on first use; the worker builds it at start-up).
        Raises :class:`~runtime.grammar_tokenizer.TokenizerMismatch` when llguidance would read the
        tokens otherwise than the detokenizer."""
        with self._lock:
            if self._tokenizer is None:
                self._tokenizer = grammar_tokenizer(self.tokenizer_file, self.vocab_size, self.eos_token_ids)
                log.info("grammar tokenizer info built from %s", self.tokenizer_file)
            return self._tokenizer

    def grammar(self, spec: StructuredOutput) -> Grammar:
        """A fresh matcher for ``spec``; raises :class:`InvalidRequest` for a grammar that does not compile."""
        from llguidance import LLMatcher

        key = (spec.json_schema, spec.regex, tuple(spec.choice))
        with self._lock:
            template = self._cache.get(key)
            if template is not None:
                self._cache.move_to_end(key)
        if template is None:
            template = LLMatcher(self.tokenizer(), grammar_text(spec), log_level=0)
            if template.is_error():
                raise InvalidRequest(f"invalid grammar: {template.get_error()}", field=FIELD)
            with self._lock:
                self._cache[key] = template
                while len(self._cache) > CACHE_SIZE:
                    self._cache.popitem(last=False)
        return Grammar(template.deep_copy(), self.words, self.eos_token_ids)

    def new_masks(self, rows: int) -> torch.Tensor:
        """An uninitialised bitmask [rows, words] int32 on the CPU."""
        return torch.empty(rows, self.words, dtype=torch.int32)


def _allowed(row: torch.Tensor, token: int) -> bool:
    return bool((int(row[token >> 5]) >> (token & 31)) & 1)


def _set_bit(row: torch.Tensor, token: int, on: bool) -> None:
    word = int(row[token >> 5]) & 0xFFFFFFFF
    word = word | (1 << (token & 31)) if on else word & ~(1 << (token & 31))
    row[token >> 5] = word - (1 << 32) if word >= 1 << 31 else word  # back to a signed int32


class Grammar:
    """One request's matcher: masks for the next token or a verify step, advanced by committed tokens."""

    def __init__(self, matcher, words: int, eos_token_ids: Sequence[int]):
        self._matcher = matcher
        self._words = words
        self._eos = list(eos_token_ids)

    def _fill(self, matcher, row: torch.Tensor) -> None:
        """The mask after ``matcher``'s tokens into ``row`` [words] int32 (CPU, contiguous)."""
        matcher.unsafe_compute_mask_ptr(row.data_ptr(), self._words * 4)
        if matcher.is_error():  # cannot happen for tokens the masks allowed; end the output cleanly
            log.warning("grammar matcher failed (%s): only EOS allowed", matcher.get_error())
            row.zero_()
            for t in self._eos:
                _set_bit(row, t, True)

    def fill(self, row: torch.Tensor) -> None:
        """The mask for the next token into ``row`` [words] int32."""
        self._fill(self._matcher, row)

    def fill_draft(self, rows: torch.Tensor, tokens: Sequence[int], parents: Sequence[int] = ()) -> list[int]:
        """Masks for a verify step into ``rows`` [len(tokens) + 1, words] int32: row 0 after the committed
        tokens, row i + 1 after the path to draft token i. ``parents``: the draft tree (see
        :mod:`workers.speculation.tree`: -1 is the root, else an earlier token index); empty: a chain.

        Returns the draft tokens worth verifying, in order: those whose parent's mask allows them,
        plus the first forbidden child of each (its rejection is sampled with its draft probability;
        what lies below it can never be accepted)."""
        k = len(tokens)
        reachable: list[int] = []
        kids: list[list[int]] = [[] for _ in range(k + 1)]
        for i in range(k):
            kids[(parents[i] if parents else i - 1) + 1].append(i)
        rows[1:] = -1  # under a forbidden draft token: never used, allow everything
        stack = [(0, self._matcher)]
        while stack:
            node, matcher = stack.pop()
            self._fill(matcher, rows[node])
            for i in kids[node]:
                reachable.append(i)
                if not _allowed(rows[node], tokens[i]):
                    continue
                child = matcher.deep_copy()
                if child.consume_token(tokens[i]):
                    stack.append((i + 1, child))
                else:  # the mask allowed it but the matcher did not: forbid it here
                    _set_bit(rows[node], tokens[i], False)
        return sorted(reachable)

    def accept(self, tokens: Sequence[int]) -> bool:
        """Advance by committed tokens; False (and the matcher then allows only EOS) if one is refused."""
        for t in tokens:
            if not self._matcher.consume_token(t):
                log.warning("grammar refused committed token %d: %s", t, self._matcher.get_error())
                return False
        return True
