"""runtime/health.py on its own: routes, status codes, metrics, a taken port."""

import httpx
import pytest
from prometheus_client import CollectorRegistry, Counter

from runtime.errors import StartupError
from runtime.health import HealthServer

pytestmark = pytest.mark.unit


async def test_routes_and_status_codes():
    registry = CollectorRegistry()
    Counter("probe_hits", "hits", registry=registry).inc(3)
    ready = {"ok": False}
    server = HealthServer("127.0.0.1", 0, lambda: ready["ok"], registry, extra={"/v1/info": lambda: {"a": 1}})
    server.add_route("/boom", lambda: 1 / 0)
    await server.start()
    try:
        assert server.port != 0
        async with httpx.AsyncClient(base_url=f"http://{server.address}") as http:
            assert (await http.get("/live")).text == "live\n"
            assert (await http.get("/health")).status_code == 503
            ready["ok"] = True
            health = await http.get("/health")
            assert health.status_code == 200 and health.json() == {"status": "ready"}
            metrics = await http.get("/metrics")
            assert metrics.status_code == 200 and "probe_hits_total 3.0" in metrics.text
            assert (await http.get("/v1/info?x=1")).json() == {"a": 1}
            head = await http.head("/live")
            assert head.status_code == 200 and head.content == b""
            assert (await http.get("/nope")).status_code == 404
            assert (await http.post("/health")).status_code == 405
            assert (await http.get("/boom")).status_code == 500
    finally:
        await server.stop()


async def test_a_taken_port_is_a_startup_error():
    first = HealthServer("127.0.0.1", 0, lambda: True)
    await first.start()
    try:
        with pytest.raises(StartupError, match=f"127.0.0.1:{first.port}"):
            await HealthServer("127.0.0.1", first.port, lambda: True).start()
    finally:
        await first.stop()
