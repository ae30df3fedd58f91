"""The router service's handler and release bookkeeping, and the router collector and config (no servers)."""

from __future__ import annotations

import time

import pytest

from router.__main__ import RouterServiceConfig, parse_args, service_config
from router.base import RoundRobinRouter
from router.cost import KvRouterConfig
from router.kv_router import KvRouter
from router.metrics import KvRouterCollector
from router.remote import RouterService
from runtime import InvalidRequest
from runtime.kv_hash import block_hashes
from runtime.messages import InstanceRecord, KvEvent, RouteRelease, RouteRequest
from runtime.request_plane import RequestContext
from tests.support.metrics import assert_exposed, exposition

pytestmark = pytest.mark.unit

RECORDS = [InstanceRecord(w, "ns", "target", "generate", f"s.{w}", model="m") for w in ("a", "b")]
CTX = RequestContext("rid-1", "router-1")


async def one(agen):
    return [item async for item in agen]


async def test_select_answers_with_a_ticket_and_release_frees_it():
    router = RoundRobinRouter(lambda model: RECORDS)
    service = RouterService(router, "router-1")
    [resp] = await one(service.select(RouteRequest("m", [1, 2, 3]), CTX))
    assert resp.instance_id == "a" and resp.router_id == "router-1" and resp.ticket > 0
    assert router.in_flight == {"a": 1} and service.outstanding == 1
    service.on_release(RouteRelease("another-router", [resp.ticket]))
    assert service.outstanding == 1
    service.on_release(RouteRelease("router-1", [resp.ticket, resp.ticket, 999]))
    assert router.in_flight == {} and service.outstanding == 0


async def test_select_without_a_model_or_with_bad_tokens_is_invalid():
    service = RouterService(RoundRobinRouter(lambda model: RECORDS), "r")
    with pytest.raises(InvalidRequest) as err:
        await one(service.select(RouteRequest(""), CTX))
    assert err.value.field == "model"
    for bad in ([1, -1], [2**32]):
        with pytest.raises(InvalidRequest) as err:
            await one(service.select(RouteRequest("m", bad), CTX))
        assert err.value.field == "token_ids"


async def test_unreleased_selections_expire():
    router = RoundRobinRouter(lambda model: RECORDS)
    service = RouterService(router, "r", ttl=5.0)
    await one(service.select(RouteRequest("m", [1]), CTX))
    assert service.expire() == 0
    assert service.expire(now=time.monotonic() + 6.0) == 1 and router.in_flight == {}
    with pytest.raises(ValueError):
        RouterService(router, "r", ttl=0)


async def test_router_collector_exports_decisions_blocks_and_events():
    router = KvRouter(lambda model: RECORDS, KvRouterConfig(seed=1))
    router.on_kv_event(KvEvent("a", 1, "stored", block_hashes(list(range(64)), 16)))
    router.on_kv_event(KvEvent("a", 1, "stored", []))  # duplicate
    await router.select("m", list(range(64)))
    assert_exposed(exposition(KvRouterCollector(router)), "tandem_router_decisions_total 1.0",
                   'tandem_router_kv_blocks{worker="a"} 4.0', 'tandem_router_in_flight{worker="a"} 1.0',
                   'tandem_router_kv_events_total{outcome="duplicates"} 1.0')


def test_service_config_from_flags():
    cfg = service_config(parse_args(["--mode", "kv", "--overlap-weight", "3", "--temperature", "0.5", "--no-dump"]))
    assert cfg.kv.overlap_weight == 3.0 and cfg.kv.temperature == 0.5 and not cfg.kv.request_dump
    assert cfg.router_options()["overlap_weight"] == 3.0
    assert service_config(parse_args(["--mode", "random", "--seed", "4"])).router_options() == {"seed": 4}
    with pytest.raises(ValueError):
        service_config(parse_args(["--temperature", "-1"]))
    with pytest.raises(ValueError):
        RouterServiceConfig(mode="fastest")
    with pytest.raises(ValueError):
        RouterServiceConfig(stats_window=0)
