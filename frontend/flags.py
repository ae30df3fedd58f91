"""The frontend's flags that ``tandem up`` passes through (:class:`runtime.flags.SharedFlag`): one
definition, in ``python -m frontend``'s parser and the launcher's. Light to import."""

from __future__ import annotations

from router.flags import QUEUE_FLAGS
from runtime.flags import SharedFlag

from .tool_parsers import PARSERS

API_KEY = SharedFlag(("--api-key",), dict(
    action="append", default=None,
    help="require 'Authorization: Bearer KEY'; repeatable, comma-separated, or @FILE (one per line); env "
         "TANDEM_API_KEY (comma-separated). /health and /live stay open"))
TOOL_CALL_PARSER = SharedFlag(("--tool-call-parser",), dict(
    default=None, choices=tuple(PARSERS),
    help="read tool calls (tool_choice 'auto') in this format, vLLM's name for it, for every model (default: the "
         "format each model's chat template renders, see docs/frontend.md)"))
ENABLE_AUTO_TOOL_CHOICE = SharedFlag(("--enable-auto-tool-choice",), dict(
    action="store_true",
    help="accepted for vLLM command lines: tool_choice 'auto' is served without it too (in --tool-call-parser's "
         "format, else the chat template's)"))

FRONTEND_FLAGS = (API_KEY, TOOL_CALL_PARSER, ENABLE_AUTO_TOOL_CHOICE, *QUEUE_FLAGS)
