"""Structured outputs and forced tool calls: which grammar a request asks for, checked before it is sent.

Contract: :func:`structured_output` turns a validated request into an :class:`OutputGrammar`: the
:class:`StructuredOutput` the target worker enforces (a JSON schema, a regex or a choice), the
parameter it came from, and a :class:`ToolCalls` when the output is a tool call; or raises
:class:`InvalidRequest` naming the parameter. Sources, at most one per request:

- ``response_format``: ``json_object`` (any JSON object) or ``json_schema`` (its ``schema``;
  enforced whether or not ``strict`` is set);
- vLLM's extensions ``guided_json``, ``guided_regex``, ``guided_choice``;
- ``tool_choice`` ``"required"`` (a JSON array of one or more ``{"name", "arguments"}`` objects,
  each against its function's parameters; one only with ``parallel_tool_calls: false``) or a
  named function (the output is that function's arguments), as vLLM does.

``tool_choice`` ``"auto"`` (OpenAI's default when ``tools`` are given) constrains nothing: the model
answers in its own tool-call format, read back by :mod:`frontend.tool_parsers` (chosen from its chat
template; a template without one is a 400); ``"none"`` ignores ``tools``. Every schema is compiled
here once, as the workers compile it (:mod:`runtime.structured`: llguidance, the same JSON options;
only without the tokenizer), so a schema the engine cannot handle is a 400 naming its field, not a
failed stream. Whether the rest of the request goes with a grammar (``ignore_eos``, ``min_tokens``)
is :func:`runtime.validation.validate_request`'s to say.
"""

from __future__ import annotations

import functools
import json
import uuid
from dataclasses import dataclass
from typing import Any

import msgspec

from runtime import InvalidRequest
from runtime.messages import StructuredOutput
from runtime.structured import grammar_kind, grammar_text

from .protocol import MAX_GRAMMAR_CHARS, ChatCompletionRequest, CompletionRequest, NamedToolChoice, ToolDefinition
from .tool_parsers import PARSERS, ToolParser, parser_for_template

JSON_OBJECT = {"type": "object"}
NO_ARGUMENTS = {"type": "object", "properties": {}, "additionalProperties": False}
CACHED_GRAMMAR_CHARS = 1 << 16  # verdicts on grammars up to this size are remembered (256 of them)


def _grammar_error(spec: StructuredOutput) -> str:
    """llguidance's complaint about the grammar the workers would compile ("" when it compiles);
    milliseconds for a large schema."""
    key = (spec.json_schema, spec.regex, tuple(spec.choice))
    return _cached_grammar_error(*key) if _size(spec) <= CACHED_GRAMMAR_CHARS else _compile_error(*key)


@functools.lru_cache(maxsize=256)
def _cached_grammar_error(json_schema: str, regex: str, choice: tuple[str, ...]) -> str:
    return _compile_error(json_schema, regex, choice)


def _compile_error(json_schema: str, regex: str, choice: tuple[str, ...]) -> str:
    from llguidance import LLMatcher

    try:
        grammar = grammar_text(StructuredOutput(json_schema, regex, list(choice)))
    except ValueError as exc:
        return str(exc)
    return LLMatcher.validate_grammar(grammar)


def probe(grammar: OutputGrammar, tokenizer_info) -> None:
    """Check that the model's tokens can follow ``grammar`` through its first token (blocking: run it
    in a thread; llguidance releases the GIL while it works). A grammar llguidance compiles may still
    be one its matcher cannot follow — a ``$ref`` cycle or a schema nested past its recursion limit
    (no first token), a repetition count in the millions (a first token, whose lexer step then gives
    up: "too many expressions") — which the workers would answer with an empty reply; here it is a
    400 naming the field, before anything is generated. ``tokenizer_info``: llguidance's
    ``LLTokenizer`` for the model (None: not checked)."""
    if grammar.spec is None or tokenizer_info is None:
        return
    from llguidance import LLMatcher

    matcher = LLMatcher(tokenizer_info, grammar_text(grammar.spec), log_level=0)
    mask = b"" if matcher.is_error() else matcher.compute_bitmask()
    first = next((i for i, byte in enumerate(mask) if byte), None)
    if first is not None:  # the lowest allowed token id (the mask is little-endian bits over token ids)
        token = 8 * first + (mask[first] & -mask[first]).bit_length() - 1
        matcher.consume_token(token)
    if matcher.is_error() or first is None:
        reason = matcher.get_error().strip().splitlines()[0] if matcher.get_error() else "no token can start it"
        raise InvalidRequest(f"the model cannot follow this {grammar_kind(grammar.spec).replace('_', ' ')}: {reason}",
                             grammar.field)


def _size(spec: StructuredOutput) -> int:
    return len(spec.json_schema) + len(spec.regex) + sum(len(c) + 3 for c in spec.choice)


def _checked(spec: StructuredOutput, field: str) -> StructuredOutput:
    size = _size(spec)
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"the grammar is {size} characters long; at most {MAX_GRAMMAR_CHARS} are allowed", field)
    error = _grammar_error(spec)
    if error:
        raise InvalidRequest(f"this {grammar_kind(spec).replace('_', ' ')} is not supported: {error.strip()}", field)
    return spec


def _schema(schema: dict[str, Any], field: str) -> StructuredOutput:
    return _checked(StructuredOutput(json_schema=msgspec.json.encode(schema).decode()), field)


@dataclass(frozen=True)
class ToolCalls:
    """How a choice's text becomes OpenAI ``tool_calls``: ``name`` set, the text is that function's
    arguments; ``parser`` set (``tool_choice: "auto"``), the model's own format, read by that
    :class:`~frontend.tool_parsers.ToolParser` after any content; neither, it is a JSON array of
    ``{"name", "arguments"}``. ``auto``: the request asked for ``"auto"`` (the parser comes from the
    model's chat template, see :meth:`for_template`)."""

    name: str | None = None
    auto: bool = False
    parser: ToolParser | None = None

    def for_template(self, template: str, parser_name: str | None = None) -> ToolCalls:
        """This request's tool calls for a model with chat template ``template`` (``auto``: the
        parser named ``parser_name`` (``--tool-call-parser``), else the template's; a template with
        no tool-call format the server reads is a 400)."""
        if not self.auto:
            return self
        parser = PARSERS[parser_name] if parser_name is not None else parser_for_template(template)
        if parser is None:
            raise InvalidRequest("tool_choice 'auto' needs a model whose chat template renders tool calls in a format "
                                 "this server parses (Hermes/Qwen <tool_call>, Mistral [TOOL_CALLS], Llama 3 JSON); "
                                 "this model's has none: use tool_choice 'required' or name a function", "tool_choice")
        return ToolCalls(auto=True, parser=parser)

    def split(self, text: str) -> tuple[str | None, list[dict] | None]:
        """(content, tool calls) of a finished reply: calls None when there are none (or they do not
        parse: e.g. cut off by max_tokens), and then the content is the whole text."""
        if self.parser is None:
            calls = self.parse(text)
            return (None, calls) if calls else (text, None)
        found = self.parser.parse(text)
        if found is None:
            return text, None
        content, calls = found
        return content or None, [tool_call(c["name"], c["arguments"]) for c in calls]

    def parse(self, text: str) -> list[dict] | None:
        """The tool calls in ``text`` (None when it does not parse: e.g. cut off by max_tokens)."""
        if self.parser is not None:
            return self.split(text)[1]
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is not None:
            return [tool_call(self.name, text)] if isinstance(value, dict) else None
        if not isinstance(value, list) or not value:
            return None
        calls = []
        for item in value:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return None
            calls.append(tool_call(item["name"], json.dumps(item.get("arguments", {}), ensure_ascii=False)))
        return calls


def tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def tool_call(name: str, arguments: str, call_id: str | None = None) -> dict:
    return {"id": call_id or tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_choice(req: ChatCompletionRequest) -> tuple[StructuredOutput | None, ToolCalls | None]:
    tools: list[ToolDefinition] = req.tools or []
    choice = req.tool_choice
    if not tools:
        if choice not in (None, "none"):
            raise InvalidRequest("'tool_choice' needs 'tools'", "tool_choice")
        return None, None
    names = [t.function.name for t in tools]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise InvalidRequest(f"two tools are named {name!r}", f"tools[{i}].function.name")
    if choice == "none":
        return None, None
    params = [t.function.parameters if t.function.parameters is not None else NO_ARGUMENTS for t in tools]
    for i, schema in enumerate(params):  # each one on its own, so the error names the tool
        _schema(schema, f"tools[{i}].function.parameters")
    if choice is None or choice == "auto":  # the model's own format, unconstrained (see tool_parsers)
        return None, ToolCalls(auto=True)
    if isinstance(choice, NamedToolChoice):
        name = choice.function.name
        if name not in names:
            raise InvalidRequest(f"tool_choice names {name!r}, which is not among 'tools'", "tool_choice.function.name")
        return _schema(params[names.index(name)], "tool_choice"), ToolCalls(name)
    calls = {"anyOf": [{"type": "object", "properties": {"name": {"const": name}, "arguments": schema},
                        "required": ["name", "arguments"], "additionalProperties": False}
                       for name, schema in zip(names, params)]}
    array = {"type": "array", "items": calls, "minItems": 1}
    if req.parallel_tool_calls is False:
        array["maxItems"] = 1
    return _schema(array, "tools"), ToolCalls()


def asks_for_grammar(req: ChatCompletionRequest | CompletionRequest) -> bool:
    """Whether :func:`structured_output` has anything to do (cheap: no compiling)."""
    fmt = req.response_format
    if (fmt is not None and fmt.type != "text") or req.guided_json is not None or req.guided_regex is not None \
            or req.guided_choice is not None:
        return True
    return isinstance(req, ChatCompletionRequest) and bool(req.tools or req.tool_choice not in (None, "none"))


@dataclass(frozen=True)
class OutputGrammar:
    spec: StructuredOutput | None  # None: nothing constrains the output (tool_choice "auto")
    field: str  # the parameter that asked for it
    tools: ToolCalls | None = None  # a forced tool call: how to read the output


def structured_output(req: ChatCompletionRequest | CompletionRequest) -> OutputGrammar | None:
    """The grammar ``req`` asks for (None: unconstrained)."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = req.response_format
    if fmt is not None and fmt.type == "json_object":
        found.append(("response_format", _schema(JSON_OBJECT, "response_format")))
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise InvalidRequest("a json_schema response_format needs 'json_schema.schema'", "response_format.json_schema")
        found.append(("response_format", _schema(fmt.json_schema.schema_, "response_format.json_schema.schema")))
    if req.guided_json is not None:
        schema = req.guided_json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except ValueError:
                raise InvalidRequest("'guided_json' is not valid JSON", "guided_json") from None
        if not isinstance(schema, dict):
            raise InvalidRequest("'guided_json' must be a JSON schema object", "guided_json")
        found.append(("guided_json", _schema(schema, "guided_json")))
    if req.guided_regex is not None:
        found.append(("guided_regex", _checked(StructuredOutput(regex=req.guided_regex), "guided_regex")))
    if req.guided_choice is not None:
        if any(not c for c in req.guided_choice):
            raise InvalidRequest("'guided_choice' strings must not be empty", "guided_choice")
        found.append(("guided_choice", _checked(StructuredOutput(choice=list(req.guided_choice)), "guided_choice")))
    tools = None
    if isinstance(req, ChatCompletionRequest):
        spec, tools = _tool_choice(req)
        if spec is not None:
            found.append(("tool_choice", spec))
        elif tools is not None:  # tool_choice "auto": no grammar, but the reply may carry calls
            if found:
                raise InvalidRequest(f"'{found[0][0]}' cannot be combined with tool_choice 'auto' (the model answers "
                                     f"tool calls in its own format): use tool_choice 'required' or a named function",
                                     found[0][0])
            return OutputGrammar(None, "tool_choice", tools)
    if len(found) > 1:
        raise InvalidRequest(f"'{found[1][0]}' cannot be combined with '{found[0][0]}': one output grammar per request",
                             found[1][0])
    if not found:
        return None
    field, spec = found[0]
    return OutputGrammar(spec, field, tools if field == "tool_choice" else None)
