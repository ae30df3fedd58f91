"""Quantized checkpoints of a Hugging Face Llama, for tests and benches.

FP8: written by ``compressed-tensors`` itself (the library llm-compressor saves with): its
quantization config applied to the model, weight scales set the way llm-compressor's min-max
observer sets them for a symmetric FP8 scheme (amax / 448, per tensor or per output channel), then
its ``ModelCompressor`` compresses and saves. transformers reads it back (decompressed) as the
reference.

INT4: AutoAWQ's GEMM layout and GPTQ's v1 layout, packed here following their published packing
code (AutoAWQ ``WQLinear_GEMM.from_linear``, GPTQ ``QuantLinear.pack``): their libraries need CUDA
kernels that do not install on this CPU machine. The reference is the dequantized weights computed
before packing, put into the transformers model.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_fp8(model, out: Path, strategy: str) -> Path:
    """Save ``model`` (a HF causal LM, changed in place) as a compressed-tensors FP8 checkpoint."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationArgs, QuantizationConfig, QuantizationScheme,
                                                 apply_quantization_config)
    from compressed_tensors.quantization.utils import calculate_qparams

    args = QuantizationArgs(num_bits=8, type="float", strategy=strategy, symmetric=True, dynamic=False)
    config = QuantizationConfig(config_groups={"group_0": QuantizationScheme(targets=["Linear"], weights=args)},
                                ignore=["lm_head"])
    apply_quantization_config(model, config)
    with torch.no_grad():
        for module in model.modules():
            if not hasattr(module, "weight_scale"):
                continue
            w = module.weight
            dims = dict(dim=1, keepdim=True) if strategy == "channel" else {}
            lo = w.amin(**dims).reshape(-1).clamp(max=0)
            hi = w.amax(**dims).reshape(-1).clamp(min=0)
            scale, zero = calculate_qparams(lo, hi, args)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            if hasattr(module, "weight_zero_point"):
                module.weight_zero_point.copy_(zero.reshape(module.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format="float-quantized")
    compressor.compress_model(model)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    return out


def read_fp8_reference(path: Path):
    """transformers' model of a compressed-tensors checkpoint, decompressed to float32 (eval)."""
    import transformers as tf

    config = tf.CompressedTensorsConfig(run_compressed=False)
    return tf.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32,
                                                   quantization_config=config).eval()


def quantize_int4(w: torch.Tensor, group: int, order: torch.Tensor | None = None, sym: bool = False):
    """Asymmetric (or symmetric) 4-bit min-max quantization of w [out, in] by input groups.

    ``order``: the input permutation act-order quantizes in (group k = inputs order[k*g:(k+1)*g]).
    Returns (q [out, in] 0..15, zeros [out, in/g] 0..15, scales [out, in/g], g_idx [in], dequantized w)."""
    out, n = w.shape
    g_idx = torch.empty(n, dtype=torch.long)
    order = torch.arange(n) if order is None else order
    g_idx[order] = torch.arange(n) // group
    q = torch.empty(out, n, dtype=torch.long)
    zeros = torch.empty(out, n // group, dtype=torch.long)
    scales = torch.empty(out, n // group, dtype=torch.float16)
    for k in range(n // group):
        cols = (g_idx == k).nonzero().squeeze(1)
        block = w[:, cols].float()
        if sym:
            s = (block.abs().amax(1) / 7.5).clamp(min=1e-8).half()
            z = torch.full((out,), 8)
        else:
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            s = ((hi - lo) / 15).clamp(min=1e-8).half()
            z = (-lo / s.float()).round().clamp(0, 15).long()
        q[:, cols] = (block / s.float()[:, None] + z[:, None]).round().clamp(0, 15).long()
        zeros[:, k], scales[:, k] = z, s
    deq = (q.float() - zeros.float()[:, g_idx]) * scales.float()[:, g_idx]
    return q, zeros, scales, g_idx, deq


def _pack_rows(x: torch.Tensor, order=range(8)) -> torch.Tensor:
    """[r, c] of 0..15 → int32 [r, c/8]: word j holds x[:, 8j + order[k]] in bits 4k..4k+3."""
    x = x.long().view(x.shape[0], -1, 8)
    word = torch.zeros(x.shape[:2], dtype=torch.long)
    for k, col in enumerate(order):
        word |= x[..., col] << (4 * k)
    return (word - ((word >> 31) << 32)).to(torch.int32)  # two's complement for the top bit


def pack_awq(q, zeros, scales) -> dict[str, torch.Tensor]:
    """AutoAWQ GEMM tensors of one projection from [out, in] integers."""
    return {"qweight": _pack_rows(q.T, AWQ_ORDER), "qzeros": _pack_rows(zeros.T, AWQ_ORDER),
            "scales": scales.T.contiguous()}


def pack_gptq(q, zeros, scales, g_idx) -> dict[str, torch.Tensor]:
    """GPTQ v1 tensors of one projection: qweight packs 8 inputs per word, qzeros holds zero - 1."""
    return {"qweight": _pack_rows(q).T.contiguous(), "qzeros": _pack_rows((zeros - 1).T),
            "scales": scales.T.contiguous(), "g_idx": g_idx.to(torch.int32)}


def write_int4(model, out: Path, method: str, group: int = 128, act_order: bool = False, seed: int = 0):
    """Save ``model`` as an AWQ (GEMM) or GPTQ (v1) 4-bit checkpoint; puts the dequantized weights
    into ``model`` (which becomes the reference) and returns it."""
    from safetensors.torch import save_file

    gen = torch.Generator().manual_seed(seed)
    state = {}
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.split(".")[-1] not in PROJECTIONS:
                continue
            w = module.weight
            order = torch.randperm(w.shape[1], generator=gen) if act_order else None
            q, zeros, scales, g_idx, deq = quantize_int4(w, group, order, sym=method == "gptq")
            packed = pack_awq(q, zeros, scales) if method == "awq" else pack_gptq(q, zeros, scales, g_idx)
            state.update({f"{name}.{k}": v for k, v in packed.items()})
            if module.bias is not None:
                state[f"{name}.bias"] = module.bias.detach().clone()
            w.copy_(deq)
        for name, tensor in model.state_dict().items():
            if name.split(".")[-2] not in PROJECTIONS:
                state[name] = tensor.detach().clone().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    model.config.save_pretrained(str(out))
    config = json.loads((out / "config.json").read_text())
    if method == "awq":
        config["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                         "version": "gemm"}
    else:
        config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "sym": True,
                                         "desc_act": act_order, "checkpoint_format": "gptq"}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_file(state, str(out / "model.safetensors"))
    return model
