"""The planner scrapes workers started the way the k8s manifests start them: ``--health-host=0.0.0.0``
(any interface, for the kubelet's probes and the ServiceMonitor). A worker bound to a wildcard registers
the address its hostname resolves to (a pod's IP), never ``0.0.0.0``, which names no pod from another one:
the planner, in its own pod, scraped nothing there and its draft:target rule never fired."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from planner.signals import Signals, fetch
from runtime.health import advertised_host
from tests.support.servers import free_port
from tests.support.kustomize import build
from tests.support.wait import eventually

pytestmark = pytest.mark.e2e

K8S = Path(__file__).resolve().parents[2] / "k8s"


def manifest_args(overlay: str, deployment: str) -> list[str]:
    """The first container's args of ``deployment`` in ``overlay``, the role word dropped, the ports
    this test's own, ``$(POD_IP)`` loopback."""
    [dep] = [o for o in build(K8S / overlay) if o["kind"] == "Deployment" and o["metadata"]["name"] == deployment]
    args = dep["spec"]["template"]["spec"]["containers"][0]["args"][1:]
    swap = {"--health-port": str(free_port()), "--grpc-port": "0"}
    out = []
    for arg in args:
        flag, _, value = arg.partition("=")
        out.append(f"{flag}={swap.get(flag, value.replace('$(POD_IP)', '127.0.0.1'))}" if value else arg)
    return out


async def test_the_planner_scrapes_workers_started_as_the_manifests_start_them(rt, spawn):
    draft_args = manifest_args("overlays/cpu-demo", "tandem-draft")
    assert "--health-host=0.0.0.0" in draft_args
    target_health = [a for a in manifest_args("overlays/cpu-demo", "tandem-target") if a.startswith("--health-")]
    assert "--health-host=0.0.0.0" in target_health
    spawn("workers.draft", *draft_args, name="draft")
    spawn("workers.mock", "--token-latency-ms", "0", *target_health, name="target")
    signals = Signals(rt, (), window=30)
    await signals.start()
    await eventually(lambda: signals.live()["draft"] and signals.live()["target"], timeout=60, interval=0.1,
                     what="both workers registered")
    here = advertised_host("0.0.0.0")
    for pool in ("draft", "target"):
        [record] = signals.live()[pool]
        host, _, port = record.http_address.rpartition(":")
        assert host == here and host != "0.0.0.0", (pool, record.http_address)
        assert "# TYPE" in await fetch(f"http://{record.http_address}/metrics")
    # Two observations a moment apart: the draft's proposal-time counter was scraped twice, so the
    # planner has its busy share (0: nothing asked it for proposals), with no scrape error.
    first = await signals.observe()
    await asyncio.sleep(0.2)
    second = await signals.observe()
    assert first.errors == [] and second.errors == []
    assert second.draft.busy == 0.0
