"""How a :class:`~runtime.messages.StructuredOutput` becomes a grammar: one recipe for the frontend,
which compiles it to check a request before sending it, and the target worker, which enforces it.

The grammar engine is llguidance (imported on first use); :func:`grammar_text` gives its grammar
text, which the worker compiles against its tokenizer and the frontend validates without one.
"""

from __future__ import annotations

import json

from .messages import StructuredOutput

# JSON without free whitespace, separated like json.dumps: a small model cannot pad the output with
# endless newlines, and a schema may still opt in with {"x-guidance": {"whitespace_flexible": true}}.
JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_kind(spec: StructuredOutput) -> str:
    """``json_schema``, ``regex`` or ``choice``: the one field of ``spec`` that is set; ``ValueError``
    unless exactly one is."""
    kinds = [name for name, value in (("json_schema", spec.json_schema), ("regex", spec.regex),
                                      ("choice", spec.choice)) if value]
    if len(kinds) != 1:
        raise ValueError(f"a structured output needs exactly one of json_schema, regex, choice; got {kinds}")
    return kinds[0]


def grammar_text(spec: StructuredOutput) -> str:
    """llguidance's grammar for ``spec``; ``ValueError`` for a spec without exactly one field set (and
    from llguidance for some schemas). Whether the grammar compiles shows when it is compiled."""
    from llguidance import LLMatcher

    kind = grammar_kind(spec)
    if kind == "json_schema":
        return LLMatcher.grammar_from_json_schema(spec.json_schema, defaults=JSON_OPTIONS)
    if kind == "regex":
        return LLMatcher.grammar_from_regex(spec.regex)
    return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in spec.choice))
