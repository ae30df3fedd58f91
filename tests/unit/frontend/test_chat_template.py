"""The frontend's tokenizer without transformers: the same chat text, byte for byte, and the same token
ids, special tokens and vocabulary as transformers' ``AutoTokenizer`` gives for the demo model, the
files each transformers version's GGUF conversion writes for it, and templates that use what
transformers' Jinja environment provides (tools, ``tojson``, ``namespace``, reasoning, special-token
variables, ``raise_exception``, ``{% generation %}``, ``continue_final_message``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from frontend.tokenizer import Tokenizer
from runtime import InvalidRequest
from runtime.config import importable_env
from tests.support.tokenizer_files import VERSIONS, converted_as

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[3]

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "description": "Ünïcode <&> \"city\""}},
                                                "required": ["city"]}}}

# Qwen2.5/Qwen3's shape (hermes tool calls, reasoning, namespace), trimmed
QWEN_LIKE = """{%- if tools %}
{{- '<|im_start|>system\\n' }}{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- "# Tools\\n\\n<tools>" }}
{%- for tool in tools %}{{- "\\n" }}{{- tool | tojson }}{%- endfor %}
{{- "\\n</tools><|im_end|>\\n" }}
{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(last_user=0) %}
{%- for message in messages %}{%- if message.role == 'user' %}{%- set ns.last_user = loop.index0 %}{%- endif %}{%- endfor %}
{%- for message in messages %}
  {%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}
{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
  {%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
    {%- if message.reasoning_content is defined and loop.index0 > ns.last_user %}
{{- '<think>\\n' + message.reasoning_content.strip('\\n') + '\\n</think>\\n\\n' }}
    {%- endif %}
{{- message.content if message.content is defined else '' }}
    {%- for tc in message.tool_calls or [] %}
{{- '\\n<tool_call>\\n{"name": "' + tc.function.name + '", "arguments": ' + tc.function.arguments + '}\\n</tool_call>' }}
    {%- endfor %}
{{- '<|im_end|>\\n' }}
  {%- elif message.role == 'tool' %}
{{- '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}
  {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}
  {%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}"""

# Special-token variables, dict(), tojson options, loop controls, {% generation %}, raise_exception
FEATURES = """{{ bos_token }}{% set d = dict(a=1) %}{% for m in messages %}
  {% if m.role not in ['user', 'assistant', 'system'] %}{{ raise_exception('bad role ' + m.role) }}{% endif %}
  {% if m.content == 'skip' %}{% continue %}{% endif %}
  {% if m.role == 'assistant' %}{% generation %}[A]{{ m.content }}{{ eos_token }}{% endgeneration %}
  {% else %}[{{ m.role | upper }}] {{ m.content }} {{ d | tojson(indent=2, sort_keys=True) }}
  {% endif %}
{% endfor %}{% if add_generation_prompt %}[A]{% endif %}"""

CHATS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Ünïcode 🙂 <b>&amp;</b>"},
     {"role": "assistant", "content": "ok", "reasoning_content": "\nthink\n"}, {"role": "user", "content": "skip"},
     {"role": "user", "content": "again", "name": None}],
    [{"role": "user", "content": "Weather?"},
     {"role": "assistant", "content": None, "tool_calls": [
         {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Oslo\"}"}}]},
     {"role": "tool", "tool_call_id": "c1", "content": "sunny"}],
    [{"role": "user", "content": "Write"}, {"role": "assistant", "content": "Once upon  ", "reasoning": "plan"}],
]


@pytest.fixture(scope="module")
def demo_dir() -> Path:
    from workers.demo_model import demo_tokenizer_dir

    return demo_tokenizer_dir()


@pytest.fixture(scope="module")
def dirs(demo_dir, tmp_path_factory) -> dict[str, Path]:
    out = {"demo": demo_dir}
    for version in VERSIONS:
        out[version] = converted_as(demo_dir, version, tmp_path_factory.mktemp(f"gguf-{version}"))
    return out


def _hf(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def _expected(hf, chat, template, **kwargs):
    try:
        return hf.apply_chat_template(chat, chat_template=template, tokenize=False, **kwargs)
    except Exception as exc:  # what the frontend must turn into a 400
        return type(exc)


def _ours(tok, chat, template, tools=None, add_generation_prompt=False, continue_final_message=False, **variables):
    if template is not None:
        tok = Tokenizer(tok.backend, template, tok.eos_token_ids, special_tokens=tok.special_tokens)
    try:
        return tok.render_chat(chat, tools, add_generation_prompt, continue_final_message, variables)
    except InvalidRequest:
        return InvalidRequest


@pytest.mark.parametrize("name", ["demo", *VERSIONS])
def test_the_same_ids_special_tokens_and_vocabulary_as_transformers(dirs, name):
    tok, hf = Tokenizer.load(str(dirs[name])), _hf(dirs[name])
    assert tok.vocab_size == len(hf) and tok.special_ids == set(hf.all_special_ids)
    assert tok.eos_token_ids == (hf.eos_token_id,)
    assert tok.special_tokens == hf.special_tokens_map
    texts = ["Hello, world!", "  leading spaces\tand tabs\n\n", "Ünïcode 🙂 日本語", "<|im_start|>user\nhi<|im_end|>",
             "<|endoftext|> mid <repo_name> text"]
    for text in texts:
        for special in (True, False):
            assert tok.encode(text, special) == hf.encode(text, add_special_tokens=special), (text, special)
        ids = hf.encode(text)
        assert tok.decode(ids) == hf.decode(ids, skip_special_tokens=True)
    assert tok.chat_template == hf.chat_template


@pytest.mark.parametrize("name", ["demo", *VERSIONS])
def test_the_models_own_template_renders_as_transformers_renders_it(dirs, name):
    tok, hf = Tokenizer.load(str(dirs[name])), _hf(dirs[name])
    rendered = 0
    for chat in CHATS:
        for opened in (True, False):
            expected = _expected(hf, chat, None, add_generation_prompt=opened)
            assert _ours(tok, chat, None, None, opened) == (InvalidRequest if isinstance(expected, type) else expected)
            rendered += isinstance(expected, str)
        if isinstance(_expected(hf, chat, None), str):
            assert tok.encode_chat(chat) == hf.apply_chat_template(chat, add_generation_prompt=True, return_dict=False)
    assert rendered >= 4  # not all refusals
    chat = CHATS[3]
    assert tok.render_chat(chat, add_generation_prompt=False, continue_final_message=True) == \
        hf.apply_chat_template(chat, tokenize=False, continue_final_message=True)


@pytest.mark.parametrize("template", [QWEN_LIKE, FEATURES], ids=["qwen_like", "features"])
def test_templates_render_byte_for_byte_as_in_transformers(demo_dir, template):
    tok, hf = Tokenizer.load(str(demo_dir)), _hf(demo_dir)
    for chat in CHATS + [[{"role": "robot", "content": "x"}]]:
        for tools in (None, [WEATHER]):
            for variables in ({}, {"enable_thinking": False}, {"bos_token": "<override>"}):
                for opened in (True, False):
                    expected = _expected(hf, chat, template, tools=tools, add_generation_prompt=opened, **variables)
                    got = _ours(tok, chat, template, tools, opened, **variables)
                    assert got == expected or (got is InvalidRequest and isinstance(expected, type)), \
                        (chat, tools, variables, opened, got, expected)
                expected = _expected(hf, chat, template, tools=tools, continue_final_message=True, **variables)
                got = _ours(tok, chat, template, tools, False, True, **variables)
                assert got == expected or (got is InvalidRequest and isinstance(expected, type)), (chat, got, expected)
    assert _ours(tok, CHATS[0], FEATURES) == "<|im_start|>[USER] hi {\n  \"a\": 1\n}\n"


def test_a_model_with_several_templates_uses_tool_use_for_tools(demo_dir, tmp_path):
    config = json.loads((demo_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = [{"name": "default", "template": "D{{ messages[0].content }}"},
                               {"name": "tool_use", "template": "T{{ tools[0].function.name }}"}]
    (tmp_path / "tokenizer.json").write_bytes((demo_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok = Tokenizer.load(str(tmp_path))
    assert tok.render_chat(CHATS[0]) == "Dhi" and tok.render_chat(CHATS[0], [WEATHER]) == "Tget_weather"


def test_the_config_adds_the_special_tokens_the_file_lacks(demo_dir, tmp_path):
    """What transformers does on loading: a named or extra special token that tokenizer.json does not
    list becomes a special token; ``add_bos_token`` beside a tokenizer.json changes nothing (its
    post-processor decides)."""
    config = {**json.loads((demo_dir / "tokenizer_config.json").read_text()), "add_bos_token": True,
              "sep_token": "<my_sep>", "additional_special_tokens": ["<tool_x>"]}
    (tmp_path / "tokenizer.json").write_bytes((demo_dir / "tokenizer.json").read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    tok, hf = Tokenizer.load(str(tmp_path)), _hf(tmp_path)
    for text in ("hi <my_sep> there", "a<tool_x>b"):
        for special in (True, False):
            assert tok.encode(text, special) == hf.encode(text, add_special_tokens=special)
    assert tok.encode("hi") == [6004] and tok.vocab_size == len(hf) == 49154
    assert tok.special_ids == set(hf.all_special_ids)


def test_loading_imports_neither_transformers_nor_torch(demo_dir):
    """Why this module exists: a (re)started frontend answers after about a second, not three."""
    code = ("import sys\nfrom frontend.__main__ import main\nfrom frontend.tokenizer import Tokenizer\n"
            f"tok = Tokenizer.load({str(demo_dir)!r})\n"
            "tok.encode_chat([{'role': 'user', 'content': 'hi'}])\n"
            "print(sorted(m for m in ('transformers', 'torch') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code], env=importable_env(os.environ), capture_output=True, text=True,
                         timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"
