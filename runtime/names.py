"""Names: etcd keys and NATS subjects, built in one place.

Endpoints are addressed ``namespace.component.endpoint``. etcd keys live under
``tandem/{ns}/instances/{component}/{endpoint}/{instance_id}`` and ``tandem/{ns}/models/{model}/{instance_id}``.
"""

from __future__ import annotations

import re
import uuid

_TOKEN = re.compile(r"^[A-Za-z0-9_-]+$")


def check_token(value: str, what: str) -> str:
    """NATS subject tokens and etcd key parts may not contain dots, slashes or spaces."""
    if not _TOKEN.match(value):
        raise ValueError(f"{what} must match [A-Za-z0-9_-]+, got {value!r}")
    return value


def new_instance_id() -> str:
    return uuid.uuid4().hex[:16]


def instances_prefix(namespace: str, component: str = "", endpoint: str = "") -> str:
    key = f"tandem/{namespace}/instances/"
    if component:
        key += f"{component}/"
        if endpoint:
            key += f"{endpoint}/"
    return key


def instance_key(namespace: str, component: str, endpoint: str, instance_id: str) -> str:
    return f"{instances_prefix(namespace, component, endpoint)}{instance_id}"


def models_prefix(namespace: str, model: str = "") -> str:
    key = f"tandem/{namespace}/models/"
    return f"{key}{model}/" if model else key


def model_key(namespace: str, model: str, instance_id: str) -> str:
    # Model names may contain '/' (e.g. org/name); keep them readable but unambiguous.
    return f"{models_prefix(namespace)}{model.replace('/', '%2F')}/{instance_id}"


def kv_agents_prefix(namespace: str) -> str:
    return f"tandem/{namespace}/kv_agents/"


def kv_agent_key(namespace: str, instance_id: str) -> str:
    return f"{kv_agents_prefix(namespace)}{instance_id}"


def kv_release_topic(instance_id: str) -> str:
    """The event topic a prefill worker hears :class:`runtime.messages.KvRelease` on."""
    return f"kv_release.{instance_id}"


def endpoint_subject(namespace: str, component: str, endpoint: str, instance_id: str) -> str:
    return f"{namespace}.{component}.{endpoint}.{instance_id}"


def control_subject(namespace: str, instance_id: str) -> str:
    return f"{namespace}._control.{instance_id}"


def event_subject(namespace: str, topic: str) -> str:
    return f"{namespace}.{topic}"
