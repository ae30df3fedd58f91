"""One choice's output: token deltas in; text, logprobs, finish reason and usage counters out.

A :class:`ChoiceOutput` owns the detokenizer and stop-string matcher of one choice. The text of
a final stop token (EOS or one of ``stop_token_ids``) is not shown, as OpenAI and vLLM do; it is
still counted as a completion token.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import tokenizers

from runtime.messages import SpecUsage, TokenDelta, TopLogprob

from .detokenize import IncrementalDetokenizer, StopStrings


@dataclass
class LogprobEntry:
    token_id: int
    logprob: float
    top: list[TopLogprob]


@dataclass
class Piece:
    """What one delta added to a choice."""

    text: str = ""
    logprobs: list[LogprobEntry] = field(default_factory=list)
    finish_reason: str | None = None


class ChoiceOutput:
    """Accumulates one choice; plain values and the ``tokenizers`` tokenizer that decodes in."""

    def __init__(
        self,
        index: int,
        tokenizer: tokenizers.Tokenizer,
        prompt_ids: Sequence[int],
        stops: Sequence[str] = (),
        stop_token_ids: frozenset[int] = frozenset(),
        top_logprobs: int | None = None,
    ):
        self.index = index
        self._detok = IncrementalDetokenizer(tokenizer, prompt_ids)
        self._stops = StopStrings(stops)
        self._stop_token_ids = stop_token_ids
        self._top = top_logprobs
        self.text_parts: list[str] = []
        self.logprobs: list[LogprobEntry] = []
        self.finish_reason: str | None = None
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.spec: SpecUsage | None = None

    @property
    def text(self) -> str:
        return "".join(self.text_parts)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, delta: TokenDelta) -> Piece:
        """Process one delta from the worker; the returned piece may carry a finish reason."""
        if self.finished:
            return Piece()
        ids = delta.token_ids
        shown = len(ids)
        if delta.finish_reason == "stop" and ids and ids[-1] in self._stop_token_ids:
            shown -= 1
        piece = Piece()
        with_logprobs = self._top is not None and delta.logprobs is not None
        if with_logprobs or self._stops.stops:
            # Token by token, so that nothing after a stop string is counted or reported.
            tops = (delta.top_logprobs or [[] for _ in ids]) if with_logprobs else ()
            parts = []
            for i, token in enumerate(ids):
                self.completion_tokens += 1
                if i < shown:
                    parts.append(self._stops.feed(self._detok.add((token,))))
                if with_logprobs and i < shown:  # a hidden stop token has no entry: entries join to the text
                    piece.logprobs.append(LogprobEntry(token, delta.logprobs[i], list(tops[i][: self._top])))
                if self._stops.stopped:
                    break
            text = "".join(parts)
            self.logprobs.extend(piece.logprobs)
        else:
            self.completion_tokens += len(ids)
            text = self._detok.add(ids[:shown])
        if self._stops.stopped:
            self.finish_reason = "stop"
        elif delta.finish_reason is not None:
            text += self._stops.feed(self._detok.flush())
            text += "" if self._stops.stopped else self._stops.flush()
            self.finish_reason = "stop" if self._stops.stopped else delta.finish_reason
        if delta.usage is not None:
            self.cached_tokens = delta.usage.cached_tokens
            self.spec = delta.usage.spec
        piece.text = text
        piece.finish_reason = self.finish_reason
        if text:
            self.text_parts.append(text)
        return piece

    def abort(self, reason: str) -> Piece:
        """End the choice without a finish delta from the worker (e.g. the request failed)."""
        if self.finished:
            return Piece()
        self.finish_reason = reason
        return Piece(finish_reason=reason)
