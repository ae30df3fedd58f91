"""Costly chat templates render in a child process: the same token ids as in this process, a template's
refusal as the same 400, and a thread (not a stall, not a failure) until the child is ready."""

from __future__ import annotations

import asyncio
import time

import pytest

from frontend.render_pool import RenderPool
from frontend.tokenizer import Tokenizer
from runtime import InvalidRequest

pytestmark = pytest.mark.unit


async def test_the_pool_renders_what_this_process_would():
    from workers.demo_model import demo_tokenizer_dir

    tok = Tokenizer.load(str(demo_tokenizer_dir()))
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(300)]
    pool = RenderPool()
    try:
        before = await pool.encode_chat(tok, messages)  # not warm yet: rendered in a thread
        assert pool.rendered == 0 and before == tok.encode_chat(messages)
        deadline = time.monotonic() + 60
        while not pool.ready(tok):
            assert time.monotonic() < deadline, "the render process did not load the tokenizer in 60 s"
            await asyncio.sleep(0.1)
        assert await pool.encode_chat(tok, messages, add_generation_prompt=False) == \
            tok.encode_chat(messages, add_generation_prompt=False)
        assert pool.rendered == 1
        with pytest.raises(InvalidRequest) as refused:  # the template's own refusal: a 400 naming the field
            await pool.encode_chat(tok, messages, continue_final_message=True, add_generation_prompt=True)
        assert refused.value.field == "messages" and pool.rendered == 2
    finally:
        pool.close()
