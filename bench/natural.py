"""The hand-written natural chat prompts that acceptance and speed claims are measured on: written by
hand, apart from any train-draft generator — casual, terse, long, code, maths, lists, role-play,
rewriting, some with a system prompt or earlier turns. Two sets: ``natural_chat.jsonl`` (the first,
68 prompts) and ``natural_chat_2.jsonl`` (42, written apart from the first and from the prompt bank,
for a final check)."""

from __future__ import annotations

import json
from pathlib import Path

PROMPTS = Path(__file__).resolve().parent / "prompts"
NATURAL = PROMPTS / "natural_chat.jsonl"
SETS = {1: NATURAL, 2: PROMPTS / "natural_chat_2.jsonl"}


def natural_conversations(count: int | None = None, which: int = 1) -> list[list[dict]]:
    """The first ``count`` conversations (all when None) of set ``which``, each a list of chat messages."""
    convs = [json.loads(line)["messages"] for line in SETS[which].read_text().splitlines() if line.strip()]
    return convs[:count]


def natural_prompt_ids(tok, count: int | None = None, which: int = 1) -> list[list[int]]:
    """Their token ids under ``tok``'s chat template, generation prompt added."""
    return [list(tok(tok.apply_chat_template(m, add_generation_prompt=True, tokenize=False),
                     add_special_tokens=False)["input_ids"]) for m in natural_conversations(count, which)]
