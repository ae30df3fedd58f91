"""Chat templates of costly requests rendered in a process of their own, not on the event loop's GIL.

Rendering a chat template is pure Python (jinja2): 200 ms for a chat of 4,096 messages or 128 tools
nested 60 deep. A thread does not keep that off the event loop, because it holds the GIL for all
but the loop's share of it, and a few such requests at once stalled every stream for 360 ms. So a
request whose messages and tools are large (:data:`INLINE_CHARS`) is rendered and tokenized by a
child process (``spawn``: the frontend is never forked) that loads the same tokenizer files with
the same code (:meth:`Tokenizer.encode_chat`) and returns token ids or the 400 the template gave.

The pool starts once a model's tokenizer is loaded in the frontend and the frontend serves
(:meth:`RenderPool.warm`, in the background; a pool made ``paused`` waits for :meth:`RenderPool.resume`,
so that a restarting frontend does not share two cores with a second interpreter's imports before it
answers). Until its process has loaded that tokenizer, or if it dies, requests render in a thread as
before; a dead process is replaced.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import multiprocessing
import os
from concurrent.futures.process import BrokenProcessPool

from runtime import InvalidRequest
from runtime.lifetime import die_with_parent

from .tokenizer import Tokenizer

log = logging.getLogger(__name__)

RENDER_NICENESS = 10
INLINE_CHARS = 16_384  # messages + tools (characters, 64 per message) above this render in the pool

_loaded: dict[tuple, Tokenizer] = {}  # in the pool's process: tokenizers by (path, template, eos ids)


def _tokenizer(key: tuple) -> Tokenizer:
    tok = _loaded.get(key)
    if tok is None:
        tok = _loaded[key] = Tokenizer.load(key[0], key[1], key[2])
    return tok


def _start_worker(parent_pid: int) -> None:
    """In the pool's process: die with the frontend (a SIGKILLed frontend left it running), and yield the CPU to the frontend's own (it renders what only costly requests need)."""
    die_with_parent(parent_pid)
    try:
        os.nice(RENDER_NICENESS)
    except OSError:
        pass


def _warm(key: tuple) -> None:
    _tokenizer(key)


def _encode_chat(key: tuple, messages: list[dict], kwargs: dict) -> tuple[str, object, str]:
    """("ok", token ids, "") or ("invalid", message, field): exceptions with custom constructors
    do not survive pickling, so a 400 comes back as values."""
    try:
        return "ok", _tokenizer(key).encode_chat(messages, **kwargs), ""
    except InvalidRequest as exc:
        return "invalid", str(exc), exc.field


class RenderPool:
    """One child process rendering chat templates; plain values in."""

    def __init__(self, processes: int = 1, paused: bool = False):
        self.processes = processes
        self._paused: list[Tokenizer] | None = [] if paused else None  # tokenizers to warm on resume()
        self._pool: concurrent.futures.ProcessPoolExecutor | None = None
        self._warm: dict[tuple, asyncio.Future] = {}  # tokenizer key -> its load in the pool
        self.rendered = 0  # requests rendered in the pool (tests, metrics)

    def _executor(self) -> concurrent.futures.ProcessPoolExecutor:
        if self._pool is None:
            self._pool = concurrent.futures.ProcessPoolExecutor(self.processes,
                                                                mp_context=multiprocessing.get_context("spawn"),
                                                                initializer=_start_worker,
                                                                initargs=(os.getpid(),))
        return self._pool

    def warm(self, tok: Tokenizer) -> None:
        """Load ``tok`` in the pool's process, in the background (once per tokenizer)."""
        key = self.key(tok)
        if key in self._warm or not tok.path:
            return
        if self._paused is not None:
            if tok not in self._paused:
                self._paused.append(tok)
            return
        future = asyncio.wrap_future(self._executor().submit(_warm, key))
        self._warm[key] = future
        future.add_done_callback(lambda f: self._warmed(key, f))

    def resume(self) -> None:
        """Start the pool now for the tokenizers :meth:`warm` was given while paused."""
        waiting, self._paused = self._paused or [], None
        for tok in waiting:
            self.warm(tok)

    def _warmed(self, key: tuple, future: asyncio.Future) -> None:
        if future.cancelled() or future.exception() is not None:
            log.warning("the render process could not load the tokenizer %s: %r", key[0],
                        None if future.cancelled() else future.exception())
            self._reset()
        else:
            log.info("render process ready for %s", key[0])

    @staticmethod
    def key(tok: Tokenizer) -> tuple:
        return (tok.path, tok.chat_template, tuple(tok.eos_token_ids))

    def ready(self, tok: Tokenizer) -> bool:
        future = self._warm.get(self.key(tok))
        return future is not None and future.done() and not future.cancelled() and future.exception() is None

    async def encode_chat(self, tok: Tokenizer, messages: list[dict], **kwargs) -> list[int]:
        """``tok.encode_chat(messages, **kwargs)`` in the pool's process once it has ``tok``, else in a thread."""
        if not self.ready(tok):
            self.warm(tok)
            return await asyncio.to_thread(tok.encode_chat, messages, **kwargs)
        try:
            status, value, field = await asyncio.wrap_future(
                self._executor().submit(_encode_chat, self.key(tok), messages, kwargs))
        except BrokenProcessPool:
            log.warning("the render process died: rendering in a thread until a new one is ready")
            self._reset()
            return await asyncio.to_thread(tok.encode_chat, messages, **kwargs)
        self.rendered += 1
        if status == "invalid":
            raise InvalidRequest(value, field)
        return value

    def _reset(self) -> None:
        pool, self._pool = self._pool, None
        self._warm.clear()
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)

    def close(self) -> None:
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
