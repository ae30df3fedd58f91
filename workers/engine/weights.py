"""Loading a model from a local directory (config.json + safetensors) or a GGUF file.

GGUF goes through transformers' GGUF loader (dequantizes to float32); safetensors files are read
lazily one tensor at a time. Nothing is downloaded: paths must exist locally.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path

import torch

from .config import ModelConfig
from .model import DecoderModel

log = logging.getLogger(__name__)


def iter_safetensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every ``*.safetensors`` file in ``model_dir``."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a GGUF checkpoint, dequantized by transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = hf.config.to_dict()
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    return config, state


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               max_positions: int | None = None, attention_fn=None, fused: bool = False) -> DecoderModel:
    """Build a :class:`DecoderModel` from a model directory or a ``.gguf`` file, in eval mode.

    ``max_positions`` bounds the rotary tables (default: the config's max_position_embeddings);
    ``fused`` runs the GPU path's Triton kernels (see :mod:`workers.engine.model`).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    started = time.perf_counter()
    if path.suffix == ".gguf":
        raw, state = read_gguf(path)
        cfg = ModelConfig.from_dict(raw)
        weights = iter(state.items())
    else:
        cfg = ModelConfig.from_dir(path)
        weights = iter_safetensors(path)
    with torch.device("meta"):
        model = DecoderModel(cfg, max_positions or cfg.max_position_embeddings, attention_fn, fused)
    model.to_empty(device=device)
    model.to(dtype)
    model.reset_buffers()
    model.load_weights((name, t.to(dtype)) for name, t in weights)
    model.eval()
    log.info("loaded %s (%s, %d layers) in %.2fs", path, cfg.model_type, cfg.num_layers, time.perf_counter() - started)
    return model
