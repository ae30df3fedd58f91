"""Incremental detokenization and stop strings.

:class:`IncrementalDetokenizer` turns a growing list of token ids into text deltas with the
``tokenizers`` library's :class:`~tokenizers.decoders.DecodeStream` (what vLLM v1 uses): it holds a
delta back while a multi-byte UTF-8 character is split across tokens, decodes a short window, and is
seeded with a few prompt tokens, so tokenizers that drop a leading space when decoding a lone token
(SentencePiece ``▁``) still produce the right first delta.

:class:`StopStrings` finds stop strings in the text stream, including ones that span deltas, and
holds back any tail that could be the start of a stop string, so a stop string never leaks out.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

PROMPT_CONTEXT = 5  # prompt tokens that seed the decode window


class IncrementalDetokenizer:
    """Text deltas from token ids, special tokens skipped."""

    def __init__(self, tokenizer: Tokenizer, prompt_tail: Sequence[int] = ()):
        self._tokenizer = tokenizer
        self._stream = DecodeStream(list(prompt_tail[-PROMPT_CONTEXT:]), skip_special_tokens=True)
        self._held: list[int] = []  # tokens of a character not complete yet

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the newly completed text (possibly empty)."""
        out = []
        for token in token_ids:
            text = self._stream.step(self._tokenizer, token)
            if text is None:
                self._held.append(token)
            else:
                self._held.clear()
                out.append(text)
        return "".join(out)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end decodes as U+FFFD)."""
        held, self._held = self._held, []
        return self._tokenizer.decode(held, skip_special_tokens=True) if held else ""


class StopStrings:
    """Cuts a text stream at the first stop string; the stop string itself is not emitted."""

    def __init__(self, stops: Sequence[str]):
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        self.stops = tuple(stops)
        self._pending = ""
        self.stopped = False

    def feed(self, text: str) -> str:
        """Text that is safe to emit now. After a stop string was seen, :attr:`stopped` is true
        and everything from the stop string on is dropped."""
        if self.stopped or not text:
            return ""
        if not self.stops:
            return text
        buf = self._pending + text
        # A stop string can only end inside the new text, so search from just before it. The one
        # that completes first wins (as it would, had the text come one character at a time).
        hit: tuple[int, int] | None = None
        for stop in self.stops:
            at = buf.find(stop, max(0, len(self._pending) - len(stop) + 1))
            if at != -1 and (hit is None or (at + len(stop), at) < hit):
                hit = (at + len(stop), at)
        if hit is not None:
            self.stopped = True
            self._pending = ""
            return buf[: hit[1]]
        hold = self._held_tail(buf)
        self._pending = buf[len(buf) - hold:] if hold else ""
        return buf[: len(buf) - hold]

    def _held_tail(self, buf: str) -> int:
        """Length of the longest tail of ``buf`` that is a proper prefix of some stop string."""
        best = 0
        for stop in self.stops:
            for k in range(min(len(stop) - 1, len(buf)), best, -1):
                if buf.endswith(stop[:k]):
                    best = k
                    break
        return best

    def flush(self) -> str:
        """At the end of generation the held-back tail is real output after all."""
        if self.stopped:
            return ""
        out, self._pending = self._pending, ""
        return out
