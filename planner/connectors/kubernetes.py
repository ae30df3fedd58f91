"""The Kubernetes connector: each pool is a Deployment, sized through its ``scale`` subresource.

Reads ``GET  /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale`` (``spec.replicas``) and writes
``PATCH`` the same path with a JSON merge patch ``{"spec": {"replicas": n}}``, through the maintained
``kubernetes`` client (``pip install 'tandem[k8s]'``). Before a scale-down it marks the pods of the
workers it would rather lose (least loaded first) with a lower
``controller.kubernetes.io/pod-deletion-cost``, so the ReplicaSet controller deletes those; the pod
then gets SIGTERM and drains like any Tandem worker (its grace period must exceed the drain timeout).
A worker's pod is found by the ``host`` its instance record carries (a pod's hostname is its name).
The RBAC this needs is in ``k8s/components/planner/``.

The client is synchronous; every call runs in a thread.
"""

from __future__ import annotations

import asyncio
import json
import logging

from runtime.messages import InstanceRecord

from .base import ScaleError

log = logging.getLogger(__name__)

DELETION_COST = "controller.kubernetes.io/pod-deletion-cost"
MERGE_PATCH = "application/merge-patch+json"


def api_client(kubeconfig: str | None = None):
    """A ``kubernetes.client.ApiClient``: from ``kubeconfig`` when given, else the pod's service
    account (in a cluster), else ``~/.kube/config``."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise ScaleError("--connector kubernetes needs the kubernetes client: pip install 'tandem[k8s]'") from None
    if kubeconfig:
        return config.new_client_from_config(config_file=kubeconfig)
    try:
        configuration = client.Configuration()
        config.load_incluster_config(client_configuration=configuration)
        return client.ApiClient(configuration)
    except config.ConfigException:
        return config.new_client_from_config()


def _message(body) -> str:
    """The ``message`` of a Kubernetes ``Status`` error body, else the body itself (shortened)."""
    text = body.decode(errors="replace") if isinstance(body, bytes) else str(body or "")
    try:
        return str(json.loads(text).get("message", text))[:300]
    except (ValueError, AttributeError):
        return text.strip()[:300]


class KubernetesConnector:
    """Scales the Deployments named in ``deployments`` (pool -> Deployment) in ``namespace``."""

    name = "kubernetes"

    def __init__(self, api, namespace: str, deployments: dict[str, str], timeout: float = 10.0):
        from kubernetes import client

        if not deployments:
            raise ValueError("the kubernetes connector needs at least one --k8s-deployment POOL=NAME")
        self._api = api
        self._apps = client.AppsV1Api(api)
        self._core = client.CoreV1Api(api)
        self.namespace = namespace
        self.deployments = dict(deployments)
        self._timeout = timeout

    async def _call(self, what: str, fn, *args, **kwargs):
        from kubernetes.client.exceptions import ApiException

        try:
            return await asyncio.to_thread(fn, *args, _request_timeout=self._timeout, **kwargs)
        except ApiException as exc:
            raise ScaleError(f"{what}: the API server answered {exc.status} {exc.reason}: {_message(exc.body)}") from None
        except Exception as exc:  # connection refused, TLS, timeouts: urllib3's errors
            raise ScaleError(f"{what}: {exc!r}") from None

    async def replicas(self) -> dict[str, int]:
        out = {}
        for pool, name in self.deployments.items():
            scale = await self._call(f"reading deployments/{name}/scale", self._apps.read_namespaced_deployment_scale,
                                     name, self.namespace)
            out[pool] = int(scale.spec.replicas or 0)
        return out

    async def scale(self, pool: str, replicas: int, remove_first: list[InstanceRecord], reason: str) -> None:
        name = self.deployments.get(pool)
        if name is None:
            raise ScaleError(f"no Deployment is named for pool {pool!r} (--k8s-deployment {pool}=NAME)")
        if remove_first:
            await self._prefer_deleting([r.host for r in remove_first if r.host])
        await self._call(f"scaling deployments/{name} to {replicas}", self._apps.patch_namespaced_deployment_scale,
                         name, self.namespace, {"spec": {"replicas": replicas}}, _content_type=MERGE_PATCH)
        log.info("deployments/%s in %s scaled to %d (%s)", name, self.namespace, replicas, reason)

    async def _prefer_deleting(self, pods: list[str]) -> None:
        """Lower the deletion cost of ``pods`` (first = cheapest), so a scale-down takes them. A pod that
        cannot be marked (gone, not ours, no RBAC for pods) is logged and skipped: the scale still goes on."""
        for rank, pod in enumerate(pods[:8]):
            body = {"metadata": {"annotations": {DELETION_COST: str(-1000 + rank)}}}
            try:
                await self._call(f"marking pod {pod}", self._core.patch_namespaced_pod, pod, self.namespace, body,
                                 _content_type=MERGE_PATCH)
            except ScaleError as exc:
                log.warning("%s (the controller picks the pod to delete itself)", exc)

    async def close(self) -> None:
        await asyncio.to_thread(self._api.close)
