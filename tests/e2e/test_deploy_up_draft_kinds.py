"""``tandem up --draft-kinds ngram:1,suffix:1`` starts draft workers of two kinds side by side: both
register in etcd with their own method, the stack serves, and the planner's launcher connector grows the
pool by the kind below its share (the first named among equals) and shrinks it keeping each kind's last
draft. The target is a random one-layer Llama with the demo tokenizer (real workers, small and quick)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

import httpx
import pytest

from planner.connectors.launcher import LauncherConnector
from tests.support.http import wait_for_model
from tests.support.servers import free_port
from tests.support.tiny_models import tiny_model_with_demo_tokenizer

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return tiny_model_with_demo_tokenizer(tmp_path_factory.mktemp("tiny-llama"), max_positions=2048)


async def draft_methods(models, want: int, timeout: float = 60.0) -> Counter:
    """The methods of the draft cards in etcd, once there are ``want`` of them."""
    deadline = time.monotonic() + timeout
    while True:
        methods = Counter(card.spec_method for card in models.values() if card.role == "draft")
        if sum(methods.values()) == want:
            return methods
        assert time.monotonic() < deadline, f"{want} drafts never registered: {methods}"
        await asyncio.sleep(0.2)


async def test_two_draft_kinds_register_and_the_pool_grows_and_shrinks_by_kind(rt, spawn, tiny_model):
    port = free_port()
    up = spawn("deploy.cli", "up", "--model", str(tiny_model), "--served-model-name", "tiny", "--draft-kinds",
               "ngram:1,suffix:1", "--kv-cache-gb", "0.0625", "--http-port", str(port), "--drain-timeout", "5",
               "--allow-scaling", name="tandem-up")
    models = await rt.models()
    await wait_for_model(f"http://127.0.0.1:{port}", "tiny", timeout=120)
    up.wait_for_log("Tandem is ready", timeout=60)
    assert await draft_methods(models, 2) == Counter({"ngram": 1, "suffix": 1})
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=60) as http:
        resp = await http.post("/v1/completions", json={"model": "tiny", "prompt": "a b a b a b", "max_tokens": 8,
                                                        "temperature": 0})
        assert resp.status_code == 200, resp.text

    scaler = await LauncherConnector.connect(rt)
    await scaler.scale("draft", 3, [], "test")  # 1:1 -> the first kind named
    assert await draft_methods(models, 3) == Counter({"ngram": 2, "suffix": 1})
    assert (await scaler.replicas())["draft"] == 3
    # the newest first, but the suffix kind's last draft only after the second ngram draft: draft-2, draft-1
    await scaler.scale("draft", 1, [], "test")
    assert await draft_methods(models, 1, timeout=30) == Counter({"ngram": 1})
