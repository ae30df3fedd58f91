"""Incremental detokenization and stop strings.

:class:`IncrementalDetokenizer` turns a growing list of token ids into text deltas. Byte-level
tokenizers split multi-byte UTF-8 characters across tokens; decoding such a prefix yields U+FFFD,
so a delta is held back while the decoded text ends in U+FFFD, and released once the character is
complete. Decoding keeps a short window (``prefix_offset`` .. end) instead of the whole sequence, so
each step costs two decodes of a few tokens, as in vLLM's ``detokenize_incrementally``. A few
prompt tokens seed the window so tokenizers that drop a leading space when decoding a lone token
(SentencePiece ``▁``) still produce the right first delta.

:class:`StopStrings` finds stop strings in the text stream, including ones that span deltas, and
holds back any tail that could be the start of a stop string, so a stop string never leaks out.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

REPLACEMENT = "\ufffd"
PROMPT_CONTEXT = 5  # prompt tokens that seed the decode window


class IncrementalDetokenizer:
    """Text deltas from token ids; ``decode(ids) -> str`` is the tokenizer's decoder."""

    def __init__(self, decode: Callable[[list[int]], str], prompt_tail: Sequence[int] = ()):
        self._decode = decode
        self._tokens: list[int] = list(prompt_tail[-PROMPT_CONTEXT:]) if prompt_tail else []
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)

    def add(self, token_ids: Sequence[int]) -> str:
        """Append tokens; returns the newly completed text (possibly empty)."""
        if len(token_ids) == 1:
            self._tokens.append(token_ids[0])
            return self._advance(final=False)
        out = []
        for token in token_ids:  # one at a time, so text before a partial character is not held back
            self._tokens.append(token)
            out.append(self._advance(final=False))
        return "".join(out)

    def flush(self) -> str:
        """The text still held back (an incomplete character at the very end decodes as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        tokens, start, read = self._tokens, self._prefix_offset, self._read_offset
        if read >= len(tokens):
            return ""
        prefix_text = self._decode(tokens[start:read]) if read > start else ""
        new_text = self._decode(tokens[start:])
        if len(new_text) <= len(prefix_text) or (new_text.endswith(REPLACEMENT) and not final):
            # Nothing complete yet: a partial UTF-8 character, or a token that decodes to nothing.
            return ""
        self._prefix_offset = read
        self._read_offset = len(tokens)
        if len(self._tokens) > 4 * PROMPT_CONTEXT + 64:
            # Keep the window bounded: tokens before prefix_offset are never decoded again.
            drop = self._prefix_offset
            del self._tokens[:drop]
            self._prefix_offset -= drop
            self._read_offset -= drop
        return new_text[len(prefix_text):]


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
