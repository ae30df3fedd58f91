"""Typed settings groups: pydantic models behind the JSON-valued flags (vLLM's ``--speculative-config``
style), so that a group of related settings is one flag, validated in one place, with errors that name
the flag and the key.

A group is a :class:`Group` subclass (frozen, unknown keys refused). :func:`parse_group` reads a flag's
value (a JSON object, or ``@PATH`` to a file holding one) into it; :func:`one_line` turns pydantic's
multi-line ``ValidationError`` into the one line a service prints before it exits
(:func:`runtime.service.exit_on_bad_config`). Light to import: pydantic only.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

G = TypeVar("G", bound="Group")


class Group(BaseModel):
    """A typed settings group: frozen, keyword-built, unknown keys an error."""

    model_config = ConfigDict(frozen=True, extra="forbid")


def one_line(exc: ValidationError, what: str = "", flags: Mapping[str, str] | None = None) -> str:
    """The first of ``exc``'s errors as one line: ``WHAT: 'key' message`` (``WHAT: message`` for a
    check over the whole group, whose message already names what it is about).

    With ``flags`` (a model whose fields are flags, and whose groups are JSON-valued flags: field ->
    the flag that sets it, for the groups), a field's error names its flag (``--max-num-seqs: ...``,
    the field's name in dashes unless ``flags`` says otherwise) and a group's names the group's flag
    and the key (``--speculative-config: 'propose_timeout' ...``)."""
    error = exc.errors(include_url=False)[0]
    message = str(error["msg"]).removeprefix("Value error, ").removeprefix("Assertion failed, ")
    loc = [str(part) for part in error["loc"]]
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    if flags is not None and loc:
        head, rest = loc[0], loc[1:]
        flag = flags.get(head) or "--" + head.replace("_", "-")
        if message.startswith("--"):  # a check that names its flag already
            return message
        return f"{flag}: '{'.'.join(rest)}' {message}" if rest else f"{flag}: {message}"
    key = ".".join(loc)
    said = f"'{key}' {message}" if key else message
    return f"{what}: {said}" if what else said


def json_object(flag: str, text: str | dict | None) -> dict:
    """A JSON-valued flag's value as a dict: a JSON object, ``@PATH`` to a file holding one, an
    already-parsed dict, or None/empty for none; ``ValueError`` naming ``flag`` otherwise."""
    if text is None or text == "":
        return {}
    if isinstance(text, dict):
        return dict(text)
    raw = Path(text[1:]).read_text() if text.startswith("@") else text
    try:
        values = json.loads(raw)
    except ValueError as exc:
        raise ValueError(f"{flag} is not JSON: {exc}") from None
    if not isinstance(values, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(values).__name__}")
    return values


def parse_group(cls: type[G], flag: str, text: str | dict | None, env: str | None = None) -> G:
    """``text`` (:func:`json_object`) as a ``cls``; ``ValueError`` naming ``flag`` and the key at fault.
    ``env``: the flag's environment variable's value (``TANDEM_<FLAG>``), whose keys apply beneath
    ``text``'s, key by key (a launcher's flag does not wipe what the environment set)."""
    return build(cls, flag, **{**json_object(flag, env), **json_object(flag, text)})


def build(cls: type[G], what: str = "", flags: Mapping[str, str] | None = None, **values: Any) -> G:
    """``cls(**values)``, a ``ValueError`` of one line (naming ``what``, or the flag of the field at
    fault: :func:`one_line`) when they do not validate."""
    try:
        return cls(**values)
    except ValidationError as exc:
        raise ValueError(one_line(exc, what, flags)) from None

