"""The next-turn context the frontend prefills for ``nvext.agent_hints.speculative_prefill``: the
turn's messages plus its reply, rendered without a generation prompt, are the prefix of the next
turn's prompt; text completions prefill their prompt and output tokens."""

from __future__ import annotations

import json

import pytest

from frontend.next_turn import NextTurnPrefiller, next_turn_messages, next_turn_tokens
from frontend.protocol import ChatCompletionRequest, CompletionRequest, check_supported, parse
from frontend.serving import CompletionService
from frontend.tokenizer import Tokenizer
from runtime.messages import NEXT_TURN_DONE, NEXT_TURN_DROPPED, TokenDelta, Usage

from tests.support.frontend import completion_service, demo_tokenizer

pytestmark = pytest.mark.unit

HINT = {"nvext": {"agent_hints": {"speculative_prefill": True}}}
SYSTEM = {"role": "system", "content": "You are a coding agent. Edit files with the tools you are given."}
USER = {"role": "user", "content": "Write fib.py with a function fib(n)."}
REPLY = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n"


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return demo_tokenizer()


@pytest.fixture
def service(tokenizer) -> CompletionService:
    return completion_service(tokenizer, context_length=2048)


async def prepare(service, body: dict, chat: bool = True):
    req = parse(ChatCompletionRequest if chat else CompletionRequest, json.dumps(body).encode())
    check_supported(req)
    return await service.prepare(req, "rid")


def finished(job, tokenizer, text: str):
    [out] = job.outputs()
    out.add(TokenDelta(tokenizer.encode(text), finish_reason="stop", usage=Usage(1, 1)))
    return out


async def test_only_a_turn_that_asks_keeps_a_next_turn(service):
    assert (await prepare(service, {"model": "m", "messages": [USER]})).next_turn is None
    no = {"nvext": {"agent_hints": {"speculative_prefill": False}}}
    assert (await prepare(service, {"model": "m", "messages": [USER], **no})).next_turn is None
    assert (await prepare(service, {"model": "m", "messages": [USER], "n": 2, **HINT})).next_turn is None  # which reply?
    assert (await prepare(service, {"model": "m", "messages": [USER], **HINT})).next_turn is not None


async def test_the_chat_context_is_the_next_turns_prompt_prefix(service, tokenizer):
    job = await prepare(service, {"model": "m", "messages": [SYSTEM, USER], **HINT})
    out = finished(job, tokenizer, REPLY)
    context = next_turn_tokens(job.next_turn, job.prompts[0], tokenizer.encode(REPLY), out)
    reply = {"role": "assistant", "content": REPLY}
    # the template's rendering of the turn with its reply, closed, without a generation prompt ...
    assert context == tokenizer.encode_chat([SYSTEM, USER, reply], add_generation_prompt=False)
    assert context[: len(job.prompts[0])] == job.prompts[0]
    assert tokenizer.decode(context).endswith(REPLY + "\n")  # (the end-of-turn marker is a special token)
    # ... and the next turn, as an agent sends it (the reply as the response carried it, then a tool's
    # output), starts with exactly those tokens
    tool = {"role": "user", "content": "Tool output: tests passed (3 tests)."}
    follow = await prepare(service, {"model": "m", "messages": [SYSTEM, USER, reply, tool]})
    assert follow.prompts[0][: len(context)] == context and len(follow.prompts[0]) > len(context)


async def test_a_reply_with_tool_calls_renders_as_the_client_sends_it_back(tokenizer):
    call = {"id": "call_1", "type": "function", "function": {"name": "write_file",
                                                              "arguments": '{"path": "fib.py", "text": "x = 1"}'}}
    messages = next_turn_messages([USER], {"role": "assistant", "content": None, "tool_calls": [call]})
    assert messages[0] == USER
    assert messages[1] == {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "write_file", "arguments": {"path": "fib.py", "text": "x = 1"}}}]}


async def test_text_completions_and_continued_messages_prefill_prompt_and_output(service, tokenizer):
    job = await prepare(service, {"model": "m", "prompt": "def fib(n):", "max_tokens": 8, **HINT}, chat=False)
    assert job.next_turn is not None and job.next_turn.messages is None
    assert next_turn_tokens(job.next_turn, job.prompts[0], [5, 6], None) == [*job.prompts[0], 5, 6]
    partial = {"role": "assistant", "content": "def fib("}
    job = await prepare(service, {"model": "m", "messages": [USER, partial], "continue_final_message": True,
                                  "add_generation_prompt": False, **HINT})
    assert job.next_turn.messages is None  # the reply continues the last message: the tokens as they ran


class FakeDispatcher:
    def __init__(self, answer):
        self.answer = answer
        self.sent = []

    async def next_turn(self, model, tokens, instance_id, request_id, priority=0, lora=""):
        self.sent.append((model, tokens, instance_id, request_id, priority))
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


class FakeGen:
    model, lora = "m", ""

    def __init__(self, served_by, output_ids):
        self.served_by, self.output_ids = served_by, output_ids


@pytest.mark.parametrize("answer, outcomes", [(NEXT_TURN_DONE, {"started": 1, "prefilled": 1}),
                                              (NEXT_TURN_DROPPED, {"started": 1, "dropped": 1}),
                                              (ConnectionError("gone"), {"started": 1, "dropped": 1})])
async def test_the_prefiller_sends_to_the_turns_worker_and_counts(service, answer, outcomes):
    import asyncio

    job = await prepare(service, {"model": "m", "prompt": "def fib(n):", "priority": 3, **HINT}, chat=False)
    counted = []
    dispatcher = FakeDispatcher(answer)
    prefiller = NextTurnPrefiller(dispatcher, counted.append)
    prefiller.submit(job, FakeGen("worker-a", [7, 8]), None)
    prefiller.submit(job, FakeGen(None, [7]), None)  # never sent anywhere: dropped
    while prefiller._tasks:
        await asyncio.sleep(0.01)
    assert dispatcher.sent == [("m", [*job.prompts[0], 7, 8], "worker-a", "rid-next", 3)]
    assert {o: counted.count(o) for o in set(counted)} == {**outcomes, "dropped": outcomes.get("dropped", 0) + 1}
