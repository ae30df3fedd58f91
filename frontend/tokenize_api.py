"""vLLM's ``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and response shapes.

``/tokenize`` takes ``prompt`` (``add_special_tokens``, default true) or chat ``messages``
(``add_generation_prompt``, ``continue_final_message``, ``add_special_tokens`` default false,
``chat_template_kwargs``, ``tools``) and answers ``{"count", "max_model_len", "tokens", "token_strs"}``:
the prompt exactly as a completion request would send it to the workers. ``/detokenize`` takes
``tokens`` and answers ``{"prompt"}``. ``model`` may be left out where one model is served.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Any

from pydantic import Field

from runtime import InvalidRequest

from .models import ModelRegistry, ServedModel
from .protocol import (MAX_INT64, MAX_MESSAGES, RESERVED_TEMPLATE_KWARGS, ChatMessage, Lenient, ToolDefinition,
                       check_messages, message_dicts, parse)
from .tokenizer import Tokenizer

INLINE_CHARS = 16_384  # longer texts are tokenized in a thread


class TokenizeRequest(Lenient):
    """vLLM's TokenizeCompletionRequest and TokenizeChatRequest in one: ``prompt`` or ``messages``."""

    model: str | None = Field(None, min_length=1, max_length=256)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_MESSAGES)
    add_special_tokens: bool | None = None  # default: true for a prompt, false for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ToolDefinition] | None = None
    return_token_strs: bool | None = False


class DetokenizeRequest(Lenient):
    model: str | None = Field(None, min_length=1, max_length=256)
    tokens: list[int]


class TokenizeService:
    """Answers /tokenize and /detokenize with the served models' tokenizers; plain values in."""

    def __init__(self, registry: ModelRegistry, served: Any, tokenizer_timeout: float = 120.0):
        self.registry = registry
        self.served = served  # () -> names of the models live workers serve
        self.tokenizer_timeout = tokenizer_timeout

    async def _model(self, name: str | None) -> tuple[ServedModel, Tokenizer]:
        if name is None:
            served = self.served()
            if len(served) != 1:
                raise InvalidRequest(f"'model' is required when {len(served)} models are served", "model")
            name = served[0]
        model = self.registry.get(name)
        return model, await self.registry.tokenizer(model, self.tokenizer_timeout)

    async def tokenize(self, body: bytes) -> dict:
        req = parse(TokenizeRequest, body)
        if (req.prompt is None) == (req.messages is None):
            raise InvalidRequest("give either 'prompt' or 'messages'", "prompt" if req.prompt is not None else "messages")
        if req.continue_final_message and req.add_generation_prompt:
            raise InvalidRequest("'continue_final_message' needs 'add_generation_prompt': false", "continue_final_message")
        bad = next((k for k in req.chat_template_kwargs or () if k in RESERVED_TEMPLATE_KWARGS), None)
        if bad is not None:
            raise InvalidRequest(f"'{bad}' is set by the request itself, not by chat_template_kwargs",
                                 f"chat_template_kwargs.{bad}")
        model, tok = await self._model(req.model)
        if req.prompt is not None:
            size = len(req.prompt)
            encode = functools.partial(tok.encode, req.prompt,
                                       add_special_tokens=True if req.add_special_tokens is None else req.add_special_tokens)
        else:
            check_messages(req.messages)
            messages = message_dicts(req)
            size = sum(len(m["content"]) for m in messages)
            tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
            encode = functools.partial(tok.encode_chat, messages, tools, req.add_generation_prompt,
                                       req.continue_final_message, req.chat_template_kwargs,
                                       bool(req.add_special_tokens))
        ids = encode() if size <= INLINE_CHARS else await asyncio.to_thread(encode)
        out = {"count": len(ids), "max_model_len": model.card.context_length, "tokens": ids, "token_strs": None}
        if req.return_token_strs:
            out["token_strs"] = [tok.token_text(t) for t in ids]
        return out

    async def detokenize(self, body: bytes) -> dict:
        req = parse(DetokenizeRequest, body)
        _, tok = await self._model(req.model)
        bad = next((i for i, t in enumerate(req.tokens) if not 0 <= t < min(tok.vocab_size, MAX_INT64)), None)
        if bad is not None:
            raise InvalidRequest(f"token id {req.tokens[bad]} is outside the vocabulary (0..{tok.vocab_size - 1})",
                                 f"tokens[{bad}]")
        decode = functools.partial(tok.decode, req.tokens)
        text = decode() if len(req.tokens) <= INLINE_CHARS else await asyncio.to_thread(decode)
        return {"prompt": text}
