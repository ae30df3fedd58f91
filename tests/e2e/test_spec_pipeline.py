"""The pipelined draft seam with real processes: a target worker and an oracle draft worker over gRPC.

Greedy output equals the target alone under either seam; the pipelined target verifies staged
proposals and never waits for the draft (``tandem_target_draft_wait_seconds_total`` stays 0), the
synchronous one does."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from tests.support.flags import speculative
from prometheus_client.parser import text_string_to_metric_families

from runtime.messages import GenerateRequest, SamplingParams, TokenDelta
from runtime.request_plane import collect
from tests.e2e.test_spec_decode import PROMPTS, expected, target_dir, tokens, until_speculating  # noqa: F401

pytestmark = pytest.mark.e2e


async def target_metrics(inst) -> dict[str, float]:
    async with httpx.AsyncClient() as http:
        text = (await http.get(f"http://{inst.http_address}/metrics")).text
    return {s.name: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name.startswith("tandem_target_") and not s.labels.get("reason")}


@pytest.mark.parametrize("seam", ["pipelined", "sync"])
async def test_greedy_output_equals_the_target_alone_under_both_seams(rt, spawn, target_dir, tmp_path, seam):  # noqa: F811
    greedy = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    want = expected(target_dir, greedy)
    refs = tmp_path / "refs.json"
    refs.write_text(json.dumps([p + want[str(i)] for i, p in enumerate(PROMPTS)]))
    spawn("workers.target", "--model", str(target_dir), "--served-model-name", "tiny", "--block-size", "8",
          "--num-blocks", "512", "--max-model-len", "1024", "--threads", "1", "--num-speculative-tokens", "3",
          *speculative(adaptive=False, load_aware=False, propose_min_wait=0.5, seam=seam), "--lease-ttl", "3", "--health-port", "0", name="target")
    client = await rt.client("target", "generate")
    [inst] = await client.wait_for_instances(1, timeout=90)
    oracle = {"oracle_file": str(refs), "oracle_error_rate": 0.25, "oracle_vocab_size": 256}
    spawn("workers.draft", "--method", "oracle", "--speculative-config", json.dumps(oracle),
          "--lease-ttl", "3", "--health-port", "0", name="draft")
    await (await rt.client("draft", "speculate")).wait_for_instances(1, timeout=90)
    await until_speculating(client, inst)
    before = await target_metrics(inst)

    streams = [await client.call(inst.instance_id, GenerateRequest(p, greedy), TokenDelta) for p in PROMPTS]
    results = await asyncio.gather(*(collect(s) for s in streams))
    drafts = accepted = 0
    for i, deltas in enumerate(results):
        assert tokens(deltas) == want[str(i)]
        spec = deltas[-1].usage.spec
        drafts += spec.num_drafts
        accepted += spec.num_accepted_tokens
    assert drafts > 0 and accepted > 0  # staged proposals (or answers) were verified, and accepted

    after = await target_metrics(inst)
    waited = after["tandem_target_draft_wait_seconds_total"] - before["tandem_target_draft_wait_seconds_total"]
    if seam == "pipelined":
        assert waited == 0.0  # the pipelined loop awaits nothing
        assert after["tandem_target_draft_wait_seconds_total"] == 0.0
        # what an operator reads of a pipelined draft's pace and use: proposals streamed and kept, the
        # late ones among them, and sequence steps that looked for one and found one that fits
        grew = {k: after[f"tandem_target_draft_{k}_total"] - before[f"tandem_target_draft_{k}_total"]
                for k in ("proposals_streamed", "proposals_late", "staged_lookups", "staged_fits")}
        assert grew["proposals_streamed"] > 0 and 0 <= grew["proposals_late"] <= grew["proposals_streamed"]
        assert 0 < grew["staged_fits"] <= grew["staged_lookups"]
    else:
        assert waited > 0.0
