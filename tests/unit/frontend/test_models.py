"""The model registry: a model that just lost its last card is 'unavailable' (503), not unknown (404)."""

from __future__ import annotations

import pytest

from frontend import models as models_module
from frontend.errors import to_http
from frontend.models import ModelRegistry, UnknownModel
from runtime import NoInstances
from runtime.messages import ModelCard

pytestmark = pytest.mark.unit


def card(name: str, instance: str) -> ModelCard:
    return ModelCard(name=name, role="target", tokenizer_path="/t", instance_id=instance)


def test_a_model_that_just_went_is_503_for_a_grace_period_then_404(monkeypatch):
    clock = [100.0]
    monkeypatch.setattr(models_module.time, "monotonic", lambda: clock[0])
    registry = ModelRegistry(preload=False)
    registry.update({"a": card("m", "w1")})
    assert registry.get("m").num_instances == 1
    registry.update({})  # etcd came back empty (data wiped) before the workers re-registered
    with pytest.raises(NoInstances) as err:
        registry.get("m")
    http = to_http(err.value, 2)
    assert http.status == 503 and http.headers["Retry-After"] == "2"
    with pytest.raises(UnknownModel):
        registry.get("never-served")
    registry.update({"b": card("m", "w1")})  # re-registered: served again
    assert registry.get("m").card.instance_id == "w1"
    registry.update({})
    clock[0] += models_module.GONE_GRACE_S + 1
    with pytest.raises(UnknownModel):
        registry.get("m")



def test_every_served_name_is_a_model_served_as_the_cards_name():
    registry = ModelRegistry(preload=False)
    two = ModelCard(name="a", role="target", tokenizer_path="/t", instance_id="w1", aliases=["b", "a"])
    registry.update({"k1": two, "k2": card("a", "w2")})
    assert [m.name for m in registry.list()] == ["a", "b"]
    assert registry.get("b").served_as == registry.get("a").served_as == "a"
    assert registry.get("a").num_instances == 2 and registry.get("b").num_instances == 1


def test_tool_call_parser_names_the_format_whatever_the_template():
    from frontend.config import FrontendConfig
    from frontend.structured import ToolCalls
    from frontend.tool_parsers import PARSERS

    plain = "{{ messages[0]['content'] }}"  # renders no tool calls: 'auto' alone would be a 400
    assert ToolCalls(auto=True).for_template(plain, "hermes").parser is PARSERS["hermes"]
    assert ToolCalls(auto=True).for_template("<tool_call>", "mistral").parser is PARSERS["mistral"]
    assert ToolCalls(auto=True).for_template("<tool_call>").parser is PARSERS["hermes"]
    with pytest.raises(ValueError, match="tool_call_parser must be one of hermes, mistral, llama3_json"):
        FrontendConfig(tool_call_parser="qwen25")


def test_lora_adapters_route_to_the_instances_that_hold_them():
    registry = ModelRegistry(preload=False)
    adapter = lambda instance: ModelCard(name="a1", role="target", tokenizer_path="/t", instance_id=instance,
                                         parent="m")
    registry.update({"1": card("m", "w1"), "2": card("m", "w2"), "3": card("m", "w3"), "4": adapter("w2")})
    assert registry.route(registry.get("m")) == ("m", "", frozenset())
    assert registry.route(registry.get("a1")) == ("m", "a1", frozenset({"w1", "w3"}))
    registry.update({"1": card("m", "w1"), "2": card("m", "w2"), "3": card("m", "w3")})  # unloaded: gone for good
    with pytest.raises(UnknownModel):
        registry.get("a1")
    registry.update({"4": adapter("w2")})  # its worker went (a crash): the adapter too, for a grace period
    registry.update({})
    with pytest.raises(NoInstances):
        registry.get("a1")
