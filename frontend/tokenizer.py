"""A model's tokenizer and chat template, loaded from the local directory a model card names.

Workers receive token ids; the frontend owns text. Encoding and decoding go through the Rust
``tokenizers`` library, chat templates through jinja2 (:mod:`frontend.chat_template`), as Dynamo's
and TGI's frontends do: no transformers (which imports torch) in the frontend, so a frontend starts,
and a crashed one is back, in about a second rather than three. ``tokenizer.json`` defines the
tokenizer; ``tokenizer_config.json`` adds what transformers adds on loading it: the named special
tokens (registered as special where the file lacks them) and the chat template (or
``chat_template.jinja``). A directory without ``tokenizer.json`` (a SentencePiece-only model) is
converted by transformers, imported only then.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as RustTokenizer

from runtime import InvalidRequest
from runtime.grammar_tokenizer import grammar_tokenizer

from .chat_template import render as render_template

log = logging.getLogger(__name__)

# transformers' named special tokens: the template variables every chat template may use
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerLoadError(Exception):
    """The tokenizer files named by a model card could not be loaded."""


class Tokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(self, backend: RustTokenizer, chat_template: str = "", eos_token_ids: Sequence[int] = (),
                 path: str = "", special_tokens: Mapping[str, str] | None = None,
                 extra_special_tokens: Sequence[str] = (), templates: Mapping[str, str] | None = None):
        """``special_tokens``: the named ones (``bos_token``, ...) by name; ``templates``: a model's named
        chat templates, where it has several (``tool_use`` is chosen for requests with tools)."""
        self.backend = backend
        self.path = path  # the directory it was loaded from ("" when built in memory)
        self._grammar_info = None  # llguidance's tokenizer info, built on first use
        self.special_tokens = dict(special_tokens or {})
        self._templates = dict(templates or {})
        self.chat_template = chat_template or self._templates.get("default", "")
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        specials = [*self.special_tokens.values(), *extra_special_tokens]
        self.special_ids = frozenset(i for i in map(backend.token_to_id, specials) if i is not None)
        eos = list(eos_token_ids)
        if not eos and self.special_tokens.get("eos_token"):
            eos_id = backend.token_to_id(self.special_tokens["eos_token"])
            eos = [eos_id] if eos_id is not None else []
        self.eos_token_ids = tuple(eos)
        self._byte_decoder: dict[str, int] | None = None  # byte-level BPE's alphabet, built on first use

    @classmethod
    def load(cls, path: str, chat_template: str = "", eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load from a local directory (blocking, about 0.1 s: call it in a thread)."""
        if not path or not Path(path).is_dir():
            raise TokenizerLoadError(f"tokenizer directory {path!r} does not exist")
        try:
            if (Path(path) / "tokenizer.json").exists():
                backend, config = _read(Path(path))
            else:
                backend, config = _convert_with_transformers(path)
            tok = _build(backend, config, Path(path), chat_template, eos_token_ids)
        except Exception as exc:
            raise TokenizerLoadError(f"could not load the tokenizer in {path}: {exc}") from exc
        log.info("loaded tokenizer from %s (vocab %d)", path, tok.vocab_size)
        return tok

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. The fast path goes through ``encode_batch``, which releases the GIL
        while it works (``encode`` holds it: a 1.4 MB prompt encoded in a thread still stalled the
        event loop, and every stream on it, for about a second)."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` without special tokens (what users see)."""
        return self.backend.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included (for logprobs)."""
        return self.backend.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (logprobs' ``bytes``): a byte-level BPE token maps back through
        its byte alphabet, a SentencePiece byte-fallback token ``<0xAB>`` is that byte, ``▁`` a
        space. A token that is part of a multi-byte character gives that part, so the bytes of a
        reply's tokens join to its UTF-8 text even where one token's text alone is ``'�'``."""
        if self._byte_decoder is None:
            self._byte_decoder = _byte_level_decoder() if self._byte_level() else {}
        piece = self.backend.id_to_token(token_id)
        if piece is None:
            return b""
        if token_id in self.special_ids:
            return piece.encode()
        if self._byte_decoder and all(ch in self._byte_decoder for ch in piece):
            return bytes(self._byte_decoder[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):
            try:
                return bytes([int(piece[3:5], 16)])
            except ValueError:
                pass
        return piece.replace("\u2581", " ").encode()

    def _byte_level(self) -> bool:
        """Whether the fast tokenizer decodes byte-level BPE (GPT-2's byte alphabet)."""
        try:
            decoder = json.loads(self.backend.to_str()).get("decoder") or {}
        except Exception:
            return False
        kinds = [decoder.get("type")] + [d.get("type") for d in decoder.get("decoders", []) or []]
        return "ByteLevel" in kinds

    def grammar_info(self):
        """llguidance's tokenizer info, as the workers build it (``tokenizer.json``, vocabulary, EOS),
        to check that grammars can be followed (:func:`frontend.structured.probe`); None when there is
        no ``tokenizer.json`` or EOS id. Blocking the first time (a fraction of a second); raises
        :class:`~runtime.grammar_tokenizer.TokenizerMismatch` for a tokenizer llguidance misreads."""
        if self._grammar_info is None:
            path = Path(self.path) / "tokenizer.json" if self.path else None
            if path is None or not path.exists() or not self.eos_token_ids:
                return None
            self._grammar_info = grammar_tokenizer(path, self.vocab_size, self.eos_token_ids)
        return self._grammar_info

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None) -> str:
        """The chat template applied to ``messages``, with the assistant's turn opened (or, with
        ``continue_final_message``, the last message left open); ``tools`` (OpenAI's function
        definitions) go to templates that render them, ``template_kwargs`` are further template
        variables (Qwen3's ``enable_thinking``)."""
        template = self._templates.get("tool_use", self.chat_template) if tools else self.chat_template
        if not template:
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        try:
            return render_template(template, messages, tools or None, add_generation_prompt,
                                        continue_final_message, {**self.special_tokens, **(template_kwargs or {})})
        except Exception as exc:  # jinja2 errors, raise_exception() in the template, what it did to the data
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", "messages") from None

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        # The template already writes the special tokens (BOS, role markers) it wants.
        text = self.render_chat(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or an AddedToken's fields."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


def _read(path: Path) -> tuple[RustTokenizer, dict]:
    """``tokenizer.json`` and the settings beside it: ``tokenizer_config.json`` with what the legacy
    ``special_tokens_map.json`` names and the config does not, and ``chat_template.jinja``."""
    config: dict = {}
    cfg = path / "tokenizer_config.json"
    if cfg.exists():
        config = json.loads(cfg.read_text(encoding="utf-8"))
    legacy = path / "special_tokens_map.json"
    if legacy.exists() and "added_tokens_decoder" not in config:  # transformers reads it only then
        for key, value in json.loads(legacy.read_text(encoding="utf-8")).items():
            config.setdefault(key, value)
    jinja = path / "chat_template.jinja"
    if jinja.exists():
        config["chat_template"] = jinja.read_text(encoding="utf-8")
    return RustTokenizer.from_file(str(path / "tokenizer.json")), config


def _convert_with_transformers(path: str) -> tuple[RustTokenizer, dict]:
    """A tokenizer that only exists in a slow format, converted by transformers (seconds: it imports torch)."""
    from transformers import AutoTokenizer

    hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None:
        raise TokenizerLoadError(f"the tokenizer in {path} has no fast (tokenizers) form")
    config = {**hf.special_tokens_map, "chat_template": hf.chat_template or "",
              "extra_special_tokens": [str(t) for t in getattr(hf, "all_special_tokens", ())]}
    return backend, config


def _build(backend: RustTokenizer, config: dict, path: Path, chat_template_text: str,
           eos_token_ids: Sequence[int]) -> Tokenizer:
    """The frontend's tokenizer from ``tokenizer.json`` and its settings, adjusted as transformers (5)
    adjusts it on loading: added tokens the config lists and the file lacks, and named and extra
    special tokens registered as special tokens. The file's post-processor alone decides BOS / EOS
    (transformers ignores the config's ``add_bos_token`` / ``add_eos_token`` beside a tokenizer.json)."""
    known = {t.content for t in backend.get_added_tokens_decoder().values()}
    from_config = []
    for _, token in sorted((config.get("added_tokens_decoder") or {}).items(), key=lambda kv: int(kv[0])):
        if isinstance(token, dict) and token.get("content") and token["content"] not in known:
            fields = {k: token[k] for k in ("single_word", "lstrip", "rstrip", "normalized", "special") if k in token}
            from_config.append(AddedToken(token["content"], **fields))
            known.add(token["content"])
    if from_config:
        backend.add_tokens(from_config)
    named = {name: text for name in SPECIAL_TOKEN_NAMES if (text := _token_text(config.get(name)))}
    extra_raw = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
    if isinstance(extra_raw, dict):  # model-specific names (image_token, ...): special, but no template variables
        extra_raw = list(extra_raw.values())
    extra = [text for value in extra_raw if (text := _token_text(value))]
    missing = [t for t in dict.fromkeys([*named.values(), *extra]) if t not in known]
    if missing:
        backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in missing])
    template = config.get("chat_template") or ""
    templates = {}
    if isinstance(template, list):  # several named templates, as tokenizer_config.json lists them
        template = {t["name"]: t["template"] for t in template if isinstance(t, dict) and "name" in t}
    if isinstance(template, dict):
        templates, template = template, ""
    return Tokenizer(backend, chat_template_text or template, eos_token_ids, str(path), named, extra, templates)


def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-level alphabet, inverted: the printable character each byte is written as -> the byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[chr(b)] = b
        else:
            chars[chr(256 + extra)] = b
            extra += 1
    return chars
