"""The hand-written natural chat prompts (``bench/prompts/natural_chat.jsonl``) that acceptance and
speed claims are measured on: written by hand, apart from any train-draft generator — casual, terse,
long, code, maths, lists, role-play, rewriting, some with a system prompt or earlier turns."""

from __future__ import annotations

import json
from pathlib import Path

NATURAL = Path(__file__).resolve().parent / "prompts" / "natural_chat.jsonl"


def natural_conversations(count: int | None = None) -> list[list[dict]]:
    """The first ``count`` conversations (all when None), each a list of chat messages."""
    convs = [json.loads(line)["messages"] for line in NATURAL.read_text().splitlines() if line.strip()]
    return convs[:count]


def natural_prompt_ids(tok, count: int | None = None) -> list[list[int]]:
    """Their token ids under ``tok``'s chat template, generation prompt added."""
    return [list(tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]) for m in natural_conversations(count)]
