"""The planner's ``launcher`` connector against ``tandem ray up`` (Ray actors), on a local Ray cluster
inside a network namespace (as in ``test_ray_up``).

``tandem ray up --mock --planner`` serves ``launcher.scale``; its planner runs as an actor with
``--connector none`` (it reports, it does not act), so that only this test resizes the stack. From a
process inside the namespace, the planner's own :class:`LauncherConnector` asks for 2 targets: a
second actor starts a mock worker that registers and serves streams. With 8 long streams running on
both, it asks for 1 target again, naming the original worker (started with the stack, not by the
scaler) to go first: that worker leaves discovery while its streams still run, finishes them and
exits, and its actor process is killed. Every stream comes back whole."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_ray_up import ETCD_PORT, HTTP_PORT, NATS_PORT, RAY_PORT, cmdlines, netns  # noqa: F401
from tests.support.procs import pid_alive
from tests.support.wait import eventually_sync

pytestmark = pytest.mark.e2e

NAMESPACE = "planner-ray"
STREAMS, TOKENS = 8, 300  # 300 tokens at 20 ms: 6 s per stream


def parent_pid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


async def resize_through_the_launcher() -> dict:
    """Runs inside the namespace (``python -c``): 1 -> 2 targets, then 2 -> 1 under streams."""
    import httpx

    from planner.connectors.base import ScaleError
    from planner.connectors.launcher import LauncherConnector
    from runtime import Runtime
    from runtime.config import RuntimeConfig
    from runtime.events import TOPIC_LOAD
    from runtime.messages import LoadEvent
    from tests.e2e.test_planner_local import complete
    from tests.support.wait import eventually

    config = RuntimeConfig.from_env(etcd_url=f"http://127.0.0.1:{ETCD_PORT}", nats_url=f"nats://127.0.0.1:{NATS_PORT}",
                                    namespace=NAMESPACE, handle_signals=False)
    async with Runtime.connect(config) as rt:
        targets = await rt.client("target", "generate")
        [original] = await targets.wait_for_instances(1, timeout=30)
        connector = await LauncherConnector.connect(rt)
        replicas = await eventually(connector.replicas, timeout=30, interval=0.2, ignoring=(ScaleError,),
                                    what="the launcher's scale endpoint")
        assert replicas["target"] == 1

        await connector.scale("target", 2, [], "test: grow")
        await targets.wait_for_instances(2, timeout=60)
        [added] = [r for r in targets.instances() if r.instance_id != original.instance_id]

        running: dict[str, int] = {}
        await rt.subscribe(TOPIC_LOAD, LoadEvent, lambda e: running.__setitem__(e.worker_id, e.running))
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{HTTP_PORT}", timeout=60) as client:
            async def both_listed() -> bool:
                return (await client.get("/v1/models/mock")).json()["instances"] >= 2

            # the frontend sees the new worker too (round robin over both)
            await eventually(both_listed, timeout=20, interval=0.1, what="the frontend seeing the added target")
            streams = [asyncio.create_task(complete(client, 2 * i + 1, max_tokens=TOKENS)) for i in range(STREAMS)]
            await eventually(lambda: sum(running.values()) == STREAMS, timeout=20, interval=0.2,
                             what=lambda: f"{STREAMS} streams running (running: {running})")
            per_worker = {r.instance_id: running.get(r.instance_id, 0) for r in (original, added)}
            assert all(per_worker.values()), f"a target runs none of the streams: {per_worker}"
            original_actor = parent_pid(original.pid)  # the Ray worker process that hosts the actor

            await connector.scale("target", 1, [original], "test: remove the original target")
            await eventually(lambda: all(r.instance_id != original.instance_id for r in targets.instances()),
                             timeout=20, interval=0.2, what="the original target leaving discovery")
            left_while_streaming = not all(s.done() for s in streams)
            results = await asyncio.gather(*streams)
            after = await complete(client, 1, max_tokens=9)  # the added worker serves alone now
        replicas = (await connector.replicas())["target"]
        return {"per_worker": list(per_worker.values()), "left_while_streaming": left_while_streaming,
                "results": results, "after": after, "replicas": replicas,
                "discovered": [r.instance_id for r in targets.instances()], "added": added.instance_id,
                "original_pid": original.pid, "original_actor": original_actor, "added_pid": added.pid}


def test_ray_launcher_adds_a_target_and_drains_one_away(netns):  # noqa: F811 (fixture)
    netns.start_cluster()

    up = netns.start("tandem", sys.executable, "-m", "deploy.cli", "ray", "up", "--mock",
                     f"--address=127.0.0.1:{RAY_PORT}", f"--etcd=http://127.0.0.1:{ETCD_PORT}",
                     f"--nats=nats://127.0.0.1:{NATS_PORT}", f"--http-port={HTTP_PORT}", f"--namespace={NAMESPACE}",
                     "--router-mode=round_robin", "--mock-token-latency-ms=20", "--drain-timeout=30", "--planner",
                     "--planner-args=--connector none --itl-p90 1s")
    def ready() -> bool:
        assert up.poll() is None, f"tandem ray up exited with {up.returncode}:\n{netns.log('tandem')[-4000:]}"
        return "Tandem is ready on Ray" in netns.log("tandem")

    eventually_sync(ready, timeout=120, interval=0.5, what=lambda: f"Tandem ready on Ray:\n{netns.log('tandem')[-4000:]}")
    assert sum("-m planner" in c for c in cmdlines(netns.pids())) == 1

    code = ("import asyncio, json, logging\n"
            "from tests.e2e.test_planner_ray import resize_through_the_launcher\n"
            "logging.basicConfig(level=logging.INFO)\n"
            "print('RESULT', json.dumps(asyncio.run(resize_through_the_launcher())))\n")
    client = netns.start("client", sys.executable, "-c", code)
    try:
        client.wait(60)
    except subprocess.TimeoutExpired:
        pass
    logs = f"--- client ---\n{netns.log('client')[-4000:]}\n--- tandem ---\n{netns.log('tandem')[-6000:]}"
    assert client.returncode == 0, logs
    got = json.loads(netns.log("client").split("RESULT ", 1)[1])

    assert got["results"] == [None] * STREAMS, got["results"]  # every stream whole: 0 failed
    assert got["after"] is None, got["after"]
    assert min(got["per_worker"]) >= 2, got["per_worker"]  # round robin: both targets served streams
    assert got["left_while_streaming"], "the original target left discovery only after its streams ended"
    assert got["replicas"] == 1 and got["discovered"] == [got["added"]], got
    # The original worker drained and exited; then its actor was killed (its Ray worker process ends).
    eventually_sync(lambda: not (pid_alive(got["original_pid"]) or pid_alive(got["original_actor"])), timeout=30,
                    interval=0.2, what="the removed target and its actor exiting")
    assert pid_alive(got["added_pid"])
    running = cmdlines(netns.pids())
    assert sum("-m workers.mock" in c for c in running) == 1

    os.killpg(up.pid, signal.SIGINT)
    assert up.wait(60) == 0, netns.log("tandem")[-4000:]
    assert "all stopped" in netns.log("tandem")
    left = [c for c in cmdlines(netns.pids()) if "-m workers." in c or "-m frontend" in c or "-m planner" in c]
    assert not left, left
