"""Medusa heads and an MLP speculator served by real draft worker processes (``--method medusa`` /
``mlp_speculator``) to a real target over etcd, NATS and gRPC: the target sends its last hidden
state, and greedy output equals the target alone, one request at a time and 8 concurrent."""

from __future__ import annotations

import asyncio

import pytest
import torch

from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from runtime.request_plane import collect
from tests.e2e.test_spec_decode import PROMPTS, start_target, target_dir, tokens  # noqa: F401 (fixture)
from workers.draft.eagle import load_target_parts
from workers.draft.spec_heads import save_spec_head
from workers.draft.train.spec_heads import build_medusa, build_mlp
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.e2e

BATCH = PROMPTS + [p[::-1] for p in PROMPTS[:2]]  # 8 prompts


def write_head(kind: str, target_dir, out) -> None:
    """A head as train-draft starts it (from the target's LM head / embedding), perturbed."""
    embed, lm_head, cfg = load_target_parts(target_dir)
    gen = torch.Generator().manual_seed(5)
    if kind == "medusa":
        head = build_medusa(cfg.hidden_size, cfg.vocab_size, 3, 1, lm_head.weight.detach(), torch.arange(200))
    else:
        head = build_mlp(cfg.hidden_size, cfg.hidden_size, cfg.vocab_size, 3, embed.weight.detach(), seed=5)
    for p in head.parameters():
        p.data.add_(torch.randn(p.shape, generator=gen) * 0.02)
    save_spec_head(head, out, dtype=torch.float32)


@pytest.mark.parametrize("method", ["medusa", "mlp_speculator"])
async def test_greedy_speculation_with_a_head_worker_matches_the_target_alone(rt, spawn, target_dir, tmp_path,  # noqa: F811
                                                                               method):
    write_head("medusa" if method == "medusa" else "mlp", target_dir, tmp_path / "head")
    greedy = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    engine = Engine(load_model(target_dir), EngineConfig(block_size=8, num_blocks=512, max_num_seqs=16))
    want = engine.generate({str(i): p for i, p in enumerate(BATCH)}, greedy)
    _, client, inst = await start_target(rt, spawn, target_dir)
    spawn("workers.draft", "--method", method, "--head-model", str(tmp_path / "head"), "--target-model",
          str(target_dir), "--lease-ttl", "3", name="draft")
    drafts = await rt.client("draft", "speculate")
    await drafts.wait_for_instances(1, timeout=90)
    models = await rt.models()
    await models.wait_for(lambda c: any(m.role == "draft" and m.spec_method == method for m in c.values()), 10)

    async def one(p: list[int]):
        return await collect(await client.call(inst.instance_id, GenerateRequest(p, greedy), TokenDelta))

    first = [await one(p) for p in BATCH]  # batch 1
    assert [tokens(r) for r in first] == [want[str(i)] for i in range(len(BATCH))]
    second = await asyncio.gather(*(one(p) for p in BATCH))  # 8 concurrent
    assert [tokens(r) for r in second] == [want[str(i)] for i in range(len(BATCH))]
    specs = [r[-1].usage.spec for r in first + list(second) if r[-1].usage.spec is not None]
    assert sum(s.num_draft_tokens for s in specs) > 0  # the worker drafted from the hidden states it was sent


async def test_a_head_of_the_wrong_kind_is_a_one_line_start_up_error(spawn, target_dir, tmp_path):  # noqa: F811
    import subprocess
    import sys

    write_head("mlp", target_dir, tmp_path / "head")
    out = subprocess.run([sys.executable, "-m", "workers.draft", "--method", "medusa", "--head-model",
                          str(tmp_path / "head"), "--target-model", str(target_dir)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode != 0 and "holds a mlp_speculator head" in out.stderr
    assert "Traceback" not in out.stderr
