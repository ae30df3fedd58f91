"""``tandem ray up`` calls a stack ready as ``tandem up`` does: the frontend's ``/health`` must list a
served model, not merely answer 200 (a frontend takes traffic, and is 200, before any target
registers). The Ray actor's check runs here on real processes, without a Ray cluster."""

from __future__ import annotations

import time

import pytest

from deploy.ray_launcher import ComponentActor
from tests.support.servers import free_port

pytestmark = pytest.mark.e2e


def test_the_frontend_actor_is_ready_only_once_a_model_is_listed(spawn):
    port, health = free_port(), free_port()
    spawn("frontend", "--http-port", str(port), "--lease-ttl", "3", name="frontend").wait_for_log("frontend ready", 60)
    actor = ComponentActor("frontend")
    assert not actor.ready(port, "frontend")  # /health is 200 here, with no model yet
    spawn("workers.mock", "--health-port", str(health), "--lease-ttl", "3", name="mock")
    deadline = time.monotonic() + 60
    while not actor.ready(port, "frontend"):
        assert time.monotonic() < deadline, "the frontend never listed the mock model"
        time.sleep(0.2)
    while not ComponentActor("mock").ready(health, "target"):  # any other component: its /health is 200
        assert time.monotonic() < deadline, "the mock worker's /health never answered 200"
        time.sleep(0.2)
