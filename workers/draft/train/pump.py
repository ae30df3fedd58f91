"""Conversations through one engine with continuous batching: each one a small state machine.

A conversation from the bank (:mod:`.bank`) may first need its user turn written by the target
(self-instruct: the ``writer`` messages, sampled at temperature 0.8, top-p 0.95), then gets the
target's reply, then its follow-ups one at a time, each asked after the target's own previous
answer. Every step of every conversation is one engine request; the pump keeps up to ``batch``
conversations in flight and starts the next as soon as one finishes, so the engine never drains
between shards or turns. A finished conversation is its whole token sequence and loss mask: the
target's replies in every turn where they still appear unchanged under the chat template.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import msgspec

from runtime.messages import SamplingParams

from ...engine.engine import Engine
from .corpus import Conversation
from .data import turn_mask
from .prompts import clean_user_turn

WRITER = SamplingParams(temperature=0.8, top_p=0.95, max_tokens=96)


@dataclass
class _Open:
    """A conversation in flight: its messages so far, the request in flight (``prompt``, ``out``) and
    the tokens and loss mask of the conversation up to its latest finished turn."""

    index: int
    messages: list[dict]
    follow_ups: list[str]
    temperature: float
    seed: int
    writing: bool = False
    turn: int = 0
    prompt: list[int] = field(default_factory=list)
    out: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)


class ConversationPump:
    """Runs bank conversations to completion through ``engine`` (plain values in: limits and sampling)."""

    def __init__(self, engine: Engine, tokenizer, *, batch: int, max_tokens: int, max_len: int,
                 temperature: float, sampled_fraction: float, seed: int):
        if batch <= 0 or max_tokens <= 0 or max_len <= 16:
            raise ValueError("batch and max_tokens must be positive and max_len above 16")
        if not 0.0 <= sampled_fraction <= 1.0 or temperature < 0:
            raise ValueError("sampled_fraction must be in [0, 1] and temperature >= 0")
        self.engine = engine
        self.tokenizer = tokenizer
        self.batch = batch
        self.max_tokens = max_tokens
        self.max_len = max_len
        self.temperature = temperature
        self.sampled_fraction = sampled_fraction
        self.seed = seed
        self.open: dict[str, _Open] = {}
        self.generated = 0  # tokens the engine produced, writer turns included

    def template(self, messages: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def run(self, conversations: Iterator[tuple[int, dict]], done: Callable[[int, Conversation | None], None]) -> None:
        """Pull (index, bank conversation) pairs from ``conversations`` until it is exhausted and
        every one has finished; ``done(index, conversation)`` is called once per index, with None
        for one that was dropped (an unusable written user turn, a prompt over ``max_len``)."""
        exhausted = False
        while True:
            while not exhausted and len(self.open) < self.batch:
                item = next(conversations, None)
                if item is None:
                    exhausted = True
                    break
                self._start(*item, done)
            if not self.open:
                return
            for rid, delta in self.engine.step():
                conv = self.open[rid]
                conv.out.extend(delta.token_ids)
                self.generated += len(delta.token_ids)
                if delta.finish_reason is not None:
                    del self.open[rid]
                    self._advance(conv, done)

    def _start(self, index: int, spec: dict, done) -> None:
        rng = random.Random(f"{self.seed}/{index}/sampling")
        sampled = rng.random() < self.sampled_fraction and self.temperature > 0
        conv = _Open(index, list(spec.get("messages", [])), list(spec.get("follow_ups", [])),
                     self.temperature if sampled else 0.0, rng.getrandbits(31))
        if "writer" in spec:
            conv.writing = True
            self._submit(conv, f"{index}/w", self.template(spec["writer"]),
                         msgspec.structs.replace(WRITER, seed=spec["writer_seed"]))
        else:
            self._ask(conv, done)

    def _ask(self, conv: _Open, done) -> None:
        """Request the target's answer to the conversation's messages so far."""
        ids = self.template(conv.messages)
        if len(ids) >= self.max_len - 8:  # no room for a reply worth learning from
            self._finish(conv, done)
            return
        budget = min(self.max_tokens, self.max_len - len(ids) - 1)
        params = SamplingParams(temperature=conv.temperature, max_tokens=budget,
                                seed=None if conv.temperature == 0 else conv.seed + conv.turn)
        self._submit(conv, f"{conv.index}/{conv.turn}", ids, params)

    def _submit(self, conv: _Open, rid: str, ids: list[int], params: SamplingParams) -> None:
        conv.prompt, conv.out = ids, []
        self.open[rid] = conv
        self.engine.add_request(rid, ids, params)

    def _advance(self, conv: _Open, done) -> None:
        text = self.tokenizer.decode(conv.out, skip_special_tokens=True)
        if conv.writing:
            conv.writing = False
            user = clean_user_turn(text)
            if user is None:
                done(conv.index, None)
                return
            conv.messages = [{"role": "user", "content": user}]
            self._ask(conv, done)
            return
        reply = conv.out
        conv.mask = turn_mask(conv.prompt, (conv.tokens, conv.mask)) + [True] * len(reply)
        conv.tokens = conv.prompt + reply
        conv.turn += 1
        if conv.follow_ups:
            conv.messages = conv.messages + [{"role": "assistant", "content": text},
                                             {"role": "user", "content": conv.follow_ups.pop(0)}]
            self._ask(conv, done)
        else:
            self._finish(conv, done)

    def _finish(self, conv: _Open, done) -> None:
        if sum(conv.mask) < 2:
            done(conv.index, None)
        else:
            done(conv.index, Conversation(conv.index, conv.tokens, conv.mask, conv.temperature > 0))

