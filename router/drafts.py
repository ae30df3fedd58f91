"""Which draft worker a request should speculate with: the one that served its conversation last.

A target that streams to several draft workers places each sequence on one (``workers/target/
placement.py``: by load, and by each sequence's measured fit across draft kinds). A conversation's next
turn is best served by the draft that served the last one: a draft model or an EAGLE head keeps the
prefix's KV, and the turn starts on the kind its predecessor settled on instead of measuring the fit
again. :class:`DraftAffinity` remembers, per conversation, the draft that served its latest turn (the
target says which, in the final delta's ``usage.spec.draft_id``), and names it for the next turn
(``GenerateRequest.draft_id``): a hint the target honours when it streams to that draft and the draft
is not backed off, and ignores otherwise.

A conversation is known by its session (``X-Dynamo-Session-ID``) when the request has one, else by its
tokens: a finished turn is remembered under the hash of its prompt and output up to their last whole
block of ``block`` tokens, and a request looks up its prompt's prefixes at whole blocks, longest
first. A prompt that only shares a system prompt with earlier conversations finds none of them (what
is remembered ends inside each conversation's own tokens). At most ``capacity`` conversations are kept
(least recently used first out).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

BLOCK = 64  # tokens per hashed block of a conversation
CAPACITY = 65536  # conversations remembered
LOOKUPS = 64  # prefixes looked up per request at most (the longest first)


class DraftAffinity:
    """Conversation -> the draft worker that served its latest turn; plain values in."""

    def __init__(self, capacity: int = CAPACITY, block: int = BLOCK):
        if capacity <= 0 or block <= 0:
            raise ValueError("capacity and block must be positive")
        self.capacity = capacity
        self.block = block
        self._drafts: OrderedDict[object, str] = OrderedDict()
        self.hits = 0  # requests given a draft hint
        self.misses = 0  # requests that found none

    def _chain(self, tokens: Sequence[int]) -> list[int]:
        """The hash of every whole-block prefix of ``tokens``, shortest first."""
        out, h, b = [], 0, self.block
        for end in range(b, len(tokens) + 1, b):
            h = hash((h, tuple(tokens[end - b : end])))
            out.append(h)
        return out

    def choose(self, token_ids: Sequence[int], session_id: str = "") -> str:
        """The draft worker that served this conversation's latest turn ("": none known)."""
        draft = self._drafts.get(("session", session_id)) if session_id else None
        if draft is None:
            for h in reversed(self._chain(token_ids)[-LOOKUPS:]):
                draft = self._drafts.get(h)
                if draft is not None:
                    self._drafts.move_to_end(h)
                    break
        if draft is None:
            self.misses += 1
            return ""
        self.hits += 1
        return draft

    def note(self, token_ids: Sequence[int], draft_id: str, session_id: str = "") -> None:
        """A turn of ``token_ids`` (prompt and output) was served by ``draft_id``."""
        if not draft_id:
            return
        keys: list[object] = [("session", session_id)] if session_id else []
        chain = self._chain(token_ids)
        if chain:
            keys.append(chain[-1])
        for key in keys:
            self._drafts[key] = draft_id
            self._drafts.move_to_end(key)
        while len(self._drafts) > self.capacity:
            self._drafts.popitem(last=False)
