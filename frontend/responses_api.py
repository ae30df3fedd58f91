"""OpenAI's Responses API (``POST /v1/responses``) over the chat completion path.

A request's ``instructions`` and ``input`` (a string, or a list of message items whose content is a
string or ``input_text`` / ``output_text`` parts) become chat messages; ``max_output_tokens``,
``temperature`` and ``top_p`` the chat request's. What this server cannot do (stored responses,
tools, non-text input, structured text formats, reasoning options) is a 400 naming the field.

The answer is a ``response`` object whose ``output`` holds one assistant ``message`` with one
``output_text`` part. Streamed, it is the Responses event sequence: ``response.created``,
``response.in_progress``, ``response.output_item.added``, ``response.content_part.added``,
``response.output_text.delta``..., ``response.output_text.done``, ``response.content_part.done``,
``response.output_item.done`` and ``response.completed`` (as vLLM does, also when the output was cut
at ``max_output_tokens``: the response's ``status`` is then ``incomplete``), each event with its
``sequence_number``.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from pydantic import Field

from runtime import InvalidRequest

from .output import ChoiceOutput, Piece
from .protocol import (MAX_MESSAGES, MAX_TOKENS_LIMIT, ChatCompletionRequest, Lenient, check_supported, parse,
                       unknown_fields)
from .responses import encode_json, new_id, usage

_ROLES = ("user", "assistant", "system", "developer")
_TEXT_PARTS = ("input_text", "output_text")


class ResponsesRequest(Lenient):
    """The fields of OpenAI's ``responses.create`` this server knows (unknown ones: see :mod:`.protocol`)."""

    model: str = Field(min_length=1, max_length=256)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = None
    top_p: float | None = None
    stream: bool = False
    user: str | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool | None = None
    stream_options: dict[str, Any] | None = None  # include_obfuscation: nothing here is obfuscated
    # known, honoured only with their neutral value
    store: bool | None = None
    previous_response_id: str | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: str | None = None
    include: list[Any] | None = None
    background: bool | None = None
    top_logprobs: int | None = None


_NEUTRAL = {
    "store": (lambda v: not v, "responses are not stored here; send 'store': false or leave it out"),
    "previous_response_id": (lambda v: v is None, "responses are not stored here, so none can be continued"),
    "tools": (lambda v: not v, "tools are not supported on /v1/responses; use /v1/chat/completions"),
    "tool_choice": (lambda v: v in (None, "none", "auto"), "tools are not supported on /v1/responses"),
    "text": (lambda v: not v or v == {"format": {"type": "text"}}, "only the text format {'type': 'text'} is supported"),
    "reasoning": (lambda v: not v or not any(v.values()), "reasoning options are not supported"),
    "truncation": (lambda v: v in (None, "disabled"), "only 'truncation': 'disabled' is supported"),
    "include": (lambda v: not v, "no additional output data can be included"),
    "background": (lambda v: not v, "background responses are not supported"),
    "top_logprobs": (lambda v: not v, "logprobs are not supported on /v1/responses; use /v1/chat/completions"),
}

# chat request fields -> the Responses API's names for them (in error messages)
_NAMES = {"max_completion_tokens": "max_output_tokens", "messages": "input"}


def renamed(exc: InvalidRequest) -> InvalidRequest:
    field, msg = exc.field or "", str(exc)
    for chat_name, name in _NAMES.items():
        msg = msg.replace(f"'{chat_name}'", f"'{name}'")
        if field == chat_name or field.startswith(chat_name + "["):
            field = name + field[len(chat_name):]
    return InvalidRequest(msg, field or None)


def _text(content: Any, where: str) -> str:
    """An input item's content as text: a string, or the texts of its text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest("content is a string or a list of input_text parts", where)
    texts = []
    for j, part in enumerate(content):
        if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS:
            kind = part.get("type") if isinstance(part, dict) else None
            raise InvalidRequest(f"content parts of type {kind!r} are not supported (only input_text)", f"{where}[{j}].type")
        if not isinstance(part.get("text"), str):
            raise InvalidRequest("a text part is {\"type\": \"input_text\", \"text\": <string>}", f"{where}[{j}].text")
        texts.append(part["text"])
    return "\n".join(texts)


def messages_of(req: ResponsesRequest) -> list[dict[str, str]]:
    """The chat messages a Responses request stands for."""
    messages = [{"role": "system", "content": req.instructions}] if req.instructions else []
    if isinstance(req.input, str):
        return messages + [{"role": "user", "content": req.input}]
    if not req.input:
        raise InvalidRequest("'input' must contain at least one item", "input")
    if len(req.input) > MAX_MESSAGES:
        raise InvalidRequest(f"'input' has {len(req.input)} items; at most {MAX_MESSAGES} are allowed", "input")
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind != "message":
            raise InvalidRequest(f"input items of type {kind!r} are not supported (only messages)", f"input[{i}].type")
        role = item.get("role")
        if role not in _ROLES:
            raise InvalidRequest(f"role must be one of {', '.join(_ROLES)}", f"input[{i}].role")
        if "content" not in item:
            raise InvalidRequest("a message needs 'content'", f"input[{i}].content")
        messages.append({"role": role, "content": _text(item["content"], f"input[{i}].content")})
    return messages


def parse_responses(body: bytes, strict: bool = False) -> tuple[ResponsesRequest, ChatCompletionRequest]:
    """A Responses request and the chat request that serves it, or InvalidRequest naming the field."""
    req = parse(ResponsesRequest, body)
    unknown = unknown_fields(req)
    if strict and unknown:
        raise InvalidRequest(f"Unsupported parameter: '{unknown[0]}'", unknown[0])
    for name, (neutral, why) in _NEUTRAL.items():
        if not neutral(getattr(req, name)):
            raise InvalidRequest(f"'{name}' is not supported by this server: {why}", name)
    chat = {"model": req.model, "messages": messages_of(req), "stream": req.stream}
    for name, value in (("max_completion_tokens", req.max_output_tokens), ("temperature", req.temperature),
                        ("top_p", req.top_p), ("user", req.user)):
        if value is not None:
            chat[name] = value
    try:  # through JSON, so that a bad value is named as in any other request
        chat_req = parse(ChatCompletionRequest, encode_json(chat))
        check_supported(chat_req)
    except InvalidRequest as exc:
        raise renamed(exc) from None
    return req, chat_req


class ResponsesBuilder:
    """The ``response`` object of one request, whole or as the Responses event stream; the same
    interface as :class:`frontend.responses.ResponseBuilder`, for one choice."""

    chat = True  # the stream opens with role_chunk
    running_usage = None

    def __init__(self, req: ResponsesRequest, model: str):
        self.req = req
        self.model = model
        self.id = new_id("resp")
        self.item_id = new_id("msg")
        self.created = int(time.time())
        self._seq = 0
        self._text: list[str] = []

    # ---------------------------------------------------------------- the response object

    def _response(self, status: str, output: list[dict], usage_: dict | None, finish_reason: str | None = None) -> dict:
        req = self.req
        incomplete = {"reason": "max_output_tokens"} if finish_reason == "length" else None
        return {
            "id": self.id, "object": "response", "created_at": self.created,
            "status": "incomplete" if incomplete else status, "error": None, "incomplete_details": incomplete,
            "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": bool(req.parallel_tool_calls), "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False,
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "text": {"format": {"type": "text"}}, "tool_choice": "none", "tools": [],
            "top_p": 1.0 if req.top_p is None else req.top_p, "truncation": "disabled", "usage": usage_,
            "user": req.user, "metadata": req.metadata or {},
        }

    @staticmethod
    def _usage(prompt_tokens: int, choices: Sequence[ChoiceOutput]) -> dict:
        u = usage(prompt_tokens, choices)
        details = {**u["prompt_tokens_details"], "cache_write_tokens": 0}
        out = {"input_tokens": u["prompt_tokens"], "input_tokens_details": details,
               "output_tokens": u["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
               "total_tokens": u["total_tokens"]}
        if "spec_decode" in u:
            out["spec_decode"] = u["spec_decode"]
        return out

    def _part(self, text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def _message(self, status: str, content: list[dict]) -> dict:
        return {"type": "message", "id": self.item_id, "status": status, "role": "assistant", "content": content}

    def body(self, choices: Sequence[ChoiceOutput], prompt_tokens: int) -> bytes:
        """The non-streaming response."""
        [c] = choices
        status = "incomplete" if c.finish_reason == "length" else "completed"
        output = [self._message(status, [self._part(c.text)])]
        return encode_json(self._response("completed", output, self._usage(prompt_tokens, choices), c.finish_reason))

    # ---------------------------------------------------------------- the event stream

    def _event(self, kind: str, **fields) -> bytes:
        event = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + encode_json(event) + b"\n\n"

    def role_chunk(self, index: int, with_usage: bool) -> bytes:
        """The opening events: the response created and in progress, its message and text part added."""
        at = {"output_index": 0, "item_id": self.item_id}
        return (self._event("response.created", response=self._response("in_progress", [], None))
                + self._event("response.in_progress", response=self._response("in_progress", [], None))
                + self._event("response.output_item.added", output_index=0, item=self._message("in_progress", []))
                + self._event("response.content_part.added", **at, content_index=0, part=self._part("")))

    def piece_chunk(self, index: int, piece: Piece, with_usage: bool) -> bytes | None:
        """A text delta; at the end of the choice the text, its part and its message done."""
        out = b""
        at = {"output_index": 0, "item_id": self.item_id, "content_index": 0}
        if piece.text:
            self._text.append(piece.text)
            out += self._event("response.output_text.delta", **at, delta=piece.text, logprobs=[])
        if piece.finish_reason is not None:
            text = "".join(self._text)
            status = "incomplete" if piece.finish_reason == "length" else "completed"
            out += (self._event("response.output_text.done", **at, text=text, logprobs=[])
                    + self._event("response.content_part.done", **at, part=self._part(text))
                    + self._event("response.output_item.done", output_index=0,
                                  item=self._message(status, [self._part(text)])))
        return out or None

    def usage_chunk(self, choices: Sequence[ChoiceOutput], prompt_tokens: int) -> bytes:
        """``response.completed``: the whole response, usage included."""
        [c] = choices
        status = "incomplete" if c.finish_reason == "length" else "completed"
        output = [self._message(status, [self._part(c.text)])]
        return self._event("response.completed",
                           response=self._response("completed", output, self._usage(prompt_tokens, choices),
                                                   c.finish_reason))

    def done(self) -> bytes:
        return b""  # the Responses stream ends with response.completed, no [DONE]

    def error_chunk(self, body: dict) -> bytes:
        """An ``error`` event, after the stream started."""
        err = body.get("error", {})
        return self._event("error", code=err.get("code"), message=err.get("message", ""), param=err.get("param"))
