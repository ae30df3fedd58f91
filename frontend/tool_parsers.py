"""Tool calls in a model's own format, for ``tool_choice: "auto"`` (OpenAI's default with ``tools``).

With ``auto`` the model decides whether to call a tool, in the format its chat template taught it;
nothing constrains the output. A :class:`ToolParser` reads that format back: the reply's text
becomes ``content`` (what comes before the call) and ``tool_calls``. Families, as vLLM's
``--tool-call-parser`` names them:

- ``hermes`` (Hermes, Qwen 2/2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  once per call;
- ``mistral``: ``[TOOL_CALLS]`` then a JSON array of ``{"name", "arguments"}`` (the marker is a
  control token that detokenization drops, so an array alone at the start is read the same way);
- ``llama3_json`` (Llama 3.1/3.2/3.3 custom tools): the whole reply is ``{"name": ...,
  "parameters": {...}}`` (after an optional ``<|python_tag|>``), several separated by ``;``.

The family comes from the chat template (:func:`parser_for_template`) or by name
(:data:`PARSERS`). Streaming: :meth:`ToolParser.safe_prefix` says how much text can go out as
content before a call might begin; the rest is held until the choice ends and is then parsed.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass


def _call(name: str, arguments) -> dict:
    return {"name": name, "arguments": arguments if isinstance(arguments, str) else
            json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)}


def _held_tail(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def _before_space(text: str, end: int) -> int:
    """``end`` moved back over whitespace: the space before a call is not content (parse strips it)."""
    return len(text[:end].rstrip())


@dataclass(frozen=True)
class ToolParser:
    """Reads one family's tool calls (see the module docstring)."""

    name: str

    def parse(self, text: str) -> tuple[str, list[dict]] | None:
        """(content before the calls, [{"name", "arguments" (a JSON string)}]) or None: no call."""
        raise NotImplementedError

    def safe_prefix(self, text: str) -> int:
        """How many leading characters of a reply so far are content whatever follows."""
        raise NotImplementedError


class HermesParser(ToolParser):
    START, END = "<tool_call>", "</tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)

    def parse(self, text):
        at = text.find(self.START)
        if at < 0:
            return None
        calls = []
        for body in self._BLOCK.findall(text[at:]):
            try:
                obj = json.loads(body)
            except ValueError:
                return None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            calls.append(_call(obj["name"], obj.get("arguments", obj.get("parameters"))))
        return (text[:at].rstrip(), calls) if calls else None

    def safe_prefix(self, text):
        at = text.find(self.START)
        return _before_space(text, at if at >= 0 else len(text) - _held_tail(text, self.START))


class MistralParser(ToolParser):
    MARKER = "[TOOL_CALLS]"

    def parse(self, text):
        at = text.find(self.MARKER)
        content, body = (text[:at], text[at + len(self.MARKER):]) if at >= 0 else ("", text)
        body = body.strip()
        if at < 0 and not body.startswith("[{"):
            return None
        try:
            value = json.loads(body)
        except ValueError:
            return None
        value = value if isinstance(value, list) else [value]
        if not value or any(not isinstance(v, dict) or not isinstance(v.get("name"), str) for v in value):
            return None
        return content.rstrip(), [_call(v["name"], v.get("arguments", v.get("parameters"))) for v in value]

    def safe_prefix(self, text):
        at = text.find(self.MARKER)
        if at >= 0:
            return at
        if not text.strip() or text.lstrip().startswith("["):  # a bare array at the start may be the call
            return 0
        return _before_space(text, len(text) - _held_tail(text, self.MARKER))


class Llama3JsonParser(ToolParser):
    TAG = "<|python_tag|>"

    def parse(self, text):
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].strip()
        if not body.startswith("{"):
            return None
        calls = []
        decoder = json.JSONDecoder()
        at = 0
        while at < len(body):
            try:
                obj, end = decoder.raw_decode(body, at)
            except ValueError:
                return None
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            calls.append(_call(obj["name"], obj.get("parameters", obj.get("arguments"))))
            at = end
            while at < len(body) and body[at] in " \t\n;":
                at += 1
        return ("", calls) if calls else None

    def safe_prefix(self, text):
        head = text.lstrip()
        if not head or head.startswith("{") or self.TAG.startswith(head[: len(self.TAG)]) or head.startswith(self.TAG):
            return 0  # a reply that is (or may become) a call is held whole
        return len(text)


PARSERS: dict[str, ToolParser] = {p.name: p for p in (HermesParser("hermes"), MistralParser("mistral"),
                                                       Llama3JsonParser("llama3_json"))}


def parser_for_template(template: str) -> ToolParser | None:
    """The family a chat template teaches its model (None: the template renders no tool calls)."""
    if "<tool_call>" in template:
        return PARSERS["hermes"]
    if "[TOOL_CALLS]" in template:
        return PARSERS["mistral"]
    if "<|python_tag|>" in template or ('"parameters"' in template and "tools" in template):
        return PARSERS["llama3_json"]
    return None
