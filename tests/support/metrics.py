"""Reading Prometheus metrics in tests: one sample's value from an exposition text, so a test can
wait on what a service publishes instead of on its private state."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families


def sample_value(text: str, name: str, **labels: str) -> float | None:
    """The value of the first sample called ``name`` whose labels include ``labels``, in the Prometheus
    exposition ``text``; None when there is none."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                return sample.value
    return None


def exposition(*collectors) -> str:
    """The Prometheus exposition text of ``collectors`` registered alone in a fresh registry."""
    registry = CollectorRegistry()
    for collector in collectors:
        registry.register(collector)
    return generate_latest(registry).decode()


def assert_exposed(text: str, *lines: str) -> None:
    """Every one of ``lines`` stands in the exposition ``text``; the failure lists those that do not."""
    missing = [line for line in lines if line not in text]
    assert not missing, f"not exposed: {missing}\n{text}"
