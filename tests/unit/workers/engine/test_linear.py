"""The engine's Linear: oneDNN over packed weights on CPU float32 inference, F.linear otherwise."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from runtime.config import importable_env
from workers.engine import layers
from workers.engine.layers import Linear

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[4]

needs_onednn = pytest.mark.skipif(not layers._ONEDNN, reason="this torch build has no oneDNN linear")


@needs_onednn
@pytest.mark.parametrize("rows", [0, 1, 2, 5, 16, 33])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear_for_any_row_count(rows, bias):
    torch.manual_seed(rows)
    layer = Linear(576, 1024, bias=bias)  # 589,824 weights: above the oneDNN threshold
    x = torch.randn(rows, 576)
    with torch.inference_mode():
        got = layer(x)
    assert layer._packed is not None or rows == 0
    torch.testing.assert_close(got, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)


@needs_onednn
def test_repacks_when_the_weight_changes_and_serves_autograd_unpacked():
    layer = Linear(512, 1024)
    x = torch.randn(3, 512)
    with torch.no_grad():
        first = layer(x)
        packed = layer._packed[0]
        layer.weight.copy_(torch.randn(1024, 512))  # e.g. weights loaded after a first forward
        second = layer(x)
        assert layer._packed[0] is not packed
        torch.testing.assert_close(second, F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
        assert not torch.allclose(first, second)
        layer.weight = torch.nn.Parameter(torch.randn(1024, 512))  # a new tensor (e.g. tied embeddings)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    out = layer(x)  # grad mode: the plain path, so gradients flow
    out.sum().backward()
    assert layer.weight.grad is not None


def test_small_weights_and_other_dtypes_use_the_default_path():
    small = Linear(64, 64)
    with torch.inference_mode():
        small(torch.randn(2, 64))
    assert small._packed is None
    wide = Linear(576, 1024).to(torch.bfloat16)
    with torch.inference_mode():
        out = wide(torch.randn(2, 576, dtype=torch.bfloat16))
    assert wide._packed is None and out.dtype == torch.bfloat16


def test_tandem_cpu_linear_torch_turns_it_off():
    code = "from workers.engine import layers; print(layers._ONEDNN)"
    # importable from any working directory, the project installed or not
    env_off = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, cwd=ROOT,
                             env=importable_env({**os.environ, "TANDEM_CPU_LINEAR": "torch"})).stdout.strip()
    assert env_off == "False"


@needs_onednn
def test_a_layer_built_under_inference_mode_packs_too():
    with torch.inference_mode():  # its parameters are inference tensors, without a version counter
        layer = Linear(576, 1024)
        x = torch.randn(4, 576)
        torch.testing.assert_close(layer(x), F.linear(x, layer.weight, layer.bias), rtol=1e-5, atol=1e-4)
    assert layer._packed is not None and layers._ONEDNN


@needs_onednn
def test_released_layer_keeps_serving_from_the_packed_copy_alone():
    layer = Linear(576, 1024)
    x = torch.randn(3, 576)
    want = F.linear(x, layer.weight, layer.bias).detach()
    assert layer.release_dense() and layer.weight.numel() == 0
    with torch.inference_mode():
        torch.testing.assert_close(layer(x), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(layer(x).detach(), want, rtol=1e-5, atol=1e-4)  # grad mode too
    assert not Linear(64, 64).release_dense()  # too small to pack: keeps its dense weight


@needs_onednn
@pytest.mark.parametrize("tied", [False, True])
def test_a_cpu_model_runner_holds_the_linear_weights_once(tmp_path, tied):
    from workers.engine.model_runner import ModelRunner
    from workers.engine.weights import load_model

    from tests.support.tiny_models import tiny_hf_model

    tiny_hf_model("llama", tmp_path, tied=tied, vocab=4096)  # hidden 64: only the LM head is big enough
    model = load_model(tmp_path)
    ModelRunner(model, num_blocks=8, block_size=16)
    assert model.lm_head._released != tied  # a tied head shares the embedding's weight: kept dense
    assert model.model.embed_tokens.weight.numel() == 4096 * 64
    assert not any(m._released for m in model.modules() if isinstance(m, Linear) and m is not model.lm_head)
