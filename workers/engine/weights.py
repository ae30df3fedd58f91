"""Loading a model from a local directory (config.json + safetensors) or a GGUF file.

GGUF goes through transformers' GGUF loader (dequantizes to float32); safetensors files are read
lazily one tensor at a time. Nothing is downloaded: paths must exist locally.

Under tensor parallelism (``tp``) a rank builds only its shard of the model and reads only its slice
of each safetensors tensor (``safe_open(...).get_slice``), so its peak is about 1/N of the weights
(plus one whole norm vector at a time). A GGUF file is dequantized whole by transformers first and
then cut, so a rank loading one peaks at the whole model in float32 before it frees all but its slice.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .config import ModelConfig
from .model import DecoderModel
from .parallel import SINGLE, TensorParallel

log = logging.getLogger(__name__)


Slicer = Callable[[str], "tuple[int, int, int] | None"]  # name -> (dim, start, length) to read, None: all


def iter_safetensors(model_dir: Path, slicer: Slicer | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of every ``*.safetensors`` file in ``model_dir``; where
    ``slicer(name)`` gives (dim, start, length), only that slice is read from the file."""
    from safetensors import safe_open

    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    for path in files:
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                cut = slicer(name) if slicer is not None else None
                if cut is None:
                    yield name, f.get_tensor(name)
                    continue
                dim, start, length = cut
                index = (slice(None),) * dim + (slice(start, start + length),)
                yield name, f.get_slice(name)[index]


def _sliced(weights: Iterator[tuple[str, torch.Tensor]], slicer: Slicer) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        cut = slicer(name)
        yield name, tensor if cut is None else tensor.narrow(*cut).clone()


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a GGUF checkpoint, dequantized by transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = hf.config.to_dict()
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    return config, state


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               max_positions: int | None = None, attention_fn=None, fused: bool = False,
               tp: TensorParallel = SINGLE) -> DecoderModel:
    """Build a :class:`DecoderModel` from a model directory or a ``.gguf`` file, in eval mode.

    ``max_positions`` bounds the rotary tables (default: the config's max_position_embeddings);
    ``fused`` runs the GPU path's Triton kernels (see :mod:`workers.engine.model`); ``tp``: build
    and load this rank's shard only.
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    started = time.perf_counter()
    gguf = path.suffix == ".gguf"
    if gguf:
        raw, state = read_gguf(path)
        cfg = ModelConfig.from_dict(raw)
    else:
        cfg = ModelConfig.from_dir(path)
    with torch.device("meta"):
        model = DecoderModel(cfg, max_positions or cfg.max_position_embeddings, attention_fn, fused, tp)
    slicer = model.checkpoint_slice if tp.enabled else None
    if gguf:
        weights = _sliced(iter(state.items()), slicer) if slicer else iter(state.items())
    else:
        weights = iter_safetensors(path, slicer)
    model.to_empty(device=device)
    model.to(dtype)
    model.reset_buffers()
    model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights)
    model.eval()
    log.info("loaded %s (%s, %d layers%s) in %.2fs", path, cfg.model_type, cfg.num_layers,
             f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.enabled else "", time.perf_counter() - started)
    return model
