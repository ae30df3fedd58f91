"""Next-turn prefill (Dynamo's ``nvext.agent_hints.speculative_prefill``), the frontend's side.

When a turn that asked for it ends normally, the frontend works out the context the conversation's
next turn will start with and sends it, as a ``next_turn`` request, to the worker that served the
turn: the one the session's affinity and the KV router send the next turn to. Chat: the turn's
messages with the reply appended, as the assistant message the response carried (and the client
sends back), rendered by the turn's chat template without a generation prompt (so the template's
end of the assistant turn is in) and tokenized; text completions: the prompt's token ids, then the
generated ones. The worker runs it as background work that yields to real requests
(:mod:`workers.target.next_turn`); nothing of it reaches the client, and no failure of it is an error.

Counted in ``tandem_frontend_next_turn_prefills_total`` by outcome: ``started`` (sent to a worker),
then ``prefilled``, or ``dropped`` (not sent: too long, too many in flight, no worker known; or
dropped by the worker: busy, short of blocks, a real request arrived).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runtime.messages import NEXT_TURN_DONE

from .protocol import ChatMessage, template_message
from .responses import encode_json

log = logging.getLogger(__name__)

MAX_INFLIGHT = 64  # next-turn prefills one frontend has outstanding; more are dropped


@dataclass(frozen=True)
class NextTurn:
    """What a turn keeps to build its next-turn context. Chat: its template messages, the encoder of
    its template (tools, kwargs; no generation prompt) and its reply as an assistant message; text
    completions: nothing (``messages`` None)."""

    messages: list[dict] | None = None
    encode: Callable[[list[dict]], list[int]] | None = None
    reply: Callable[[object], dict] | None = None  # a finished ChoiceOutput -> its assistant message


def next_turn_messages(messages: Sequence[dict], reply: dict) -> list[dict]:
    """The conversation the next turn sends back: ``messages``, then ``reply`` (an assistant message
    as the response carried it) as the template sees a message a client sent."""
    return [*messages, template_message(ChatMessage.model_validate_json(encode_json(reply)))]


def next_turn_tokens(turn: NextTurn, prompt_ids: Sequence[int], output_ids: Sequence[int], choice) -> list[int]:
    """The token ids of the next turn's known prefix (see the module docstring)."""
    if turn.messages is None:
        return [*prompt_ids, *output_ids]
    return turn.encode(next_turn_messages(turn.messages, turn.reply(choice)))


class NextTurnPrefiller:
    """Sends next-turn prefills in tasks of their own; ``count(outcome)`` counts them."""

    def __init__(self, dispatcher, count: Callable[[str], None], max_inflight: int = MAX_INFLIGHT):
        self.dispatcher = dispatcher  # frontend.dispatch.Dispatcher
        self.count = count
        self.max_inflight = max_inflight
        self._tasks: set[asyncio.Task] = set()

    def submit(self, job, gen, choice) -> None:
        """After ``job`` (one choice: ``gen``, ``choice``) ended normally: prefill its next turn."""
        if len(self._tasks) >= self.max_inflight or gen.served_by is None:
            self.count("dropped")
            return
        task = asyncio.create_task(self._run(job, gen, choice), name=f"next-turn-{job.request_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _run(self, job, gen, choice) -> None:
        try:
            prompt = job.prompts[job.prompt_of[0]]
            tokens = await asyncio.to_thread(next_turn_tokens, job.next_turn, prompt, gen.output_ids, choice)
            if len(tokens) + 1 > job.model.card.context_length:
                self.count("dropped")
                return
            self.count("started")
            finish = await self.dispatcher.next_turn(gen.model, tokens, gen.served_by, f"{job.request_id}-next",
                                                     job.hints.priority if job.hints else 0, gen.lora)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # background work: a failure is a dropped prefill, never an error
            log.info("request %s: next-turn prefill failed: %r", job.request_id, exc)
            finish = None
        self.count("prefilled" if finish == NEXT_TURN_DONE else "dropped")

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
