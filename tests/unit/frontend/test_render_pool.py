"""Costly chat templates render in a child process: the same token ids as in this process, a template's
refusal as the same 400, and a thread (not a stall, not a failure) until the child is ready."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.render_pool import RenderPool
from frontend.tokenizer import Tokenizer
from runtime import InvalidRequest
from runtime.config import importable_env
from tests.support.procs import pid_alive
from tests.support.wait import eventually, eventually_sync

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.unit


async def test_the_pool_renders_what_this_process_would():
    from workers.demo_model import demo_tokenizer_dir

    tok = Tokenizer.load(str(demo_tokenizer_dir()))
    messages = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"message {i} " * 20} for i in range(300)]
    pool = RenderPool(paused=True)  # as a frontend makes it: no process before the frontend serves
    try:
        before = await pool.encode_chat(tok, messages)  # not warm yet: rendered in a thread
        assert pool.rendered == 0 and before == tok.encode_chat(messages)
        await asyncio.sleep(0.5)  # a while for a process that should not start
        assert pool._pool is None and not pool.ready(tok)  # paused: no process started
        pool.resume()
        await eventually(lambda: pool.ready(tok), timeout=60, interval=0.1,
                         what="the render process loading the tokenizer")
        assert await pool.encode_chat(tok, messages, add_generation_prompt=False) == \
            tok.encode_chat(messages, add_generation_prompt=False)
        assert pool.rendered == 1
        with pytest.raises(InvalidRequest) as refused:  # the template's own refusal: a 400 naming the field
            await pool.encode_chat(tok, messages, continue_final_message=True, add_generation_prompt=True)
        assert refused.value.field == "messages" and pool.rendered == 2
    finally:
        pool.close()


_ORPHAN_SCRIPT = """
import os, sys, time
from frontend.render_pool import RenderPool
pool = RenderPool(1)
print(pool._executor().submit(os.getpid).result(), flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_the_render_process_dies_with_a_killed_frontend():
    """A SIGKILLed frontend took nothing down with it: its render process ran on as an orphan. It now gets SIGKILL from the kernel when its parent dies."""
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_SCRIPT], stdout=subprocess.PIPE, text=True,
                              cwd=ROOT, env=importable_env(dict(os.environ)))
    try:
        child = int(parent.stdout.readline())
        assert pid_alive(child)
        parent.kill()
        parent.wait()
        eventually_sync(lambda: not pid_alive(child), timeout=10, what=f"render process {child} exiting with its frontend")
    finally:
        parent.kill()


def test_die_with_parent_leaves_at_once_when_the_parent_is_already_gone():
    code = "from runtime.lifetime import die_with_parent; die_with_parent(1); print('still here')"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT,
                          env=importable_env(dict(os.environ)), timeout=60)
    if sys.platform.startswith("linux"):
        assert done.returncode == 1 and "still here" not in done.stdout
