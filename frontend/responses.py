"""OpenAI response bodies and stream chunks, as plain dicts encoded once with msgspec.

Shapes follow OpenAI's API reference: ``chat.completion`` / ``chat.completion.chunk`` and
``text_completion``. ``usage`` adds ``prompt_tokens_details.cached_tokens`` (prompt tokens the
worker found in its prefix cache) and, for a speculated request, ``spec_decode`` with the counters,
``acceptance_rate`` and ``mean_accepted_length`` as defined in :mod:`runtime.spec_stats` (vLLM's:
``1 + accepted_tokens / num_drafts``, the tokens emitted per target forward pass), and
``accepted_per_pos`` (verify steps whose accepted path reached position, or tree depth, i + 1); a
rate that is undefined (no drafts yet) is left out.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence

import msgspec

from runtime.spec_stats import acceptance_rate, mean_accepted_length

from .output import ChoiceOutput, LogprobEntry, Piece

_json = msgspec.json.Encoder()
encode_json = _json.encode


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, choices: Sequence[ChoiceOutput]) -> dict:
    """Usage of a whole request: the prompt counted once per prompt, completions summed."""
    completion = sum(c.completion_tokens for c in choices)
    out = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": max((c.cached_tokens for c in choices), default=0)},
    }
    specs = [c.spec for c in choices if c.spec is not None]
    if specs:
        drafts = sum(s.num_drafts for s in specs)
        draft_tokens = sum(s.num_draft_tokens for s in specs)
        accepted = sum(s.num_accepted_tokens for s in specs)
        depth = max(len(s.accepted_per_pos) for s in specs)
        per_pos = [sum(s.accepted_per_pos[i] for s in specs if i < len(s.accepted_per_pos)) for i in range(depth)]
        spec = {"num_drafts": drafts, "draft_tokens": draft_tokens, "accepted_tokens": accepted,
                "accepted_per_pos": per_pos}
        rates = {"acceptance_rate": acceptance_rate(accepted, draft_tokens),
                 "mean_accepted_length": mean_accepted_length(accepted, drafts)}
        spec.update((k, v) for k, v in rates.items() if v is not None)
        out["spec_decode"] = spec
    return out


def _token_entry(text: str, logprob: float) -> dict:
    return {"token": text, "logprob": logprob, "bytes": list(text.encode())}


def chat_logprobs(entries: Sequence[LogprobEntry], token_text: Callable[[int], str]) -> dict:
    content = []
    for e in entries:
        item = _token_entry(token_text(e.token_id), e.logprob)
        item["top_logprobs"] = [_token_entry(token_text(t.token_id), t.logprob) for t in e.top]
        content.append(item)
    return {"content": content}


def completion_logprobs(entries: Sequence[LogprobEntry], token_text: Callable[[int], str], offset: int = 0) -> dict:
    tokens, offsets = [], []
    for e in entries:
        text = token_text(e.token_id)
        tokens.append(text)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [{token_text(t.token_id): t.logprob for t in e.top} for e in entries],
        "text_offset": offsets,
    }


class ResponseBuilder:
    """Builds the bodies and chunks of one request (one id, one creation time)."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str], with_logprobs: bool):
        self.chat = chat
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._token_text = token_text
        self._with_logprobs = with_logprobs
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._offsets: dict[int, int] = {}
        # stream_options.continuous_usage_stats: the usage so far, for every chunk that carries one
        self.running_usage: Callable[[], dict] | None = None

    def _logprobs(self, index: int, entries: Sequence[LogprobEntry]) -> dict | None:
        if not self._with_logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self._token_text)
        offset = self._offsets.get(index, 0)
        out = completion_logprobs(entries, self._token_text, offset)
        self._offsets[index] = offset + sum(len(t) for t in out["tokens"])
        return out

    def body(self, choices: Sequence[ChoiceOutput], prompt_tokens: int) -> bytes:
        """The non-streaming response."""
        items = []
        for c in choices:
            item = {"index": c.index}
            if self.chat:
                item["message"] = {"role": "assistant", "content": c.text}
            else:
                item["text"] = c.text
            item["logprobs"] = self._logprobs(c.index, c.logprobs)
            item["finish_reason"] = c.finish_reason
            items.append(item)
        obj = "chat.completion" if self.chat else "text_completion"
        return encode_json({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                            "choices": items, "usage": usage(prompt_tokens, choices)})

    def _chunk(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = False) -> bytes:
        chunk = {"id": self.id, "object": self._object, "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            chunk["usage"] = usage_ if usage_ is not None or self.running_usage is None else self.running_usage()
        return b"data: " + encode_json(chunk) + b"\n\n"

    def role_chunk(self, index: int, with_usage: bool) -> bytes:
        """The first chunk of a chat choice: the assistant role, no content yet."""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None}], None, with_usage)

    def piece_chunk(self, index: int, piece: Piece, with_usage: bool) -> bytes | None:
        """A content chunk (and/or the finish chunk) for one piece; None when there is nothing to say."""
        if not piece.text and not piece.logprobs and piece.finish_reason is None:
            return None
        logprobs = self._logprobs(index, piece.logprobs) if piece.logprobs else None
        if self.chat:
            if not piece.text and not piece.logprobs:
                return self._chunk([{"index": index, "delta": {}, "logprobs": None,
                                     "finish_reason": piece.finish_reason}], None, with_usage)
            content = self._chunk([{"index": index, "delta": {"content": piece.text}, "logprobs": logprobs,
                                    "finish_reason": None}], None, with_usage)
            if piece.finish_reason is None:
                return content
            # OpenAI ends a choice with its own chunk: an empty delta and the finish reason.
            return content + self._chunk([{"index": index, "delta": {}, "logprobs": None,
                                           "finish_reason": piece.finish_reason}], None, with_usage)
        else:
            choice = {"index": index, "text": piece.text, "logprobs": logprobs, "finish_reason": piece.finish_reason}
        return self._chunk([choice], None, with_usage)

    def usage_chunk(self, choices: Sequence[ChoiceOutput], prompt_tokens: int) -> bytes:
        """The last chunk before ``[DONE]`` when ``stream_options.include_usage`` is set."""
        return self._chunk([], usage(prompt_tokens, choices), True)


DONE = b"data: [DONE]\n\n"


def error_event(body: dict) -> bytes:
    """An error after the stream started (the status line is already sent)."""
    return b"data: " + encode_json(body) + b"\n\n"
