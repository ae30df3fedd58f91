"""The demo tokenizer's files as a given transformers version's GGUF conversion writes them.

``transformers_conversions.json`` records, per version, the sections of ``tokenizer.json`` and
``tokenizer_config.json`` that differ between versions (recorded once with each version installed);
:func:`converted_as` rewrites the canonical files (:mod:`workers.gguf_tokenizer`) into that shape, so
tests see what a machine with that version would have, without it installed or a network.
"""

from __future__ import annotations

import json
from pathlib import Path

SHAPES = json.loads((Path(__file__).with_name("transformers_conversions.json")).read_text(encoding="utf-8"))
VERSIONS = sorted(k for k in SHAPES if not k.startswith("_"))


def converted_as(canonical_dir: Path, version: str, out_dir: Path) -> Path:
    """``out_dir`` with ``tokenizer.json``, ``tokenizer_config.json`` and ``chat_template.jinja`` as
    transformers ``version`` writes them for the demo model; returns ``out_dir``."""
    shape = SHAPES[version]
    tokenizer = json.loads((canonical_dir / "tokenizer.json").read_text(encoding="utf-8"))
    sections = shape["tokenizer.json"]
    tokenizer.update({k: v for k, v in sections.items() if k != "model"})
    tokenizer["model"] = {**tokenizer["model"], **sections["model"]}
    jinja = canonical_dir / "chat_template.jinja"  # where transformers 5 writes it
    template = jinja.read_text(encoding="utf-8") if jinja.exists() else \
        json.loads((canonical_dir / "tokenizer_config.json").read_text(encoding="utf-8"))["chat_template"]
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False), encoding="utf-8")
    (out_dir / "tokenizer_config.json").write_text(json.dumps(shape["tokenizer_config.json"]), encoding="utf-8")
    (out_dir / "chat_template.jinja").write_text(template, encoding="utf-8")
    return out_dir
