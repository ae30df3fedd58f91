"""llguidance's tokenizer info from a model's ``tokenizer.json``, checked against the detokenizer.

The grammar engine matches the bytes of each token, which llguidance works out from the file's
decoder. It recognises byte-level BPE (GPT-2's alphabet: ``Ġ`` is a space) only when the decoder is
``ByteLevel``; transformers' GGUF conversion (4.57, 5.17) writes the same tokenizer with a
``Sequence`` decoder (ByteFallback, Fuse, Replace ``▁``, ByteLevel), and llguidance then reads
``Ġ"`` as the characters ``Ġ"``: a grammar refuses every token that starts with a space. So:

1. :func:`llguidance_json` gives llguidance a plain ``ByteLevel`` decoder where the file's decoder is
   a sequence of ByteLevel and steps that are no-ops on a byte-level vocabulary (ByteFallback, Fuse,
   Replace ``▁`` with a space: none of its pieces holds ``<0x..>`` or ``▁``);
2. :func:`grammar_tokenizer` checks that the result reads a probe text's tokens — quotes, spaces, a
   newline and a tab, accented letters, CJK, an emoji — as the ``tokenizers`` library decodes them
   (what the frontend shows), and raises :class:`TokenizerMismatch` otherwise: structured outputs on
   such a tokenizer would refuse valid text, so a worker refuses to start.

The frontend (:mod:`frontend.tokenizer`) and the target worker (:mod:`workers.engine.grammar`) both
build their tokenizer info here, so they agree.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

# Starts with a letter: a SentencePiece tokenizer's decoder drops the space it prepends, which
# llguidance keeps, so the comparison below ignores leading spaces.
PROBE = 'x {"naïve": "Ça coûte 12 €",\n\t\'q\': [1, 2]} — 你好 🙂 end'

# Decoder steps that change nothing on a byte-level BPE vocabulary.
_NO_OPS = ({"type": "ByteFallback"}, {"type": "Fuse"})
_METASPACE = "\u2581"


class TokenizerMismatch(ValueError):
    """The grammar engine reads a token's bytes differently from the detokenizer."""

    def __init__(self, source: str, token_ids: Sequence[int], expected: str, got: str):
        self.source, self.token_ids, self.expected, self.got = source, list(token_ids), expected, got
        super().__init__(
            f"{source}: the grammar engine (llguidance) reads the tokens of {expected!r} as {got!r}; "
            "structured outputs would refuse valid text. The tokenizer's decoder is one llguidance does "
            "not understand: give the model a tokenizer.json whose decoder is ByteLevel (byte-level BPE) "
            "or ByteFallback + Metaspace (SentencePiece)")


def _is_no_op(step: dict) -> bool:
    if step in _NO_OPS:
        return True
    return step.get("type") == "Replace" and step.get("pattern") == {"String": _METASPACE} and step.get("content") == " "


def llguidance_json(tokenizer_json: str) -> str:
    """``tokenizer_json`` with a ``Sequence`` decoder of ByteLevel and no-op steps replaced by its
    ByteLevel step (unchanged otherwise). Only what llguidance reads is changed; encoding is not."""
    data = json.loads(tokenizer_json)
    decoder = data.get("decoder") or {}
    if decoder.get("type") != "Sequence":
        return tokenizer_json
    steps = decoder.get("decoders") or []
    byte_level = [s for s in steps if s.get("type") == "ByteLevel"]
    if len(byte_level) != 1 or not all(s is byte_level[0] or _is_no_op(s) for s in steps):
        return tokenizer_json
    vocab = (data.get("model") or {}).get("vocab") or {}
    if any(_METASPACE in piece or (piece.startswith("<0x") and piece.endswith(">")) for piece in vocab):
        return tokenizer_json  # the extra steps do something on this vocabulary
    data["decoder"] = byte_level[0]
    return json.dumps(data, ensure_ascii=False)


def check_round_trip(info, tokenizer_json: str, source: str) -> None:
    """Raise :class:`TokenizerMismatch` unless ``info`` (an ``LLTokenizer``) reads the tokens of
    :data:`PROBE` as the ``tokenizers`` library decodes them from ``tokenizer_json``."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(tokenizer_json)
    ids = tok.encode(PROBE, add_special_tokens=False).ids
    expected = tok.decode(ids, skip_special_tokens=False)
    got = info.decode_bytes(ids).decode("utf-8", errors="replace")
    if got.lstrip(" ") != expected.lstrip(" "):
        raise TokenizerMismatch(source, ids, expected, got)


def grammar_tokenizer(tokenizer_file: str | Path, n_vocab: int, eos_token_ids: Sequence[int]):
    """llguidance's ``LLTokenizer`` for ``tokenizer_file`` (a ``tokenizer.json``), checked by
    :func:`check_round_trip`. Blocking: about 0.3 s for a 49k vocabulary."""
    from llguidance import LLTokenizer

    text = Path(tokenizer_file).read_text(encoding="utf-8")
    info = LLTokenizer(llguidance_json(text), n_vocab=n_vocab, eos_token=list(eos_token_ids))
    check_round_trip(info, text, str(tokenizer_file))
    return info
