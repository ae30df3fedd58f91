"""Flags one service defines and a launcher passes through to it: one definition, two parsers.

A :class:`SharedFlag` is added to the service's own parser as the service defines it
(:meth:`SharedFlag.add`), and to a launcher's parser (``tandem up``) with no default of its own
(:meth:`SharedFlag.add_passthrough`), so the launcher passes on exactly the values it was given
(:meth:`SharedFlag.argv`) and the service's defaults stay the service's. Nothing here reads the
environment: :func:`runtime.config.apply_env_defaults` gives both parsers' copies the same
``TANDEM_<FLAG>`` variable, with the same meaning.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class SharedFlag:
    """``add_argument(*names, **options)`` as the owning service declares it."""

    names: tuple[str, ...]
    options: dict[str, Any] = field(default_factory=dict)

    @property
    def dest(self) -> str:
        return self.options.get("dest") or self.names[0].lstrip("-").replace("-", "_")

    @property
    def flag(self) -> str:
        """The canonical spelling, the one a launcher writes."""
        return self.names[0]

    def add(self, parser: argparse.ArgumentParser, *aliases: str, **changes: Any) -> argparse.Action:
        """Add the flag to an owner's parser (``aliases``: older spellings it keeps; ``changes``: e.g.
        that service's own default)."""
        return parser.add_argument(*self.names, *aliases, **{**self.options, **changes})

    def add_passthrough(self, parser: argparse.ArgumentParser, to: str) -> argparse.Action:
        """Add the flag to a launcher's parser, passed on to ``to`` (e.g. "the target workers");
        unset unless given, so the owner's default applies."""
        options = {k: v for k, v in self.options.items() if k != "default"}
        default = self.options.get("default")
        shown = "" if default in (None, False, []) else f"; default: theirs, {default}"
        options["help"] = f"{self.options.get('help', '')} (passed to {to}{shown})"
        return parser.add_argument(*self.names, default=None, **options)

    def argv(self, value: Any) -> list[str]:
        """The command-line words that give the owner ``value`` (none for None or an unset switch)."""
        if value is None or value is False:
            return []
        if value is True:
            return [self.flag]
        if self.options.get("action") == "append":
            return [w for v in value for w in (self.flag, str(v))]
        if self.options.get("nargs") in ("+", "*"):
            return [self.flag, *map(str, value)]
        return [self.flag, format(value, "g") if isinstance(value, float) else str(value)]


SERVED_MODEL_NAME = SharedFlag(
    ("--served-model-name",),
    dict(nargs="+", default=None, metavar="NAME",
         help="names clients pass as \"model\", each listed on /v1/models (default: the model's name); a "
              "draft worker speaks for the first"))


def first_name(names: list[str] | str | None) -> str | None:
    """The canonical name of ``--served-model-name`` values (a list, or one name from older callers)."""
    if names is None or isinstance(names, str):
        return names or None
    return names[0] if names else None
