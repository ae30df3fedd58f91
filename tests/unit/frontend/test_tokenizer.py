"""The frontend's tokenizer: a token's raw bytes rebuild the text even where one token is half a character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from frontend.responses import chat_logprobs
from frontend.output import LogprobEntry
from frontend.tokenizer import Tokenizer
from runtime import InvalidRequest
from workers.demo_model import demo_tokenizer_dir

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.load(str(demo_tokenizer_dir()))


@pytest.mark.parametrize("text", ["I 🙂 it", "ᚠᛇᚻ 𝔘𝔫𝔦 🦜🪿 日本語のテキスト", "tabs\tand\nnewlines, ASCII"])
def test_token_bytes_join_to_the_utf8_text(tok, text):
    ids = tok.encode(text, add_special_tokens=False)
    assert b"".join(tok.token_bytes(i) for i in ids) == text.encode()


def test_logprobs_bytes_rebuild_split_characters(tok):
    text = "🦜🪿 日本語"
    ids = tok.encode(text, add_special_tokens=False)
    assert any(tok.token_text(i) == "\ufffd" for i in ids)  # some token is only part of a character
    content = chat_logprobs([LogprobEntry(i, -1.0, []) for i in ids], tok.token_text, tok.token_bytes)["content"]
    assert bytes(b for e in content for b in e["bytes"]).decode() == text
    assert tok.token_bytes(tok.eos_token_ids[0]) == b"<|im_end|>"


def test_encoding_a_long_prompt_in_a_thread_leaves_the_event_loop_free(tok):
    """The Rust tokenizer must release the GIL while it encodes, or a thread does not help."""
    from tests.support.loop import loop_lag_of

    text = "hello world, this is a long prompt with some words. " * 20000  # about 1 MB
    ids, took, worst = loop_lag_of(tok.encode, text, False)
    assert len(ids) > 100_000
    assert worst < max(0.25, took / 3), (took, worst)  # the loop kept ticking while the thread encoded


def test_chat_template_options_reach_the_template(tok):
    """chat_template_kwargs become template variables (Qwen3's enable_thinking); the turn is opened,
    not opened, or the last message left open for the model to continue."""
    template = ("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last or not continue_open %}</>"
                "{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>"
                "{% if enable_thinking is defined and not enable_thinking %}<no-think>{% endif %}{% endif %}")
    t = Tokenizer(tok.backend, template.replace("continue_open", "false"), special_tokens=tok.special_tokens)
    msgs = [{"role": "user", "content": "hi"}]
    assert t.render_chat(msgs) == "<user>hi</><assistant>"
    assert t.render_chat(msgs, template_kwargs={"enable_thinking": False}) == "<user>hi</><assistant><no-think>"
    assert t.render_chat(msgs, add_generation_prompt=False) == "<user>hi</>"
    cont = tok.render_chat(msgs + [{"role": "assistant", "content": "Once upon"}], add_generation_prompt=False,
                           continue_final_message=True)
    assert cont.endswith("<|im_start|>assistant\nOnce upon")  # no <|im_end|>: the model goes on from here
    assert tok.encode_chat(msgs, add_special_tokens=True) == tok.encode(tok.render_chat(msgs), add_special_tokens=True)


NAMES = ["tokenize", "return_dict", "messages", "conversation", "tools", "padding", "truncation", "max_length",
         "return_tensors", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "enable_thinking"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(NAMES) | st.text(max_size=6),
                       st.none() | st.booleans() | st.integers(-5, 5) | st.text(max_size=4), max_size=4))
def test_any_template_kwargs_render_text_or_raise_invalid_request(tok, kwargs):
    """Even the names protocol.py refuses up front: text or a 400, never another exception."""
    try:
        assert isinstance(tok.render_chat([{"role": "user", "content": "hi"}], template_kwargs=kwargs), str)
    except InvalidRequest as exc:
        assert exc.field in ("messages", "chat_template_kwargs")
