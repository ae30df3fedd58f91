"""OpenAI request schemas and their validation.

Contract: :func:`parse` turns a raw JSON body into a validated request or raises
:class:`runtime.InvalidRequest` whose ``field`` names the offending parameter (``messages[0].role``).
Validation is strict about what it knows: wrong JSON types are rejected rather than coerced, and
parameters we know but do not support are rejected by :func:`check_supported` unless they carry their
neutral value (``suffix: ""``, ``prompt_logprobs: null``, ...). Fields nobody here knows, at the top
level of a request, of a chat message, of ``stream_options`` or of Dynamo's ``nvext`` and
``nvext.agent_hints`` (SDKs and agent frameworks send vendor extras), are accepted and listed by
:func:`unknown_fields` for the caller to log and count, as vLLM does; ``strict`` makes them a 400
naming the field. Everything nested deeper (tools, response formats,
speculation options) stays closed: a typo there would change what is generated.
Structured outputs and tools are checked further in :mod:`.structured`; the ranges of the sampling
parameters once, for the frontend and the workers alike, in :func:`runtime.validation.validate_request`.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, TypeVar

import msgspec
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, WithJsonSchema

from runtime import InvalidRequest
from runtime.validation import MAX_LOGPROBS

MAX_INT64 = 2**63 - 1
MAX_TOKENS_LIMIT = 1 << 24  # far above any context length; keeps integers sane on the wire
MAX_STOP_STRINGS = 16
MAX_MESSAGES = 4096  # chat messages per request
MAX_PROMPTS = 1024  # prompts (strings or token-id lists) per completion request
MAX_STOP_TOKEN_IDS = 1024
MAX_SPECULATIVE_TOKENS = 64
MAX_TOOLS = 128  # tools per request, as OpenAI allows
MAX_GRAMMAR_CHARS = 1 << 20  # a schema, regex or choice list larger than this is refused
MAX_PRIORITY = 2**31 - 1  # |priority| (vLLM's and agent_hints'): an int32, as on every engine's wire
MAX_STRICT_PRIORITY = 255  # router queue tiers 0..255

R = TypeVar("R", bound=BaseModel)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Lenient(BaseModel):
    """Strict about the fields it declares; keeps unknown ones aside (``model_extra``), see :func:`unknown_fields`."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


class StreamOptions(Lenient):
    include_usage: bool = False
    # vLLM's extension (GuideLLM sends it): with include_usage, every chunk carries the usage so far.
    continuous_usage_stats: bool = False


class SpeculativeOptions(_Strict):
    """Tandem's extension: this request's speculation, in SGLang's names; a field left out keeps the
    worker's setting. ``num_draft_tokens`` 0 decodes without speculation; ``eagle_topk`` 1 drafts chains."""

    num_draft_tokens: int | None = Field(None, ge=0, le=MAX_SPECULATIVE_TOKENS)  # γ, or a tree's node budget
    eagle_topk: int | None = Field(None, ge=1, le=MAX_SPECULATIVE_TOKENS)  # children per node and depth
    num_steps: int | None = Field(None, ge=1, le=MAX_SPECULATIVE_TOKENS)  # tree depth


class AgentHints(Lenient):
    """Dynamo's ``nvext.agent_hints``. ``priority``: higher is served sooner (Dynamo's polarity; the
    opposite of the top-level ``priority``, vLLM's); ``strict_priority``: the router queue's tier, a
    higher one always first; ``osl``: the expected output length in tokens; ``speculative_prefill``:
    when the turn ends, prefill its whole context on the worker that served it, in the background, so
    that the next turn's prompt is a prefix-cache hit (:mod:`frontend.next_turn`). Other keys are vendor
    extras: ignored, logged and counted, a 400 with ``--strict-fields``."""

    priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    strict_priority: int | None = Field(None, ge=0, le=MAX_STRICT_PRIORITY)
    osl: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    speculative_prefill: bool | None = None


class NvExt(Lenient):
    """Dynamo's ``nvext`` request extensions; Tandem reads ``agent_hints``. Other keys are vendor
    extras (ignored, logged and counted; a 400 with ``--strict-fields``)."""

    agent_hints: AgentHints | None = None


class ToolCallFunction(_Strict):
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(_Strict):
    """A tool call of an earlier assistant turn, sent back with the conversation."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: ToolCallFunction


class ChatMessage(Lenient):
    """One chat message. Content is a string or a list of ``{"type": "text", "text": ...}`` parts;
    an assistant turn may carry ``tool_calls``, a ``tool`` message answers one (``tool_call_id``)."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, min_length=1)
    tool_call_id: str | None = Field(None, max_length=256)


FUNCTION_NAME = r"^[A-Za-z0-9_.-]{1,64}$"


class JsonSchemaFormat(_Strict):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None  # the schema is always enforced


class ResponseFormat(_Strict):
    """``{"type": "text" | "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class FunctionDefinition(_Strict):
    name: str = Field(pattern=FUNCTION_NAME)
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON Schema; absent: no arguments
    strict: bool | None = None  # the schema is always enforced


class ToolDefinition(_Strict):
    type: Literal["function"]
    function: FunctionDefinition


class ToolChoiceFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: call exactly this function."""

    type: Literal["function"]
    function: ToolChoiceFunction


class _Sampling(Lenient):
    """Parameters shared by chat and text completions."""

    model: str = Field(min_length=1, max_length=256)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOKENS_LIMIT)
    seed: int | None = Field(None, ge=-MAX_INT64 - 1, le=MAX_INT64)
    n: int = Field(1, ge=1)  # the upper bound is the frontend's --max-n (CompletionService.prepare)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_TOKENS_LIMIT)
    speculative: SpeculativeOptions | None = None
    user: str | None = None
    # vLLM's: lower values are served first (the router queue, and engines started with
    # --scheduling-policy priority); Dynamo's nvext.agent_hints.priority says the same the other way up
    priority: int | None = Field(None, ge=-MAX_PRIORITY, le=MAX_PRIORITY)
    nvext: NvExt | None = None
    # Structured outputs: OpenAI's response_format, or one of vLLM's guided_* extensions.
    response_format: ResponseFormat | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[str] | None = Field(None, min_length=1)
    # Logits processors (ranges checked by runtime.validation): OpenAI's penalties and logit_bias
    # (token ids as JSON object keys), vLLM's repetition_penalty and min_p.
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_p: float | None = None
    # Known but unsupported: accepted only with their neutral value (see check_supported).
    echo: bool | None = None  # honoured by text completions (the prompt's text before the completion's)
    functions: list[Any] | None = None
    function_call: Any = None
    prompt_logprobs: int | None = None  # the workers return no prompt logprobs


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS_LIMIT)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    modalities: list[str] | None = None
    store: bool | None = None
    tools: list[ToolDefinition] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # vLLM's chat-template extensions
    add_generation_prompt: bool = True  # open the assistant's turn after the messages
    continue_final_message: bool = False  # leave the last (assistant) message open, for the model to continue
    add_special_tokens: bool = False  # the tokenizer's own BOS etc. on top of what the template writes
    chat_template_kwargs: dict[str, Any] | None = None  # extra template variables (Qwen3's enable_thinking)


def _prompt(value: Any) -> Any:
    """A string, a list of strings, a list of token ids or a list of token-id lists. Checked here
    rather than declared as a union of the four: pydantic validates a value against every member of
    a union, and the members that fail list an error per item (500,000 of them for a 500k-token
    prompt: 0.2 s holding the GIL, on the event loop or off it). Here the types are counted in C."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        kinds = set(map(type, value))
        if kinds <= {str} or kinds == {int}:  # [] too: check_supported says it is empty
            return value
        if kinds == {list} and all(set(map(type, p)) <= {int} for p in value):
            return value
    raise ValueError("must be a string, an array of strings, an array of token ids or an array of arrays of "
                     "token ids")


_PROMPT_SCHEMA = {"anyOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}},
                            {"type": "array", "items": {"type": "integer"}},
                            {"type": "array", "items": {"type": "array", "items": {"type": "integer"}}}]}
Prompt = Annotated[Any, AfterValidator(_prompt), WithJsonSchema(_PROMPT_SCHEMA)]


class CompletionRequest(_Sampling):
    prompt: Prompt
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. around a text prompt


# name -> whether a value is the parameter's neutral one
_NEUTRAL = {
    "functions": lambda v: not v,
    "function_call": lambda v: v in (None, "none"),
    "modalities": lambda v: v is None or v == ["text"],
    "store": lambda v: not v,
    "suffix": lambda v: not v,
    "prompt_logprobs": lambda v: v is None,
}
# fields of the other endpoint: known, so a 400 naming them rather than ignored
_CHAT_ONLY = ("messages", "tools", "tool_choice", "parallel_tool_calls", "max_completion_tokens", "top_logprobs",
              "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "modalities")
_COMPLETION_ONLY = ("prompt", "suffix", "best_of")
# what a chat template is called with already: chat_template_kwargs may not set these
RESERVED_TEMPLATE_KWARGS = frozenset({"messages", "conversation", "tools", "documents", "chat_template", "tokenize",
                                      "add_generation_prompt", "continue_final_message", "return_dict",
                                      "return_tensors", "tokenizer_kwargs", "return_assistant_tokens_mask", "padding",
                                      "truncation", "max_length"})


_MAPS = frozenset({"logit_bias"})  # object parameters whose keys are data (token ids), not field names


def _param(loc: tuple) -> str:
    """``("messages", 0, "content")`` -> ``messages[0].content``; drops union-member tags."""
    if loc and loc[0] in _MAPS:
        return loc[0]
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part in ("str", "int", "float", "bool", "none") or "[" in part:
            continue
        else:
            out += f".{part}" if out else part
    return out


class _JsonSchemaSize(msgspec.Struct):
    schema: msgspec.Raw = msgspec.Raw()


class _FormatSize(msgspec.Struct):
    json_schema: _JsonSchemaSize | None = None


class _Bulk(msgspec.Struct):
    """The parts of a body that can be large, kept as raw JSON (found, not built into objects)."""

    messages: msgspec.Raw = msgspec.Raw()
    prompt: msgspec.Raw = msgspec.Raw()
    stop: msgspec.Raw = msgspec.Raw()
    stop_token_ids: msgspec.Raw = msgspec.Raw()
    tools: msgspec.Raw = msgspec.Raw()
    response_format: msgspec.Raw = msgspec.Raw()
    guided_json: msgspec.Raw = msgspec.Raw()


def _items(raw: msgspec.Raw) -> list[msgspec.Raw] | None:
    """The items of a raw JSON array (None: absent, or not an array)."""
    try:
        return msgspec.json.decode(raw, type=list[msgspec.Raw]) if raw else None
    except msgspec.DecodeError:
        return None


def _check_grammar_size(raw: msgspec.Raw, field: str) -> None:
    if len(raw) <= MAX_GRAMMAR_CHARS:
        return
    size = len(msgspec.json.format(raw, indent=-1))  # without the whitespace it was sent with
    if size > MAX_GRAMMAR_CHARS:
        raise InvalidRequest(f"the grammar is {size} bytes long as compact JSON; at most {MAX_GRAMMAR_CHARS} are "
                             f"allowed", field)


def _bulk(body: bytes) -> _Bulk | None:
    """The body's bulky parts as raw JSON (None: bad JSON, bad UTF-8, not an object, nesting too
    deep — the validation names the error)."""
    try:
        return msgspec.json.decode(body, type=_Bulk)
    except Exception:
        return None


def _check_counts(bulk: _Bulk) -> None:
    """Bounded counts and grammar sizes, checked on the raw JSON before the full validation builds
    and walks every item (milliseconds for a 4 MB body, where building it costs 0.1-0.5 s)."""
    limits = (("messages", MAX_MESSAGES), ("stop", MAX_STOP_STRINGS), ("stop_token_ids", MAX_STOP_TOKEN_IDS),
              ("tools", MAX_TOOLS))
    for name, limit in limits:
        items = _items(getattr(bulk, name))
        if items is not None and len(items) > limit:
            raise InvalidRequest(f"'{name}' has {len(items)} items; at most {limit} are allowed", name)
    head = bytes(memoryview(bulk.prompt)[:64]).lstrip()  # a list of prompts (or of token ids: not counted)?
    prompt = _items(bulk.prompt) if head[:1] == b"[" and head[1:].lstrip()[:1] in (b'"', b"[") else None
    if prompt and len(prompt) > MAX_PROMPTS:
        raise InvalidRequest(f"'prompt' has {len(prompt)} prompts; at most {MAX_PROMPTS} are allowed", "prompt")
    if bulk.response_format:
        try:
            fmt = msgspec.json.decode(bulk.response_format, type=_FormatSize)
        except msgspec.DecodeError:
            fmt = None
        if fmt is not None and fmt.json_schema is not None:
            _check_grammar_size(fmt.json_schema.schema, "response_format.json_schema.schema")
    if bulk.guided_json:
        _check_grammar_size(bulk.guided_json, "guided_json")


MAX_JSON_DEPTH = 200  # about where the validator's JSON parser stops (pydantic-core's recursion limit)


def _too_deep(body: bytes) -> str | None:
    """The top-level field of ``body`` that nests deepest, when the body is valid JSON."""
    try:
        data = msgspec.json.decode(body)
    except Exception:
        return None
    if not isinstance(data, dict):
        return None

    def depth(value) -> int:
        most, stack = 0, [(value, 1)]
        while stack:  # iterative: the point is a nesting too deep for recursion
            item, d = stack.pop()
            most = max(most, d)
            if isinstance(item, dict):
                stack.extend((v, d + 1) for v in item.values())
            elif isinstance(item, list):
                stack.extend((v, d + 1) for v in item)
        return most

    depths = {key: depth(value) for key, value in data.items()}
    return max(depths, key=depths.get) if depths else None


TOKEN_CHUNK_BYTES = 256 * 1024  # a token-id prompt is decoded this much at a time (about 40k ids)
_ID_ARRAY_BYTES = b"0123456789,- \t\r\n"  # all a flat JSON array of integers is made of


def _token_ids(raw: msgspec.Raw) -> list[int] | None:
    """A raw JSON array of integers, decoded a chunk at a time: each chunk is a millisecond or two in
    C, and between chunks a thread doing this lets the event loop have the GIL (decoded in one
    call, 500k ids hold it for 20-80 ms). None when ``raw`` is not a flat array of integers that
    decodes so (the full validation then says what is wrong)."""
    data = bytes(raw).strip()
    if data[:1] != b"[" or data[-1:] != b"]" or data[1:-1].translate(None, _ID_ARRAY_BYTES):
        return None
    inner, ids, start = data[1:-1], [], 0
    try:
        while start < len(inner):
            end = inner.find(b",", start + TOKEN_CHUNK_BYTES)
            end = len(inner) if end < 0 else end
            ids += msgspec.json.decode(b"[" + inner[start:end] + b"]", type=list[int])
            start = end + 1
    except msgspec.DecodeError:  # "1,,2", a trailing comma, an id beyond 64 bits, ...
        return None
    return ids


def parse(model: type[R], body: bytes) -> R:
    """Validate a JSON body as ``model``; raises :class:`InvalidRequest` naming the field."""
    bulk = _bulk(body)
    if bulk is not None:
        _check_counts(bulk)
        if model is CompletionRequest and len(bulk.prompt) > TOKEN_CHUNK_BYTES:
            ids = _token_ids(bulk.prompt)
            if ids:  # validate the rest, with a stand-in prompt; the ids are all this field needs
                parts = msgspec.json.decode(body, type=dict[str, msgspec.Raw])
                parts["prompt"] = msgspec.Raw(b"[0]")
                return _validate(model, msgspec.json.encode(parts)).model_copy(update={"prompt": ids})
    return _validate(model, body)


def _validate(model: type[R], body: bytes) -> R:
    try:
        return model.model_validate_json(body)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
    first = errors[0]
    kind, param = first["type"], _param(first["loc"])
    if kind == "json_invalid":
        msg = first["msg"].removeprefix("Invalid JSON: ")
        deep = _too_deep(body) if "recursion limit" in msg else None
        if deep is not None:  # valid JSON that the validator will not walk: name the field that nests
            raise InvalidRequest(f"'{deep}' is nested too deeply (the request body may nest at most "
                                 f"{MAX_JSON_DEPTH} levels)", deep)
        raise InvalidRequest(f"the request body is not valid JSON: {msg}")
    if kind == "model_type" and not param:
        raise InvalidRequest("the request body must be a JSON object")
    if kind == "extra_forbidden":
        raise InvalidRequest(f"Unsupported parameter: '{param}'", param)
    if kind == "missing":
        raise InvalidRequest(f"'{param}' is a required property", param)
    same = [e["msg"] for e in errors if _param(e["loc"]) == param]
    if len(same) > 1:  # a union: every alternative failed
        raise InvalidRequest(f"invalid value for '{param}': {'; or '.join(dict.fromkeys(same))}", param)
    raise InvalidRequest(f"invalid value for '{param}': {first['msg'].removeprefix('Value error, ')}", param)


def parse_request(model: type[R], body: bytes, strict: bool = False) -> R:
    """:func:`parse` and :func:`check_supported`: a request ready to prepare, or InvalidRequest."""
    req = parse(model, body)
    check_supported(req, strict)
    return req


def unknown_fields(req: BaseModel) -> list[str]:
    """The fields of ``req`` that no schema here declares: at the top level, in chat messages
    (``messages[2].refusal``) and in ``stream_options``."""
    out = [name for name in req.model_extra or ()]
    if "messages" in type(req).model_fields:  # (not an unknown field of that name)
        for i, msg in enumerate(req.messages or ()):
            out += [f"messages[{i}].{name}" for name in msg.model_extra or ()]
    options = req.stream_options if "stream_options" in type(req).model_fields else None
    if isinstance(options, BaseModel):
        out += [f"stream_options.{name}" for name in options.model_extra or ()]
    nvext = req.nvext if "nvext" in type(req).model_fields else None
    if isinstance(nvext, BaseModel):
        out += [f"nvext.{name}" for name in nvext.model_extra or ()]
        if nvext.agent_hints is not None:
            out += [f"nvext.agent_hints.{name}" for name in nvext.agent_hints.model_extra or ()]
    return out


def check_supported(req: _Sampling, strict: bool = False) -> None:
    """Reject known parameters set to anything but their neutral value, and bad combinations;
    ``strict``: unknown fields too."""
    if strict:
        unknown = unknown_fields(req)
        if unknown:
            raise InvalidRequest(f"Unsupported parameter: '{unknown[0]}'", unknown[0])
    for name, neutral in _NEUTRAL.items():
        if name in req.model_fields_set and not neutral(getattr(req, name)):
            raise InvalidRequest(f"'{name}' is not supported by this server", name)
    _check_hints(req)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    stops = stop_strings(req)
    if len(stops) > MAX_STOP_STRINGS:
        raise InvalidRequest(f"at most {MAX_STOP_STRINGS} stop strings are allowed", "stop")
    if any(not s for s in stops):
        raise InvalidRequest("stop strings must not be empty", "stop")
    if req.stop_token_ids and any(not 0 <= t <= MAX_INT64 for t in req.stop_token_ids):
        raise InvalidRequest("stop_token_ids must be non-negative token ids", "stop_token_ids")
    bad = next((k for k in req.logit_bias or () if not _is_token_id(k)), None)
    if bad is not None:
        raise InvalidRequest(f"logit_bias keys are token ids (non-negative integers), got {bad!r}", "logit_bias")
    if isinstance(req, ChatCompletionRequest):
        _check_chat(req)
    else:
        _check_completion(req)


def _check_hints(req: _Sampling) -> None:
    hints = req.nvext.agent_hints if req.nvext is not None else None
    if hints is None:
        return
    if hints.priority is not None and req.priority is not None and hints.priority != -req.priority:
        raise InvalidRequest("give either 'priority' (lower is sooner) or 'nvext.agent_hints.priority' (higher is "
                             "sooner), or two values that agree", "nvext.agent_hints.priority")


SESSION_HEADER = "X-Dynamo-Session-ID"  # Dynamo's canonical session header: agent harnesses already send it
MAX_SESSION_ID = 256
_SESSION_ID_CHARS = frozenset(map(chr, range(0x21, 0x7F)))


def session_header(headers) -> str:
    """The agent session a request belongs to (``X-Dynamo-Session-ID``; "" when absent): printable
    ASCII without spaces, at most 256 characters, else an :class:`InvalidRequest` naming the header."""
    value = headers.get(SESSION_HEADER.lower(), "")
    if value and (len(value) > MAX_SESSION_ID or not set(value) <= _SESSION_ID_CHARS):
        raise InvalidRequest(f"the {SESSION_HEADER} header must be 1 to {MAX_SESSION_ID} printable ASCII characters "
                             f"without spaces", SESSION_HEADER)
    return value


def engine_priority(req: _Sampling) -> int:
    """The request's priority in vLLM's convention (lower is served first; 0 by default)."""
    if req.priority is not None:
        return req.priority
    hints = req.nvext.agent_hints if req.nvext is not None else None
    return -hints.priority if hints is not None and hints.priority is not None else 0


def agent_hints(req: _Sampling) -> AgentHints | None:
    """The request's ``nvext.agent_hints`` (None: not sent)."""
    return req.nvext.agent_hints if req.nvext is not None else None


def _check_chat(req: ChatCompletionRequest) -> None:
    _not_here(req, _COMPLETION_ONLY, "text completions (/v1/completions)")
    check_messages(req.messages)
    if req.top_logprobs is not None and not req.logprobs:
        raise InvalidRequest("'top_logprobs' requires 'logprobs': true", "top_logprobs")
    if req.max_tokens is not None and req.max_completion_tokens is not None and req.max_tokens != req.max_completion_tokens:
        raise InvalidRequest("give either 'max_tokens' or 'max_completion_tokens', not two different values", "max_completion_tokens")
    if req.echo:
        raise InvalidRequest("'echo' is not supported for chat completions", "echo")
    if req.continue_final_message:
        if req.add_generation_prompt:
            raise InvalidRequest("'continue_final_message' needs 'add_generation_prompt': false (the model continues "
                                 "the last message instead of opening a new turn)", "continue_final_message")
    bad = next((k for k in req.chat_template_kwargs or () if k in RESERVED_TEMPLATE_KWARGS), None)
    if bad is not None:
        raise InvalidRequest(f"'{bad}' is set by the request itself, not by chat_template_kwargs",
                             f"chat_template_kwargs.{bad}")


def check_messages(messages: list[ChatMessage]) -> None:
    """Chat messages a template can render: text content, tool calls only on assistant turns."""
    if not messages:
        raise InvalidRequest("'messages' must contain at least one message", "messages")
    for i, msg in enumerate(messages):
        if isinstance(msg.content, list):
            for j, part in enumerate(msg.content):
                kind = part.get("type")
                if kind != "text":
                    raise InvalidRequest(f"content parts of type {kind!r} are not supported", f"messages[{i}].content[{j}].type")
                if set(part) != {"type", "text"} or not isinstance(part["text"], str):
                    raise InvalidRequest("a text part is {\"type\": \"text\", \"text\": <string>}", f"messages[{i}].content[{j}]")
        elif msg.content is None and msg.role != "assistant":
            raise InvalidRequest(f"a {msg.role} message needs 'content'", f"messages[{i}].content")
        if msg.tool_calls is not None and msg.role != "assistant":
            raise InvalidRequest("only assistant messages carry 'tool_calls'", f"messages[{i}].tool_calls")
        if (msg.tool_call_id is None) == (msg.role == "tool"):
            raise InvalidRequest("a tool message needs 'tool_call_id' (and only a tool message has one)",
                                 f"messages[{i}].tool_call_id")


def _not_here(req: _Sampling, names: tuple[str, ...], where: str) -> None:
    found = next((n for n in names if n in (req.model_extra or ())), None)
    if found is not None:
        raise InvalidRequest(f"'{found}' is a parameter of {where} only", found)


def _check_completion(req: CompletionRequest) -> None:
    _not_here(req, _CHAT_ONLY, "chat completions (/v1/chat/completions)")
    prompt = req.prompt
    # (a token id 0 is not an empty prompt: only strings and token-id lists inside a list are checked)
    if not prompt or (isinstance(prompt[0], (str, list)) and not all(prompt)):
        raise InvalidRequest("'prompt' must not be empty", "prompt")
    if req.best_of is not None and req.best_of != req.n:
        raise InvalidRequest("'best_of' other than 'n' is not supported", "best_of")
    if req.echo and req.logprobs is not None:
        raise InvalidRequest("'echo' with 'logprobs' needs the prompt's logprobs, which the workers do not return",
                             "echo")


def _is_token_id(key: str) -> bool:
    return key.isascii() and key.isdigit() and len(key) <= len(str(MAX_INT64))


def logit_bias(req: _Sampling) -> dict[int, float]:
    """The request's ``logit_bias`` with integer token ids (keys checked by :func:`check_supported`)."""
    return {int(k): v for k, v in (req.logit_bias or {}).items()}


def stop_strings(req: _Sampling) -> tuple[str, ...]:
    if req.stop is None:
        return ()
    return (req.stop,) if isinstance(req.stop, str) else tuple(req.stop)


def message_dicts(req: ChatCompletionRequest) -> list[dict[str, Any]]:
    """Messages as the plain dicts a chat template expects; text parts joined by newlines. Tool-call
    arguments go to the template as objects where they parse as one (what Hugging Face templates
    expect), else as the text sent."""
    return [template_message(msg) for msg in req.messages]


def template_message(msg: ChatMessage) -> dict[str, Any]:
    """One chat message as the plain dict a chat template expects (see :func:`message_dicts`)."""
    content = msg.content
    if isinstance(content, list):
        content = "\n".join(part["text"] for part in content)
    item: dict[str, Any] = {"role": msg.role, "content": content or ""}
    if msg.name:
        item["name"] = msg.name
    if msg.tool_call_id is not None:
        item["tool_call_id"] = msg.tool_call_id
    if msg.tool_calls:
        item["tool_calls"] = [{"id": call.id, "type": "function",
                               "function": {"name": call.function.name,
                                            "arguments": _maybe_object(call.function.arguments)}}
                              for call in msg.tool_calls]
    return item


def _maybe_object(text: str) -> Any:
    try:
        value = msgspec.json.decode(text)
    except msgspec.DecodeError:
        return text
    return value if isinstance(value, dict) else text


def prompts_of(req: CompletionRequest) -> list[str | list[int]]:
    """A completion request's prompts: each a string or a list of token ids."""
    prompt = req.prompt
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt[0], int):
        return [prompt]
    return list(prompt)


def openapi_body(model: type[BaseModel]) -> dict:
    """``openapi_extra`` that documents a body parsed by hand (we read it ourselves for the size limit)."""
    ref = {"$ref": f"#/components/schemas/{model.__name__}"}
    return {"requestBody": {"required": True, "content": {"application/json": {"schema": ref}}}}


def openapi_components(*models: type[BaseModel]) -> dict[str, dict]:
    """JSON schemas of ``models`` and everything they refer to, for ``components.schemas``."""
    out: dict[str, dict] = {}
    for model in models:
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        out.update(schema.pop("$defs", {}))
        out[model.__name__] = schema
    return out
