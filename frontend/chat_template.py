"""Chat templates rendered with jinja2 alone, exactly as transformers' ``apply_chat_template`` renders them.

The frontend used to call transformers for this, which cost every frontend start some 2 s of imports
(transformers imports torch) before it could answer, and a restarted frontend the same. Dynamo's and
TGI's frontends render with a Jinja engine and tokenize with ``tokenizers`` for the same reason. The
output must stay byte for byte what transformers writes (the model was trained on that text), so
this module keeps transformers' environment (sandboxed, ``trim_blocks``, ``lstrip_blocks``, loop
controls, its ``tojson``, ``raise_exception``, ``strftime_now``, guarded ``dict`` and ``namespace``,
the ``{% generation %}`` tag) and its handling of the chat: keys whose value is None dropped, the
reasoning aliases (``reasoning_content``, ``thinking``, ``reasoning``), the named special tokens
(``bos_token``, ...) as variables that request variables override, and ``continue_final_message``
by a tag cut off after rendering. ``tests/unit/frontend/test_chat_template.py`` compares the two.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache

import jinja2
import jinja2.ext
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Names a message's reasoning is passed under; templates read the first.
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


class TemplateError(ValueError):
    """The template, or the chat given to it, cannot be rendered (the message says why)."""


class _Generation(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}``: marks the assistant's text for training masks; here
    it renders its body, as transformers does when no mask is asked for."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    # not jinja2's own tojson, which escapes HTML characters
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt):
    return datetime.now().strftime(fmt)


class _TemplateDict:
    """``dict(...)`` in a template, without the attributes of the type itself."""

    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """``namespace(...)`` that refuses underscore names (a way into CPython's internals)."""

    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}.")


@lru_cache(maxsize=32)
def compile_template(source: str) -> jinja2.Template:
    """The compiled template (cached: a model's template is compiled once); raises jinja2's errors."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(source)


def _plain(value):
    """A fresh copy made of JSON types only: the template sees no object with methods of its own, and
    the edits below never touch the caller's messages."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _alias_reasoning(chat: list[dict]) -> list[dict]:
    out = []
    for message in chat:
        reasoning = next((message[k] for k in REASONING_FIELDS if message.get(k) is not None), None)
        if reasoning is not None:
            message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        out.append(message)
    return out


def render(source: str, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = False,
           continue_final_message: bool = False, variables: Mapping | None = None) -> str:
    """``source`` applied to ``messages``: what ``apply_chat_template(messages, tools=tools,
    chat_template=source, tokenize=False, add_generation_prompt=..., continue_final_message=...,
    **variables)`` returns, where ``variables`` are the tokenizer's named special tokens updated with
    the request's template variables. Raises :class:`TemplateError` or jinja2's errors."""
    if not messages:
        raise TemplateError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise TemplateError("continue_final_message and add_generation_prompt are not compatible")
    template = compile_template(source)
    chat = []
    for message in messages:
        if not isinstance(message, Mapping):
            raise TemplateError(f"Chat messages should be dicts, but got {message!r}.")
        chat.append({k: v for k, v in message.items() if v is not None})
    chat = _alias_reasoning(_plain(chat))
    variables = _plain(dict(variables or {}))
    for name in ("messages", "tools", "documents", "add_generation_prompt"):
        if name in variables:
            raise TemplateError(f"the template variable {name!r} is set by the request itself")
    final = None
    if continue_final_message:
        final = chat[-1].get("content")
        if final is None:
            raise TemplateError('continue_final_message is set but the final message has no "content" to continue!')
        if "content" not in source:
            raise TemplateError('continue_final_message is set to "content" but this is not an accepted field in '
                                "the chat_template")
        if isinstance(final, (list, tuple)):
            for block in reversed(final):
                if "text" in block:
                    final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                    break
            else:
                raise TemplateError("continue_final_message is set but we could not find any text to continue in "
                                    "the final message!")
        else:
            chat[-1]["content"] = final + _CONTINUE_TAG
    text = template.render(messages=chat, tools=_plain(tools), documents=None,
                           add_generation_prompt=add_generation_prompt, **variables)
    if final is not None:
        if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
            raise TemplateError("continue_final_message is set but the final message does not appear in the chat "
                                "after applying the chat template")
        at = text.rindex(_CONTINUE_TAG.strip())
        text = text[:at] if text[at:at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()
    return text
