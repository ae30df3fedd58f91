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

