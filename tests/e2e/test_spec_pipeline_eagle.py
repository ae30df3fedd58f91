"""An EAGLE-3 draft worker under either seam, with real processes over gRPC and the hidden-state
data plane: greedy output equals the target alone; under the pipelined seam the draft stages EAGLE
proposals from the hidden rows the target's commits and verdicts carry, and the target never waits
for them. (A random head on these cores is rarely right about the token the target commits while a
proposal is on its way, so few are verified here: that staged EAGLE proposals are verified and
accepted is shown in process, with the demo head, in tests/unit/workers/draft/test_eagle_staging.py.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from runtime.request_plane import collect
from tests.e2e.test_spec_pipeline import target_metrics
from tests.support.serving import tiny_target_with_eagle3
from tests.support.tiny_models import SPEC_VOCAB as VOCAB
from tests.support.flags import speculative
from workers.engine.engine import Engine, EngineConfig
from workers.engine.weights import load_model

pytestmark = pytest.mark.e2e

GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    target, head = tiny_target_with_eagle3(tmp_path_factory, "eagle-pipe")
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, VOCAB, (5 + 3 * i,), generator=gen).tolist() for i in range(6)]
    want = Engine(load_model(target), EngineConfig(block_size=8, num_blocks=512, max_num_seqs=16)).generate(
        {str(i): p for i, p in enumerate(prompts)}, GREEDY)
    return target, head, prompts, want


async def draft_proposals(draft) -> float:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://{draft.http_address}/metrics")).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples
               if s.name == "tandem_draft_proposals_total")


@pytest.mark.parametrize("seam", ["pipelined", "sync"])
async def test_eagle3_greedy_output_equals_the_target_alone_under_both_seams(rt, spawn, models, seam):
    target_dir, head_dir, prompts, want = models
    target = spawn("workers.target", "--model", str(target_dir), "--block-size", "8", "--num-blocks", "512",
                   "--max-model-len", "1024", "--threads", "1", "--num-speculative-tokens", "3",
                   *speculative(hidden_layers="1,2,3", adaptive=False, load_aware=False, propose_min_wait=0.5,
                                seam=seam), "--lease-ttl", "3", "--health-port", "0",
                   name="target")
    spawn("workers.draft", "--method", "eagle3", "--eagle-model", str(head_dir), "--target-model", str(target_dir),
          "--block-size", "8", "--num-blocks", "512", "--lease-ttl", "3", "--health-port", "0",
          *(["--speculative-config", '{"eagle_pipelined": true}'] if seam == "pipelined" else []), name="draft")
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=90)
    [draft] = await (await rt.client("draft", "speculate")).wait_for_instances(1, timeout=90)
    for _ in range(120):  # until the target's stream to the draft worker is up
        out = await collect(await client.call(inst.instance_id, GenerateRequest(prompts[0], GREEDY), TokenDelta))
        spec = out[-1].usage.spec
        if spec is not None and "no_draft" not in spec.plain_steps:
            break
        await asyncio.sleep(0.5)
    else:
        pytest.fail("the target never connected to the EAGLE-3 draft worker")
    before = await target_metrics(inst)

    drafts = 0
    for i, p in enumerate(prompts):  # one at a time, then all at once with a sampled request beside them
        deltas = await collect(await client.call(inst.instance_id, GenerateRequest(p, GREEDY), TokenDelta))
        assert [t for d in deltas for t in d.token_ids] == want[str(i)]
        drafts += deltas[-1].usage.spec.num_drafts
    sampled = SamplingParams(temperature=0.8, max_tokens=32, ignore_eos=True, seed=5)
    streams = [await client.call(inst.instance_id, GenerateRequest(p, GREEDY), TokenDelta) for p in prompts]
    streams.append(await client.call(inst.instance_id, GenerateRequest(prompts[1], sampled), TokenDelta))
    results = await asyncio.gather(*(collect(s) for s in streams))
    for i, deltas in enumerate(results[:-1]):
        assert [t for d in deltas for t in d.token_ids] == want[str(i)]
    assert sum(len(d.token_ids) for d in results[-1]) == 32  # a sampled request is served too

    after = await target_metrics(inst)
    waited = after["tandem_target_draft_wait_seconds_total"] - before["tandem_target_draft_wait_seconds_total"]
    logs = target.logs()
    if seam == "pipelined":
        assert "eagle3, pipelined seam" in logs
        assert await draft_proposals(draft) > 0  # staged EAGLE proposals were streamed
        assert after["tandem_target_draft_wait_seconds_total"] == 0.0  # the pipelined loop awaits nothing
    else:
        assert "eagle3, synchronous seam" in logs
        assert drafts > 0 and waited > 0.0
