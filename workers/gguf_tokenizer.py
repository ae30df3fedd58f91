"""A GGUF file's byte-level BPE tokenizer as Hugging Face tokenizer files, without transformers.

transformers' GGUF loader writes a different ``tokenizer.json`` in different versions: 5.24 writes
GPT-2's plain byte-level pipeline, 5.17 a ``Sequence`` decoder (ByteFallback, Fuse, Replace,
ByteLevel), byte fallback in the model and ``<|im_start|>`` as the EOS token. Every reader of the
file has to agree on it — the frontend's detokenizer and chat template (transformers), the
grammar's token trie (llguidance, which reads byte-level pieces as literal text unless the decoder
is ByteLevel) — so the files are built here, from the GGUF's own vocabulary, merges and special
token ids with the ``tokenizers`` library: the same bytes under every transformers version.

Only ``tokenizer.ggml.model == "gpt2"`` (byte-level BPE: GPT-2, SmolLM, Llama 3, Qwen, ...) is
supported. Its pre-tokenizer is GPT-2's ByteLevel regex, as transformers writes it for SmolLM2
(llama.cpp's ``tokenizer.ggml.pre`` names a model-specific regex, which neither reproduces).
"""

from __future__ import annotations

import json
from pathlib import Path

# The files written here are cached by workers/demo_model.py: bump its _FORMAT when they change.
CONTROL = 3  # tokenizer.ggml.token_type of a control (special) token
USER_DEFINED = 4  # an added token that is not special


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def tokenizer_json(gguf_file: str | Path) -> tuple[str, dict]:
    """``tokenizer.json`` text of ``gguf_file`` and its metadata: the special tokens' texts
    (``bos_token``, ``eos_token``, ``unk_token``, ``pad_token``: those the GGUF names), the chat
    template and the context length. Raises ValueError for a tokenizer that is not byte-level BPE."""
    from gguf import GGUFReader
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    reader = GGUFReader(str(gguf_file))
    kind = _field(reader, "tokenizer.ggml.model")
    if kind != "gpt2":
        raise ValueError(f"{gguf_file}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is supported")
    tokens = list(_field(reader, "tokenizer.ggml.tokens"))
    types = list(_field(reader, "tokenizer.ggml.token_type", [1] * len(tokens)))
    merges = [tuple(m.split(" ", 1)) for m in _field(reader, "tokenizer.ggml.merges")]
    bpe = models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, dropout=None, unk_token=None,
                     continuing_subword_prefix="", end_of_word_suffix="", fuse_unk=False, byte_fallback=False)
    tok = Tokenizer(bpe)
    tok.normalizer = None
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True)
    tok.decoder = decoders.ByteLevel(add_prefix_space=True, trim_offsets=True, use_regex=True)
    # no BOS/EOS added on encode (tokenizer.ggml.add_bos_token is false for SmolLM2; templates write them)
    tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    tok.add_tokens([AddedToken(tokens[i], special=types[i] == CONTROL, normalized=False)
                    for i in range(len(tokens)) if types[i] in (CONTROL, USER_DEFINED)])
    meta = {}
    for name in ("bos", "eos", "unknown", "padding"):
        token_id = _field(reader, f"tokenizer.ggml.{name}_token_id")
        if token_id is not None and 0 <= int(token_id) < len(tokens):
            meta[{"unknown": "unk", "padding": "pad"}.get(name, name) + "_token"] = tokens[int(token_id)]
    meta["chat_template"] = _field(reader, "tokenizer.chat_template", "")
    arch = _field(reader, "general.architecture", "")
    meta["context_length"] = int(_field(reader, f"{arch}.context_length", 0) or 0)
    return tok.to_str(pretty=True), meta


def write_tokenizer_files(gguf_file: str | Path, out_dir: str | Path) -> None:
    """``tokenizer.json`` and ``tokenizer_config.json`` (chat template inside) of ``gguf_file`` into
    ``out_dir``. The config names the generic fast tokenizer class, so transformers loads
    ``tokenizer.json`` as written instead of rebuilding a pipeline of its own for the model type."""
    text, meta = tokenizer_json(gguf_file)
    out = Path(out_dir)
    (out / "tokenizer.json").write_text(text)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        **{k: meta[k] for k in ("bos_token", "eos_token", "unk_token", "pad_token") if k in meta},
        "add_bos_token": False,
        "add_eos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": meta["context_length"] or 8192,
    }
    if meta["chat_template"]:
        config["chat_template"] = meta["chat_template"]
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")
