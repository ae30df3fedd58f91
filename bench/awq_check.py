"""Our AWQ loader against a checkpoint AutoAWQ itself writes (not our writer), on this CPU.

Usage (AutoAWQ is not a project dependency: deprecated, and it pulls datasets and pyarrow; install
it beside the venv, not into it):
    .venv/bin/python -m pip install --target /some/dir --no-deps autoawq==0.2.9 datasets dill multiprocess \\
        pandas pyarrow xxhash zstandard
    PYTHONPATH=/some/dir .venv/bin/python bench/awq_check.py [--out DIR]

A seeded random Llama (hidden 128, 2 layers, the demo's 49152-token vocabulary and tokenizer, for
the calibration text) is quantized by ``AutoAWQForCausalLM.quantize`` (GEMM, zero point, group 128;
calibration: 16 × 64 tokens of bench/prompts/natural_chat.jsonl) and saved by ``save_quantized``.
AutoAWQ's own CPU loading needs intel_extension_for_pytorch, so the reference is transformers'
Llama with every projection dequantized by AutoAWQ's ``dequantize_gemm`` (its packing code's
inverse, float16) and the checkpoint's other tensors (AWQ rescales the norms). Printed: the largest
difference of our dequantized projections rounded to float16 against AutoAWQ's (0 means the same
weights), and of the logits over a 10-token prompt; then the same model with every projection on
the INT4 Triton dequant-GEMM (Triton's interpreter without CUDA) against our dequantizing path.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="", help="where to keep the checkpoint (default: a temporary folder)")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before the Triton kernels are imported
    import transformers as tf
    from awq import AutoAWQForCausalLM
    from awq.utils.packing_utils import dequantize_gemm
    from safetensors.torch import load_file

    from tests.unit.workers.engine.test_quant import PROMPT, _logits_ours
    from workers.demo_model import demo_model_dir
    from workers.engine.quant import use_kernel
    from workers.engine.weights import load_model

    torch.set_num_threads(1)
    out = Path(args.out or tempfile.mkdtemp(prefix="awq-check-"))
    tok = tf.AutoTokenizer.from_pretrained(str(demo_model_dir()))
    torch.manual_seed(0)
    cfg = tf.LlamaConfig(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=49152, max_position_embeddings=256,
                         initializer_range=0.05, tie_word_embeddings=False)
    tf.LlamaForCausalLM(cfg).eval().save_pretrained(str(out / "base"))
    tok.save_pretrained(str(out / "base"))
    awq = AutoAWQForCausalLM.from_pretrained(str(out / "base"), dtype=torch.float32, device_map="cpu")
    texts = [line.strip() for line in (ROOT / "bench/prompts/natural_chat.jsonl").open()][:64]
    awq.quantize(tok, quant_config={"zero_point": True, "q_group_size": 128, "w_bit": 4, "version": "GEMM"},
                 calib_data=texts, max_calib_samples=16, max_calib_seq_len=64, n_parallel_calib_samples=4)
    awq.save_quantized(str(out / "awq"))
    path = out / "awq"

    config = json.loads((path / "config.json").read_text())
    print("quantization_config:", config.pop("quantization_config"))
    config.pop("architectures", None)
    state = load_file(glob.glob(str(path / "*.safetensors"))[0])
    dense = {}
    for name, t in state.items():
        if name.endswith(".qweight"):
            p = name[: -len(".qweight")]
            w = dequantize_gemm(t, state[p + ".qzeros"], state[p + ".scales"], 4, 128)
            dense[p + ".weight"] = w.T.float().contiguous()
        elif not name.endswith((".qzeros", ".scales")):
            dense[name] = t.float()
    ref = tf.LlamaForCausalLM(tf.LlamaConfig(**config)).eval()
    ref.load_state_dict(dense, strict=True)

    ours = load_model(path)
    worst = 0.0
    for i, layer in enumerate(ours.model.layers):
        for module, parts in ((layer.self_attn.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                              (layer.self_attn.o_proj, ("self_attn.o_proj",)),
                              (layer.mlp.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
                              (layer.mlp.down_proj, ("mlp.down_proj",))):
            theirs = torch.cat([dense[f"model.layers.{i}.{p}.weight"] for p in parts])
            worst = max(worst, (module.quant.dense(torch.float32).half().float() - theirs).abs().max().item())
    with torch.inference_mode():
        want = ref(torch.tensor([PROMPT])).logits[0].float()
    got = _logits_ours(ours)
    print(f"projections: ours (float32, rounded to float16) vs AutoAWQ dequantize_gemm (float16): max |Δ| {worst}")
    print(f"logits (ours float32 vs AutoAWQ's float16 dequantized weights): max |Δ| "
          f"{(got - want).abs().max().item():.2e} of max |logit| {want.abs().max().item():.2f}; "
          f"argmax equal at every position: {bool((got.argmax(-1) == want.argmax(-1)).all())}")
    print(f"Triton INT4 kernel on every projection ({use_kernel(ours, 'triton')}) vs our dequantizing path: "
          f"max |Δ logits| {(_logits_ours(ours) - got).abs().max().item():.2e}")
    print(f"checkpoint: {path}")


if __name__ == "__main__":
    main()
