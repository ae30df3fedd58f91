"""The attention CUDA graphs of a draft head bake in: the engine's Triton kernel on the head's
unfused path (its own KV write first), over static metadata, drafts what the eager SDPA path
drafts. Without CUDA the kernel runs under Triton's interpreter (set before the kernel module is
imported, as in tests/unit/workers/engine/test_triton_attention.py); with CUDA tests/gpu covers it."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # set only without CUDA: it would turn every later kernel into the interpreter's

from tests.unit.workers.draft.test_placement import config, dirs  # noqa: E402,F401 (fixture)
from tests.unit.workers.engine.test_spec_engine import prompts  # noqa: E402
from workers.draft.__main__ import make_proposer  # noqa: E402
from workers.draft.eagle_proposer import EagleProposer  # noqa: E402
from workers.engine.model import Attention  # noqa: E402
from workers.speculation.payloads import DraftInput  # noqa: E402

pytestmark = [pytest.mark.unit,
              pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA: tests/gpu/test_draft_cuda.py runs it")]


def test_triton_attention_on_static_head_steps_drafts_what_sdpa_drafts(dirs):  # noqa: F811
    from workers.engine.triton_attention import paged_attention_triton

    eager = make_proposer(config(dirs, "eagle3", device="cpu"))
    head = make_proposer(config(dirs, "eagle3", device="cpu")).head
    for module in head.modules():
        if isinstance(module, Attention):
            module.attention_fn = paged_attention_triton
    static = EagleProposer(head, eager.caps.hidden_layers, 512, 4, cuda_graphs=True, graph_batch=4)
    gen = torch.Generator().manual_seed(3)
    batch = [DraftInput(f"s{i}", 0, prompt, 3, hidden_states=[torch.randn(len(prompt) - 1, 64, generator=gen)
                                                              for _ in range(3)])
             for i, prompt in enumerate(prompts(3, seed=31).values())]
    assert [o.token_ids for o in static.propose(batch)] == [o.token_ids for o in eager.propose(batch)]
    assert static.graphs.replays > 0
