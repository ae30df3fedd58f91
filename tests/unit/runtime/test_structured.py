"""One grammar recipe for the frontend's check and the worker's matcher."""

from __future__ import annotations

import json

import pytest

from runtime.messages import StructuredOutput
from runtime.structured import JSON_OPTIONS, grammar_kind, grammar_text

pytestmark = pytest.mark.unit


def test_one_grammar_recipe_for_frontend_and_workers():
    """JSON schemas compile with the workers' JSON options (compact JSON), whoever compiles them."""
    [grammar] = json.loads(grammar_text(StructuredOutput(json_schema='{"type": "object"}')))["grammars"]
    assert grammar["json_schema"] == {"type": "object", "x-guidance": JSON_OPTIONS}
    assert grammar_text(StructuredOutput(choice=["yes", "no"])) == 'start: "yes" | "no"'
    assert grammar_kind(StructuredOutput(regex="a+")) == "regex"
    for bad in (StructuredOutput(), StructuredOutput(regex="a", choice=["a"])):
        with pytest.raises(ValueError, match="exactly one"):
            grammar_text(bad)
