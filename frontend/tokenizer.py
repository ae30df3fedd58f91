"""A model's tokenizer and chat template, loaded from the local directory a model card names.

Workers receive token ids; the frontend owns text. Encoding and decoding go through the Rust
``tokenizers`` backend where the tokenizer has one (a fast tokenizer), which is what keeps the
frontend's per-request overhead small.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path

from runtime import InvalidRequest
from runtime.grammar_tokenizer import grammar_tokenizer

log = logging.getLogger(__name__)


class TokenizerLoadError(Exception):
    """The tokenizer files named by a model card could not be loaded."""


class Tokenizer:
    """Encode, decode and render chat prompts for one model."""

    def __init__(self, hf_tokenizer, chat_template: str = "", eos_token_ids: Sequence[int] = (), path: str = ""):
        self._hf = hf_tokenizer
        self.path = path  # the directory it was loaded from ("" when built in memory)
        self._grammar_info = None  # llguidance's tokenizer info, built on first use
        self._fast = getattr(hf_tokenizer, "backend_tokenizer", None)
        self._backend = None  # the tokenizers.Tokenizer that streams decode (built on first use)
        self.chat_template = chat_template or getattr(hf_tokenizer, "chat_template", None) or ""
        self.vocab_size = len(hf_tokenizer)
        self.special_ids = frozenset(getattr(hf_tokenizer, "all_special_ids", ()) or ())
        eos = list(eos_token_ids)
        if not eos and getattr(hf_tokenizer, "eos_token_id", None) is not None:
            eos = [hf_tokenizer.eos_token_id]
        self.eos_token_ids = tuple(eos)
        self._byte_decoder: dict[str, int] | None = None  # byte-level BPE's alphabet, built on first use

    @classmethod
    def load(cls, path: str, chat_template: str = "", eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        """Load from a local directory (blocking, about 2 s: call it in a thread)."""
        if not path or not Path(path).is_dir():
            raise TokenizerLoadError(f"tokenizer directory {path!r} does not exist")
        from transformers import AutoTokenizer  # heavy import, only where a tokenizer is needed

        try:
            hf = AutoTokenizer.from_pretrained(path, local_files_only=True)
        except Exception as exc:
            raise TokenizerLoadError(f"could not load the tokenizer in {path}: {exc}") from exc
        log.info("loaded tokenizer from %s (vocab %d)", path, len(hf))
        return cls(hf, chat_template, eos_token_ids, path)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. The fast path goes through ``encode_batch``, which releases the GIL
        while it works (``encode`` holds it: a 1.4 MB prompt encoded in a thread still stalled the
        event loop, and every stream on it, for about a second)."""
        if self._fast is not None:
            return self._fast.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        return self._hf.encode(text, add_special_tokens=add_special_tokens)

    @property
    def backend(self):
        """The ``tokenizers.Tokenizer`` behind it (a slow tokenizer's converted once), for streaming decode."""
        if self._backend is None:
            from transformers.convert_slow_tokenizer import convert_slow_tokenizer

            self._backend = self._fast or convert_slow_tokenizer(self._hf)
        return self._backend

    def decode(self, token_ids: list[int]) -> str:
        """Text of ``token_ids`` without special tokens (what users see)."""
        if self._fast is not None:
            return self._fast.decode(token_ids, skip_special_tokens=True)
        return self._hf.decode(token_ids, skip_special_tokens=True)

    def token_text(self, token_id: int) -> str:
        """The text of one token, special tokens included (for logprobs)."""
        if self._fast is not None:
            return self._fast.decode([token_id], skip_special_tokens=False)
        return self._hf.decode([token_id], skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The raw bytes of one token (logprobs' ``bytes``): a byte-level BPE token maps back through
        its byte alphabet, a SentencePiece byte-fallback token ``<0xAB>`` is that byte, ``▁`` a
        space. A token that is part of a multi-byte character gives that part, so the bytes of a
        reply's tokens join to its UTF-8 text even where one token's text alone is ``'�'``."""
        if self._byte_decoder is None:
            self._byte_decoder = _byte_level_decoder() if self._byte_level() else {}
        piece = self._hf.convert_ids_to_tokens(token_id)
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
        if self._fast is None:
            return False
        try:
            decoder = json.loads(self._fast.to_str()).get("decoder") or {}
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
        if not self.chat_template:
            raise InvalidRequest("this model has no chat template; use /v1/completions", "messages")
        try:
            text = self._hf.apply_chat_template(
                messages, chat_template=self.chat_template, tokenize=False, add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message, tools=tools or None, **(template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 errors, raise_exception() in the template
            raise InvalidRequest(f"the chat template rejected the messages: {exc}", "messages") from None
        if not isinstance(text, str):  # a template variable that changed what the call returns
            raise InvalidRequest("chat_template_kwargs changed what the chat template returns", "chat_template_kwargs")
        return text

    def encode_chat(self, messages: list[dict], tools: list[dict] | None = None, add_generation_prompt: bool = True,
                    continue_final_message: bool = False, template_kwargs: dict | None = None,
                    add_special_tokens: bool = False) -> list[int]:
        # The template already writes the special tokens (BOS, role markers) it wants.
        text = self.render_chat(messages, tools, add_generation_prompt, continue_final_message, template_kwargs)
        return self.encode(text, add_special_tokens=add_special_tokens)


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
