"""Loading a model from a local directory (config.json + safetensors) or a GGUF file.

GGUF goes through transformers' GGUF loader (dequantizes to float32); safetensors files are read
lazily one tensor at a time. Nothing is downloaded: paths must exist locally.

Under tensor parallelism (``tp``) a rank builds only its shard of the model and reads only its slice
of each tensor: safetensors through ``safe_open(...).get_slice``, GGUF through its own reader
(:func:`iter_gguf_sliced`: memory-mapped, only the slice's rows dequantized, or one whole tensor for
a column slice). A rank's peak is about 1/N of the weights plus one tensor.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import torch

from .config import ModelConfig
from .model import DecoderModel
from . import quant
from .parallel import SINGLE, TensorParallel
from .quant import QuantScheme

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
                if length == 0:  # none of it on this rank (another rank's expert)
                    continue
                index = (slice(None),) * dim + (slice(start, start + length),)
                yield name, f.get_slice(name)[index]


# llama.cpp's tensor names -> Hugging Face's (Llama, Mistral, Qwen2, Qwen3 families)
_GGUF_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_GGUF_LAYER = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
               "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm",
               "attn_k_norm": "self_attn.k_norm", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
               "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm"}


def gguf_config(path: Path) -> dict:
    """The Hugging Face config dict of a GGUF checkpoint (its metadata only; no tensor is read)."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()


def iter_gguf_sliced(path: Path, slicer: Slicer, cfg: ModelConfig) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, tensor) of a GGUF checkpoint, reading only what ``slicer`` asks for.

    The file is memory-mapped; a row slice (dim 0: q/k/v, gate/up, vocabulary rows) dequantizes only
    its rows (GGUF quantizes row by row), a column slice (o_proj, down_proj) dequantizes one whole
    tensor and keeps its columns. llama.cpp stores a Llama's q/k rows permuted per head for its
    rotary layout: each head's rows are put back (a slice holds whole heads)."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    for t in reader.tensors:
        parts = t.name.split(".")
        if parts[0] == "blk":
            mapped = _GGUF_LAYER.get(parts[2])
            name = f"model.layers.{parts[1]}.{mapped}.{parts[-1]}" if mapped else None
        else:
            mapped = _GGUF_TOP.get(parts[0])
            name = f"{mapped}.{parts[-1]}" if mapped else None
        if name is None:
            if "rope" in t.name:  # precomputed rotary factors: we compute our own
                continue
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        cut = slicer(name)
        data = t.data
        if cut is not None and cut[0] == 0:
            data = data[cut[1] : cut[1] + cut[2]]
        w = np.array(dequantize(data, t.tensor_type), dtype=np.float32)  # a copy: the file is mapped read-only
        if cut is not None and cut[0] == 1:
            w = w[:, cut[1] : cut[1] + cut[2]]
        if arch == "llama" and parts[0] == "blk" and parts[2] in ("attn_q", "attn_k"):
            heads = w.shape[0] // cfg.head_dim  # the heads this slice holds
            w = w.reshape(heads, cfg.head_dim // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        yield name, torch.from_numpy(np.ascontiguousarray(w))


def read_gguf_quantized(path: Path, cfg: ModelConfig) -> tuple[dict, list[tuple[str, torch.Tensor]]]:
    """A GGUF checkpoint whose layer projections stay quantized: ({(layer, part): {"q4_1": weight}}
    for :func:`quant.load`, [(name, float32 tensor)] for the rest, dequantized). Only ``Q4_1``
    projections are kept (what the demo file holds); another type is refused (load without
    ``gguf_quantized``). A Llama's q/k rows are put back from llama.cpp's per-head rotary order."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFReader, dequantize

    reader = GGUFReader(str(path))
    arch = bytes(reader.fields["general.architecture"].parts[-1]).decode()
    quantized: dict[tuple[int, str], dict] = {}
    dense = []
    for t in reader.tensors:
        parts = t.name.split(".")
        mapped = (_GGUF_LAYER if parts[0] == "blk" else _GGUF_TOP).get(parts[2] if parts[0] == "blk" else parts[0])
        if mapped is None:
            if "rope" in t.name:
                continue
            raise ValueError(f"unexpected GGUF tensor {t.name!r}")
        proj = mapped.split(".")[-1]
        if parts[0] == "blk" and proj in quant._PART and parts[-1] == "weight":
            if t.tensor_type != GGMLQuantizationType.Q4_1:
                raise ValueError(f"{t.name}: keeping GGUF weights quantized supports Q4_1 projections, "
                                 f"not {t.tensor_type.name}")
            w = quant.Q4_1Weight.from_gguf(torch.from_numpy(np.array(t.data)))
            if arch == "llama" and parts[2] in ("attn_q", "attn_k"):
                rows = w.qs.shape[0]
                w = w.rows(torch.arange(rows).reshape(rows // cfg.head_dim, cfg.head_dim // 2, 2)
                           .swapaxes(1, 2).reshape(-1))
            quantized[(int(parts[1]), proj)] = {"q4_1": w}
            continue
        name = f"model.layers.{parts[1]}.{mapped}.{parts[-1]}" if parts[0] == "blk" else f"{mapped}.{parts[-1]}"
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)
        dense.append((name, torch.from_numpy(w)))
    return quantized, dense


def read_gguf(path: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config dict, state dict) of a GGUF checkpoint, dequantized by transformers."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    config = hf.config.to_dict()
    state = {k: v.detach() for k, v in hf.state_dict().items()}
    return config, state


def model_class(cfg: ModelConfig) -> type[DecoderModel]:
    """The model class of ``cfg``'s family: Gemma 3 has layers of its own (:mod:`.gemma3`)."""
    if cfg.gemma is not None:
        from .gemma3 import Gemma3Model

        return Gemma3Model
    return DecoderModel


def _quant_scheme(path: Path, cfg: ModelConfig) -> QuantScheme | None:
    """A model directory's quantization: gpt-oss's MXFP4 experts are dequantized on load (None here);
    other quantized mixtures of experts are refused."""
    config = json.loads((path / "config.json").read_text())
    method = (config.get("quantization_config") or {}).get("quant_method")
    if method == "mxfp4" and cfg.model_type == "gpt_oss":
        log.info("%s: MXFP4 expert weights, dequantized on load", path)
        return None
    scheme = QuantScheme.of(config)
    if scheme is not None and cfg.moe is not None:
        raise ValueError(f"quantization method {method!r} is not supported for mixtures of experts "
                         f"({cfg.model_type}): load its bf16 weights")
    return scheme


def load_model(path: str | Path, *, dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
               max_positions: int | None = None, attention_fn=None, fused: bool = False,
               tp: TensorParallel = SINGLE, gguf_quantized: bool = False,
               expert_parallel: bool = False) -> DecoderModel:
    """Build a :class:`DecoderModel` from a model directory or a ``.gguf`` file, in eval mode.

    ``max_positions`` bounds the rotary tables (default: the config's max_position_embeddings);
    ``fused`` runs the GPU path's Triton kernels (see :mod:`workers.engine.model`); ``tp``: build
    and load this rank's shard only. ``gguf_quantized`` (a ``.gguf`` file, one rank): the layer
    projections keep the file's Q4_1 blocks (:class:`quant.Q4_1Weight`, dequantized per matmul)
    instead of becoming float tensors; embeddings and norms are dequantized as usual.
    ``expert_parallel``: a mixture of experts' experts are sharded over ``tp``'s ranks instead of
    sliced (:mod:`workers.engine.moe`).
    """
    path = Path(path)
    if not path.exists():
        raise ValueError(f"model path {path} does not exist")
    started = time.perf_counter()
    gguf = path.suffix == ".gguf"
    if gguf_quantized and (not gguf or tp.enabled):
        raise ValueError("gguf_quantized needs a .gguf file and one rank")
    if gguf and not tp.enabled and not gguf_quantized:
        raw, state = read_gguf(path)
        cfg = ModelConfig.from_dict(raw)
    else:
        cfg = ModelConfig.from_dict(gguf_config(path)) if gguf else ModelConfig.from_dir(path)
    scheme = QuantScheme("gguf") if gguf_quantized else None if gguf else _quant_scheme(path, cfg)
    with torch.device("meta"):
        model = model_class(cfg)(cfg, max_positions or cfg.max_position_embeddings, attention_fn, fused, tp,
                                 expert_parallel=expert_parallel)
    if scheme is not None:  # the projections' weights stay quantized (workers.engine.quant)
        quant.prepare(model)
    if gguf_quantized:
        quantized, weights = read_gguf_quantized(path, cfg)
        weights = iter(weights)
    elif gguf:
        weights = iter_gguf_sliced(path, model.checkpoint_slice, cfg) if tp.enabled else iter(state.items())
    else:
        weights = iter_safetensors(path, model.checkpoint_slice if tp.enabled else None)
    model.to_empty(device=device)
    model.to(dtype)
    model.reset_buffers()
    if scheme is not None and not gguf_quantized:
        quantized, weights = quant.split(weights, scheme)
    model.load_weights((name, t.to(device=device, dtype=dtype)) for name, t in weights)
    if scheme is not None:
        quant.load(model, scheme, quantized, device)
    model.eval()
    log.info("loaded %s (%s, %d layers%s) in %.2fs", path, cfg.model_type, cfg.num_layers,
             f", tensor-parallel rank {tp.rank} of {tp.size}" if tp.enabled else "", time.perf_counter() - started)
    return model
