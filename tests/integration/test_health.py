"""Every long-running process can serve /live, /health and /metrics."""

from __future__ import annotations

import dataclasses

import httpx
import pytest

from runtime import Runtime

pytestmark = pytest.mark.integration


async def _ping(request, ctx):
    yield b"pong"


async def test_health_port_reports_readiness_and_metrics(runtime_config):
    cfg = dataclasses.replace(runtime_config, health_port=0)
    async with Runtime.connect(cfg) as rt:
        base = f"http://{rt.health.address}"
        rt.health.add_route("/v1/info", lambda: {"instance": rt.instance_id})
        async with httpx.AsyncClient() as http:
            assert (await http.get(f"{base}/live")).status_code == 200
            # Not ready until it serves something.
            assert (await http.get(f"{base}/health")).status_code == 503
            record = await rt.serve("probe", "ping", _ping)
            assert record.http_address == rt.health.address
            health = await http.get(f"{base}/health")
            assert health.status_code == 200 and health.json()["status"] == "ready"
            metrics = await http.get(f"{base}/metrics")
            assert metrics.status_code == 200 and "python_info" in metrics.text
            assert (await http.get(f"{base}/v1/info")).json() == {"instance": rt.instance_id}
            assert (await http.get(f"{base}/nope")).status_code == 404
            assert (await http.post(f"{base}/health")).status_code == 405
            rt.shutdown()
            assert (await http.get(f"{base}/health")).status_code == 503
