"""Serving one completion request: preprocess, send every choice to a worker, build the answer.

:meth:`CompletionService.prepare` turns a validated request into a :class:`Job` (prompt token
ids, per-choice sampling, output options), raising ``InvalidRequest`` / ``UnknownModel`` with the
parameter named. :meth:`CompletionService.collect` runs a non-streaming job;
:meth:`CompletionService.events` yields the SSE bytes of a streaming one.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

import msgspec

from runtime import InvalidRequest, PendingBytes, TandemError
from runtime.messages import RoutingHints, SamplingParams, TokenDelta
from runtime.validation import validate_request

from .dispatch import Dispatcher, Generation
from .errors import to_http
from .metrics import FrontendMetrics, RequestTimer
from .next_turn import NextTurn, NextTurnPrefiller
from .models import ModelRegistry, ServedModel
from .output import ChoiceOutput
from .render_pool import INLINE_CHARS, RenderPool
from .protocol import (MAX_INT64, ChatCompletionRequest, CompletionRequest, SpeculativeOptions, agent_hints,
                       engine_priority, logit_bias, message_dicts, prompts_of, stop_strings)
from .responses import ResponseBuilder, usage
from .streaming import merge
from .structured import asks_for_grammar, probe, structured_output
from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
INLINE_PROMPT_SIZE = 16_384  # longer prompts (characters to tokenize, token ids to check) go to a thread


@dataclass
class Job:
    """A request ready to send: one entry of ``samplings`` and ``prompt_of`` per choice."""

    request_id: str
    endpoint: str
    model: ServedModel
    tokenizer: Tokenizer
    prompts: list[list[int]]
    prompt_of: list[int]
    samplings: list[SamplingParams]
    stops: tuple[str, ...]
    stop_token_ids: frozenset[int]
    top_logprobs: int | None
    stream: bool
    include_usage: bool
    builder: ResponseBuilder
    continuous_usage: bool = False  # with include_usage: usage so far in every chunk (vLLM's extension)
    speculative: SpeculativeOptions | None = None  # Tandem's extension: this request's speculation
    hints: RoutingHints | None = None  # priority, queue tier, expected output length, session (None: none given)
    next_turn: NextTurn | None = None  # speculative_prefill: how to build the next turn's context (None: not asked)

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    def outputs(self) -> list[ChoiceOutput]:
        backend = self.tokenizer.backend
        return [ChoiceOutput(i, backend, self.prompts[p], self.stops, self.stop_token_ids, self.top_logprobs)
                for i, p in enumerate(self.prompt_of)]


class CompletionService:
    """Chat and text completions over a model registry and a dispatcher; plain values in."""

    def __init__(self, registry: ModelRegistry, dispatcher: Dispatcher, metrics: FrontendMetrics,
                 max_n: int = 16, tokenizer_timeout: float = 120.0, render: RenderPool | None = None,
                 tool_call_parser: str | None = None, restart_wait_s: float = 0.0):
        self.registry = registry
        self.restart_wait_s = restart_wait_s  # a model whose last worker just went is waited for this long
        self.tool_call_parser = tool_call_parser  # tool_choice "auto" in this format (None: the template's)
        self.render = render  # renders costly chat templates in a process of its own
        self.dispatcher = dispatcher
        self.metrics = metrics
        self.max_n = max_n
        self.tokenizer_timeout = tokenizer_timeout
        self.next_turns = NextTurnPrefiller(dispatcher, lambda outcome: metrics.next_turn_prefills.labels(outcome).inc())

    async def prepare(self, req: ChatCompletionRequest | CompletionRequest, request_id: str,
                      session_id: str = "") -> Job:
        """``session_id``: the request's agent session (the ``X-Dynamo-Session-ID`` header), for routing."""
        chat = isinstance(req, ChatCompletionRequest)
        # cheap checks before any tokenization (a body of 700k one-letter prompts must not cost seconds), and
        # before a wait for the model: the one bound on n, whatever the model
        count = 1 if chat else len(prompts_of(req))
        if req.n * count > self.max_n:
            raise InvalidRequest(f"at most {self.max_n} choices per request ('n' times the number of prompts; "
                                 f"the frontend's --max-n)", "n")
        # a model whose last worker just went is waited for (its restart), up to restart_wait_s
        model = await self.registry.wait_for(req.model, self.restart_wait_s)
        # compiling a schema to check it takes milliseconds (a large one 100 ms): off the event loop
        grammar = await asyncio.to_thread(structured_output, req) if asks_for_grammar(req) else None
        tok = await self.registry.tokenizer(model, self.tokenizer_timeout)
        tool_calls = grammar.tools.for_template(tok.chat_template, self.tool_call_parser) if grammar and grammar.tools else None
        if grammar is not None and grammar.spec is not None and model.card.structured_outputs:
            # with the model's tokens: a grammar its matcher cannot follow is a 400, not an empty reply
            await asyncio.to_thread(lambda: probe(grammar, tok.grammar_info()))
        if chat:
            messages = message_dicts(req)
            tools = None
            if req.tools and req.tool_choice != "none":
                tools = [t.model_dump(exclude_none=True) for t in req.tools]
            # templating costs per message too: many short messages go to the thread as well
            size = sum(len(m["content"]) for m in messages) + 64 * len(messages) + (len(repr(tools)) if tools else 0)
            encode = functools.partial(tok.encode_chat, tools=tools, add_generation_prompt=req.add_generation_prompt,
                                       continue_final_message=req.continue_final_message,
                                       template_kwargs=req.chat_template_kwargs,
                                       add_special_tokens=req.add_special_tokens)
            if size > INLINE_CHARS and self.render is not None:  # a costly template: not on this process's GIL
                prompts = [await self.render.encode_chat(
                    tok, messages, tools=tools, add_generation_prompt=req.add_generation_prompt,
                    continue_final_message=req.continue_final_message, template_kwargs=req.chat_template_kwargs,
                    add_special_tokens=req.add_special_tokens)]
            else:
                prompts = [await self._maybe_thread(size, encode, messages)]
            field, max_tokens = "messages", req.max_completion_tokens or req.max_tokens
        else:
            encode = functools.partial(tok.encode, add_special_tokens=req.add_special_tokens)
            prompts = [await self._maybe_thread(len(p), encode, p) if isinstance(p, str) else list(p)
                       for p in prompts_of(req)]
            field, max_tokens = "prompt", req.max_tokens or DEFAULT_COMPLETION_MAX_TOKENS
        context = model.card.context_length
        longest = max(len(p) for p in prompts)
        if max_tokens is None:
            max_tokens = max(0, context - longest)  # the rest of the context
        top = (req.top_logprobs or 0) if chat and req.logprobs else (None if chat else req.logprobs)
        if top is not None and not model.card.supports_logprobs:
            raise InvalidRequest("this model's workers do not return logprobs", "top_logprobs" if chat and req.top_logprobs else "logprobs")
        stop_ids = list(req.stop_token_ids or ())
        sampling = SamplingParams(
            temperature=1.0 if req.temperature is None else req.temperature,
            top_p=1.0 if req.top_p is None else req.top_p,
            top_k=max(0, req.top_k or 0), seed=req.seed, max_tokens=max_tokens, min_tokens=req.min_tokens,
            stop_token_ids=stop_ids, ignore_eos=req.ignore_eos, logprobs=top,
            structured=grammar.spec if grammar else None,
            presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
            repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
            logit_bias=logit_bias(req), min_p=req.min_p or 0.0)
        # the request's own names for what validation reports against
        names = {"prompt": field, "max_tokens": "max_completion_tokens" if chat and req.max_completion_tokens else "max_tokens"}
        if grammar is not None:
            names["structured"] = grammar.field
        check = functools.partial(validate_request, vocab_size=tok.vocab_size, max_model_len=context,
                                  structured_outputs=model.card.structured_outputs, names=names)
        for prompt in prompts:  # token ids are range-checked in C, a few ms per 100k: long prompts in a thread
            await self._maybe_thread(len(prompt), lambda p: check(p, sampling), prompt)
        samplings, prompt_of = [], []
        for p in range(len(prompts)):
            for i in range(req.n):
                seed = req.seed
                if seed is not None and req.n > 1:  # n equal seeds would give n equal choices
                    seed = (seed + i + MAX_INT64 + 1) % (2 * MAX_INT64 + 2) - MAX_INT64 - 1
                samplings.append(sampling if seed == req.seed else msgspec.structs.replace(sampling, seed=seed))
                prompt_of.append(p)
        hidden = set(stop_ids) | (set() if req.ignore_eos else set(model.card.eos_token_ids or tok.eos_token_ids))
        stream = req.stream
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = include_usage and req.stream_options.continuous_usage_stats
        builder = ResponseBuilder(chat, model.name, tok.token_text, top is not None, tool_calls, tok.token_bytes)
        if not chat and req.echo:  # each choice's text starts with its prompt's
            texts = [p if isinstance(p, str) else tok.decode(p) for p in prompts_of(req)]
            builder.echo = {i: texts[p] for i, p in enumerate(prompt_of)}
        hints = agent_hints(req)
        routing = RoutingHints(engine_priority(req), hints.strict_priority or 0 if hints else 0,
                               hints.osl or 0 if hints else 0, session_id)
        next_turn = None
        if hints is not None and hints.speculative_prefill and len(samplings) == 1:
            next_turn = NextTurn()  # text completions, and a chat turn that continued its last message: the tokens
            if chat and not req.continue_final_message:
                next_turn = NextTurn(messages, functools.partial(
                    tok.encode_chat, tools=tools, add_generation_prompt=False, template_kwargs=req.chat_template_kwargs,
                    add_special_tokens=req.add_special_tokens), lambda choice: builder.message(choice)[0])
        return Job(request_id, "chat" if chat else "completions", model, tok, prompts, prompt_of, samplings,
                   stop_strings(req), frozenset(hidden), top, stream, include_usage, builder, continuous,
                   req.speculative, routing if routing != RoutingHints() else None, next_turn)

    @staticmethod
    async def _maybe_thread(size: int, fn, arg):
        return fn(arg) if size <= INLINE_PROMPT_SIZE else await asyncio.to_thread(fn, arg)

    async def open(self, job: Job, pending: PendingBytes | None = None) -> list[Generation]:
        """Route and send every choice; on failure the ones already sent are closed. ``pending``
        counts the bytes of all choices' frames not read yet."""
        gens: list[Generation] = []
        base, lora, others = self.registry.route(job.model)
        try:
            for i, sampling in enumerate(job.samplings):
                rid = job.request_id if len(job.samplings) == 1 else f"{job.request_id}-{i}"
                gens.append(await self.dispatcher.open(base, job.prompts[job.prompt_of[i]], sampling, rid,
                                                       job.speculative, pending, lora, others, job.hints))
        except BaseException:
            await close_all(gens)
            raise
        return gens

    async def first_deltas(self, gens: Sequence[Generation]) -> list[TokenDelta]:
        """The first delta of every choice (so that early worker errors still get a status code)."""
        if len(gens) == 1:
            try:
                return [await gens[0].__anext__()]
            except BaseException:
                await close_all(gens)
                raise
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        try:
            return list(await asyncio.gather(*tasks))
        except BaseException:
            for task in tasks:  # gather leaves the others running
                task.cancel()
            await close_all(gens)
            raise

    async def collect(self, job: Job, gens: Sequence[Generation], outs: Sequence[ChoiceOutput], timer: RequestTimer) -> None:
        """Run a non-streaming job to the end of every choice."""

        async def one(gen: Generation, out: ChoiceOutput) -> None:
            try:
                async for delta in gen:
                    timer.tokens(len(delta.token_ids), out.index)
                    if out.add(delta).finish_reason is not None:
                        break
            finally:
                await gen.aclose()

        try:
            if len(gens) == 1:
                await one(gens[0], outs[0])
            else:
                async with asyncio.TaskGroup() as group:
                    for gen, out in zip(gens, outs):
                        group.create_task(one(gen, out))
        except BaseExceptionGroup as eg:
            raise eg.exceptions[0] from None
        finally:
            await close_all(gens)

    async def events(self, job: Job, gens: Sequence[Generation], outs: Sequence[ChoiceOutput],
                     firsts: Sequence[TokenDelta], timer: RequestTimer, retry_after: int,
                     on_finish: Callable[[int], None]) -> AsyncIterator[bytes]:
        """The SSE bytes of a streaming job, ending in ``[DONE]``; ``on_finish(status)`` runs at the end
        (200, the status an error would have had, or 499 when the client left)."""
        b, usage_on = job.builder, job.include_usage
        if job.continuous_usage:
            b.running_usage = lambda: usage(job.prompt_tokens, outs)
        status = 499  # stays so only if the client leaves (the task is cancelled) before the end
        try:
            if b.chat:
                for out in outs:
                    yield b.role_chunk(out.index, usage_on)
            for out, delta in zip(outs, firsts):
                chunk = self._step(b, out, delta, timer, usage_on)
                if chunk:
                    yield chunk
            live = [g for g, out in zip(gens, outs) if not out.finished]
            index = [out for out in outs if not out.finished]
            if len(live) == 1:
                async for delta in live[0]:
                    chunk = self._step(b, index[0], delta, timer, usage_on)
                    if chunk:
                        yield chunk
                    if index[0].finished:
                        break
            elif live:
                # one delta per choice read ahead at most: the rest waits, counted, in the worker streams
                async with contextlib.aclosing(merge(live, ahead=len(live))) as merged:
                    async for i, delta in merged:
                        chunk = self._step(b, index[i], delta, timer, usage_on)
                        if chunk:
                            yield chunk
                        if index[i].finished:
                            await live[i].aclose()  # a stop string: the worker need not go on
                        if all(o.finished for o in index):
                            break
            if usage_on:
                yield b.usage_chunk(outs, job.prompt_tokens)
            status = 200
            yield b.done()
        except TandemError as exc:
            err = to_http(exc, retry_after)
            status = err.status
            log.warning("request %s: failed mid-stream: %s", job.request_id, exc)
            yield b.error_chunk(err.body())
            yield b.done()
        except Exception as exc:
            status = 500
            log.exception("request %s: failed mid-stream", job.request_id)
            yield b.error_chunk(to_http(exc).body())
            yield b.done()
        finally:
            on_finish(status)
            await close_all(gens)

    def _step(self, b: ResponseBuilder, out: ChoiceOutput, delta: TokenDelta, timer: RequestTimer, usage_on: bool) -> bytes | None:
        timer.tokens(len(delta.token_ids), out.index)
        return b.piece_chunk(out.index, out.add(delta), usage_on)

    def after_turn(self, job: Job, gens: Sequence[Generation], outs: Sequence[ChoiceOutput]) -> None:
        """A job ended normally: with ``speculative_prefill``, its next turn is prefilled in the background."""
        if job.next_turn is not None and len(gens) == 1:
            self.next_turns.submit(job, gens[0], outs[0])

    def account(self, job: Job, outs: Sequence[ChoiceOutput]) -> None:
        """Token and speculation counters of a finished job."""
        series = self.metrics.series(job.model.name)
        series.observe_tokens(job.prompt_tokens, sum(o.completion_tokens for o in outs),
                              max((o.cached_tokens for o in outs), default=0))
        for out in outs:
            if out.spec is not None:
                series.observe_spec(out.spec)


async def close_all(gens: Sequence[Generation]) -> None:
    """Close every generation, even when the calling task is being cancelled."""
    tasks = [t for t in (g.close_nowait() for g in gens) if t is not None]
    if tasks:
        await asyncio.shield(asyncio.gather(*tasks, return_exceptions=True))
