"""OpenAI response bodies and stream chunks, as plain dicts encoded once with msgspec.

Shapes follow OpenAI's API reference: ``chat.completion`` / ``chat.completion.chunk`` and
``text_completion``. ``usage`` adds ``prompt_tokens_details.cached_tokens`` (prompt tokens the
worker found in its prefix cache) and, for a speculated request, ``spec_decode`` with the counters,
``acceptance_rate`` and ``mean_accepted_length`` as defined in :mod:`runtime.spec_stats` (vLLM's:
``1 + accepted_tokens / num_drafts``, the tokens emitted per target forward pass), and
``accepted_per_pos`` (verify steps whose accepted path reached position, or tree depth, i + 1), and
``plain_steps`` (decode steps that ran without a draft, by why: no draft worker, draft backed off,
late, malformed or empty, paused by acceptance, by load, no room); a rate that is undefined (no
drafts yet) is left out. A forced tool call answers ``message.tool_calls``
(streamed as ``delta.tool_calls``) with ``finish_reason: "tool_calls"``; a named function's call cut
short (``max_tokens``) is still ``tool_calls``, its arguments as far as they came, with
``finish_reason: "length"`` (as vLLM answers it).
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import msgspec

from runtime.spec_stats import acceptance_rate, mean_accepted_length

from .output import ChoiceOutput, LogprobEntry, Piece
from .structured import ToolCalls, tool_call, tool_call_id

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
        plain: dict[str, int] = {}
        for s in specs:
            for why, n in s.plain_steps.items():
                plain[why] = plain.get(why, 0) + n
        if plain:  # decode steps that ran without a draft, by why (runtime.messages.PLAIN_STEP_REASONS)
            spec["plain_steps"] = plain
        rates = {"acceptance_rate": acceptance_rate(accepted, draft_tokens),
                 "mean_accepted_length": mean_accepted_length(accepted, drafts)}
        spec.update((k, v) for k, v in rates.items() if v is not None)
        out["spec_decode"] = spec
    return out


def _token_entry(text: str, logprob: float, raw: bytes | None = None) -> dict:
    """One logprobs entry; ``raw``: the token's own bytes (a piece of a multi-byte character has no
    text of its own, only bytes), its text's UTF-8 when not given."""
    return {"token": text, "logprob": logprob, "bytes": list(text.encode() if raw is None else raw)}


def chat_logprobs(entries: Sequence[LogprobEntry], token_text: Callable[[int], str],
                  token_bytes: Callable[[int], bytes] | None = None) -> dict:
    def entry(token_id: int, logprob: float) -> dict:
        return _token_entry(token_text(token_id), logprob, token_bytes(token_id) if token_bytes else None)

    content = []
    for e in entries:
        item = entry(e.token_id, e.logprob)
        item["top_logprobs"] = [entry(t.token_id, t.logprob) for t in e.top]
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


@dataclass
class _ToolStream:
    """One choice's streamed tool call so far."""

    text: str = ""
    call_id: str = ""  # set once the call's first delta went out (named function)
    sent: int = 0  # characters of text already sent as content (tool_choice "auto")
    logprobs: list[LogprobEntry] = field(default_factory=list)  # held back with the text (tool_choice required)


class ResponseBuilder:
    """Builds the bodies and chunks of one request (one id, one creation time). With ``tools`` (a
    forced tool call) a chat choice that ends normally answers ``tool_calls`` instead of content:
    a named function's arguments stream as they come; the array of ``tool_choice: "required"`` is
    sent whole when it is complete."""

    def __init__(self, chat: bool, model: str, token_text: Callable[[int], str], with_logprobs: bool,
                 tools: ToolCalls | None = None, token_bytes: Callable[[int], bytes] | None = None):
        self.chat = chat
        self.tools = tools if chat else None
        self._tool_streams: dict[int, _ToolStream] = {}
        self.model = model
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self._token_text = token_text
        self._token_bytes = token_bytes
        self._with_logprobs = with_logprobs
        self._object = "chat.completion.chunk" if chat else "text_completion"
        self._offsets: dict[int, int] = {}
        # stream_options.continuous_usage_stats: the usage so far, for every chunk that carries one
        self.running_usage: Callable[[], dict] | None = None
        # text completions' echo: the prompt text each choice's text starts with (sent with its first chunk)
        self.echo: dict[int, str] = {}

    def _logprobs(self, index: int, entries: Sequence[LogprobEntry]) -> dict | None:
        if not self._with_logprobs:
            return None
        if self.chat:
            return chat_logprobs(entries, self._token_text, self._token_bytes)
        offset = self._offsets.get(index, 0)
        out = completion_logprobs(entries, self._token_text, offset)
        self._offsets[index] = offset + sum(len(t) for t in out["tokens"])
        return out

    def body(self, choices: Sequence[ChoiceOutput], prompt_tokens: int) -> bytes:
        """The non-streaming response."""
        items = []
        for c in choices:
            item = {"index": c.index}
            finish = c.finish_reason
            if self.chat:
                item["message"], finish = self.message(c)
            else:
                item["text"] = self.echo.get(c.index, "") + c.text
            item["logprobs"] = self._logprobs(c.index, c.logprobs)
            item["finish_reason"] = finish
            items.append(item)
        obj = "chat.completion" if self.chat else "text_completion"
        return encode_json({"id": self.id, "object": obj, "created": self.created, "model": self.model,
                            "choices": items, "usage": usage(prompt_tokens, choices)})

    def message(self, choice: ChoiceOutput) -> tuple[dict, str | None]:
        """A finished chat choice's assistant message, as the response carries it (and a client sends it
        back with the next turn), and its finish reason."""
        content, calls, finish = self._split(choice.text, choice.finish_reason)
        if calls:
            return {"role": "assistant", "content": content, "tool_calls": calls}, finish
        return {"role": "assistant", "content": choice.text}, finish

    def _chunk(self, choices: list[dict], usage_: dict | None = None, with_usage: bool = False) -> bytes:
        chunk = {"id": self.id, "object": self._object, "created": self.created, "model": self.model, "choices": choices}
        if with_usage:
            chunk["usage"] = usage_ if usage_ is not None or self.running_usage is None else self.running_usage()
        return b"data: " + encode_json(chunk) + b"\n\n"

    def _split(self, text: str, finish_reason: str | None) -> tuple[str | None, list[dict] | None, str | None]:
        """(content, tool calls, finish reason) of a chat choice. Calls that ended normally and parse:
        finish reason ``tool_calls``. A named function's call that did not (cut by max_tokens, say)
        is still its call, with the arguments so far and the choice's own finish reason, as vLLM
        answers it. Otherwise no calls (None): the whole text is the content."""
        if self.tools is None:
            return text, None, finish_reason
        if finish_reason == "stop":
            content, calls = self.tools.split(text)
            if calls:
                return content, calls, "tool_calls"
        if self.tools.name is not None:
            return None, [tool_call(self.tools.name, text)], finish_reason
        return text, None, finish_reason

    def role_chunk(self, index: int, with_usage: bool) -> bytes:
        """The first chunk of a chat choice: the assistant role, no content yet."""
        content = None if self.tools is not None and self.tools.parser is None else ""
        return self._chunk([{"index": index, "delta": {"role": "assistant", "content": content}, "logprobs": None,
                             "finish_reason": None}], None, with_usage)

    def piece_chunk(self, index: int, piece: Piece, with_usage: bool) -> bytes | None:
        """A content chunk (and/or the finish chunk) for one piece; None when there is nothing to say."""
        if not self.chat and index in self.echo:
            piece = Piece(self.echo.pop(index) + piece.text, piece.logprobs, piece.finish_reason)
        if not piece.text and not piece.logprobs and piece.finish_reason is None:
            return None
        if self.tools is not None:
            return self._tool_chunks(index, piece, with_usage)
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

    def _tool_chunks(self, index: int, piece: Piece, with_usage: bool) -> bytes | None:
        if self.tools.parser is not None:
            return self._auto_tool_chunks(index, piece, with_usage)
        st = self._tool_streams.setdefault(index, _ToolStream())
        st.text += piece.text
        out = b""
        if self.tools.name is not None:  # the arguments of a named function, as they come
            if piece.text or piece.logprobs:
                if not st.call_id:
                    st.call_id = tool_call_id()
                    call = {"index": 0, **tool_call(self.tools.name, piece.text, st.call_id)}
                else:
                    call = {"index": 0, "function": {"arguments": piece.text}}
                logprobs = self._logprobs(index, piece.logprobs) if piece.logprobs else None
                out += self._chunk([{"index": index, "delta": {"tool_calls": [call]}, "logprobs": logprobs,
                                     "finish_reason": None}], None, with_usage)
        else:
            st.logprobs.extend(piece.logprobs)
        if piece.finish_reason is None:
            return out or None
        _, calls, finish = self._split(st.text, piece.finish_reason)
        if self.tools.name is None:  # the whole array at once: calls, or the text that did not parse
            delta = {"tool_calls": [{"index": i, **call} for i, call in enumerate(calls)]} if calls else \
                {"content": st.text}
            if calls or st.text or st.logprobs:
                logprobs = self._logprobs(index, st.logprobs) if st.logprobs else None
                out += self._chunk([{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": None}],
                                   None, with_usage)
        return out + self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}], None,
                                 with_usage)

    def _auto_tool_chunks(self, index: int, piece: Piece, with_usage: bool) -> bytes | None:
        """tool_choice "auto": content streams until a tool call may begin (the parser's safe prefix);
        what follows is held and, when the choice ends, sent as tool calls (or as content after all)."""
        st = self._tool_streams.setdefault(index, _ToolStream())
        st.text += piece.text
        st.logprobs.extend(piece.logprobs)
        out = b""
        release = len(st.text) if piece.finish_reason is not None else self.tools.parser.safe_prefix(st.text)
        calls, finish = None, piece.finish_reason
        if piece.finish_reason is not None:
            content, calls, finish = self._split(st.text, piece.finish_reason)
            release = len(content or "") if calls else len(st.text)
        fresh = st.text[st.sent : release]
        if fresh or (st.logprobs and (release == len(st.text) or calls)):
            logprobs = self._logprobs(index, st.logprobs) if st.logprobs else None
            st.logprobs = []
            out += self._chunk([{"index": index, "delta": {"content": fresh}, "logprobs": logprobs,
                                 "finish_reason": None}], None, with_usage)
            st.sent = max(st.sent, release)
        if piece.finish_reason is None:
            return out or None
        if calls:
            out += self._chunk([{"index": index, "delta": {"tool_calls": [{"index": i, **c} for i, c in enumerate(calls)]},
                                 "logprobs": None, "finish_reason": None}], None, with_usage)
        return out + self._chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}], None,
                                 with_usage)

    def usage_chunk(self, choices: Sequence[ChoiceOutput], prompt_tokens: int) -> bytes:
        """The last chunk before ``[DONE]`` when ``stream_options.include_usage`` is set."""
        return self._chunk([], usage(prompt_tokens, choices), True)

    def done(self) -> bytes:
        return DONE

    def error_chunk(self, body: dict) -> bytes:
        return error_event(body)


DONE = b"data: [DONE]\n\n"


def error_event(body: dict) -> bytes:
    """An error after the stream started (the status line is already sent)."""
    return b"data: " + encode_json(body) + b"\n\n"
