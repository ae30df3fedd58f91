"""Tiny in-memory ``tokenizers.Tokenizer``s for tests of text output: a byte-level one (token i is the
byte i, as a byte-level BPE's alphabet maps it) and one whose token i is a given character."""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers


def _byte_alphabet() -> list[str]:
    """GPT-2's byte-to-unicode table, the one ``tokenizers``' ByteLevel decoder inverts."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table, extra = {}, 0
    for b in range(256):
        if b in printable:
            table[b] = chr(b)
        else:
            table[b] = chr(256 + extra)
            extra += 1
    return [table[b] for b in range(256)]


def byte_tokenizer() -> Tokenizer:
    tok = Tokenizer(models.BPE(vocab={ch: b for b, ch in enumerate(_byte_alphabet())}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    return tok


def char_tokenizer(chars: str) -> Tokenizer:
    """Token i decodes to ``chars[i]``; tokens join with nothing between them."""
    tok = Tokenizer(models.WordLevel(vocab={ch: i for i, ch in enumerate(chars)}, unk_token=chars[0]))
    tok.decoder = decoders.Fuse()
    return tok
