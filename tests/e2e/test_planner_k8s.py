"""The Kubernetes connector against a real HTTP server that speaks the API server's scale subresource.

No Kubernetes API server can be installed from the package registries this project uses (PyPI,
Debian, npm carry kubectl and the Python client, not kube-apiserver), so :class:`ScaleApi` is a small
HTTP server written here: it serves ``GET``/``PATCH /apis/apps/v1/namespaces/{ns}/deployments/{name}/scale``
and ``PATCH /api/v1/namespaces/{ns}/pods/{name}`` as the API server documents them (bearer-token
auth, ``autoscaling/v1`` Scale objects, JSON merge and JSON patches, ``Status`` errors), and records
every request. The client is the real ``kubernetes`` package, configured from a kubeconfig file as in
production; the last test runs the real ``python -m planner --connector kubernetes`` process.
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from planner.connectors.base import ScaleError
from planner.connectors.kubernetes import DELETION_COST, KubernetesConnector, api_client
from runtime.messages import InstanceRecord

pytestmark = pytest.mark.e2e

TOKEN = "planner-token"
SCALE = re.compile(r"^/apis/apps/v1/namespaces/([^/]+)/deployments/([^/]+)/scale$")
POD = re.compile(r"^/api/v1/namespaces/([^/]+)/pods/([^/]+)$")


class ScaleApi(ThreadingHTTPServer):
    """Deployments (namespace, name) -> replicas; pods -> annotations; every request in ``log``."""

    def __init__(self, deployments: dict[tuple[str, str], int], pods: set[tuple[str, str]] = frozenset()):
        super().__init__(("127.0.0.1", 0), Handler)
        self.deployments = dict(deployments)
        self.pods = {p: {} for p in pods}
        self.log: list[tuple[str, str, str, object]] = []  # method, path, content type, body
        self.forbid_patch = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self):
        threading.Thread(target=self.serve_forever, daemon=True).start()
        return self

    def __exit__(self, *exc):
        self.shutdown()
        self.server_close()


def scale_object(ns: str, name: str, replicas: int) -> dict:
    return {"kind": "Scale", "apiVersion": "autoscaling/v1",
            "metadata": {"name": name, "namespace": ns, "resourceVersion": "1"},
            "spec": {"replicas": replicas}, "status": {"replicas": replicas, "selector": f"app={name}"}}


class Handler(BaseHTTPRequestHandler):
    server: ScaleApi

    def log_message(self, *args):  # quiet
        pass

    def _send(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _status(self, code: int, reason: str, message: str) -> None:
        self._send(code, {"kind": "Status", "apiVersion": "v1", "status": "Failure", "message": message,
                          "reason": reason, "code": code})

    def _authorized(self) -> bool:
        if self.headers.get("Authorization") != f"Bearer {TOKEN}":
            self._status(401, "Unauthorized", "Unauthorized")
            return False
        return True

    def do_GET(self):  # noqa: N802
        self.server.log.append(("GET", self.path, "", None))
        if not self._authorized():
            return
        m = SCALE.match(self.path.split("?")[0])
        if not m or m.groups() not in self.server.deployments:
            return self._status(404, "NotFound", f'deployments.apps "{m.group(2) if m else "?"}" not found')
        self._send(200, scale_object(*m.groups(), self.server.deployments[m.groups()]))

    def do_PATCH(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"null")
        ctype = self.headers.get("Content-Type", "")
        path = self.path.split("?")[0]
        self.server.log.append(("PATCH", path, ctype, body))
        if not self._authorized():
            return
        if self.server.forbid_patch:
            return self._status(403, "Forbidden", "deployments.apps/scale is forbidden: User cannot patch")
        if ctype == "application/json-patch+json":
            if not isinstance(body, list):
                return self._status(400, "BadRequest", "json: cannot unmarshal object into Go value of type jsonpatch.Patch")
            merged = {}
            for op in body:
                if op.get("op") == "replace" and op.get("path") == "/spec/replicas":
                    merged = {"spec": {"replicas": op["value"]}}
            body = merged
        elif ctype not in ("application/merge-patch+json", "application/strategic-merge-patch+json"):
            return self._status(415, "UnsupportedMediaType", f"the body of the request was in an unknown format: {ctype}")
        if m := SCALE.match(path):
            if m.groups() not in self.server.deployments:
                return self._status(404, "NotFound", f'deployments.apps "{m.group(2)}" not found')
            replicas = body.get("spec", {}).get("replicas")
            if not isinstance(replicas, int) or replicas < 0:
                return self._status(422, "Invalid", f"spec.replicas: Invalid value: {replicas!r}")
            self.server.deployments[m.groups()] = replicas
            return self._send(200, scale_object(*m.groups(), replicas))
        if (m := POD.match(path)) and m.groups() in self.server.pods:
            self.server.pods[m.groups()].update(body.get("metadata", {}).get("annotations", {}))
            return self._send(200, {"kind": "Pod", "apiVersion": "v1", "metadata": {"name": m.group(2)}})
        return self._status(404, "NotFound", f"{path} not found")


def kubeconfig(tmp_path, url: str, token: str = TOKEN) -> str:
    path = tmp_path / "kubeconfig"
    path.write_text(json.dumps({  # JSON is YAML
        "apiVersion": "v1", "kind": "Config", "current-context": "test",
        "clusters": [{"name": "test", "cluster": {"server": url}}],
        "users": [{"name": "planner", "user": {"token": token}}],
        "contexts": [{"name": "test", "context": {"cluster": "test", "user": "planner", "namespace": "tandem"}}]}))
    return str(path)


def record(host: str, pid: int = 1) -> InstanceRecord:
    return InstanceRecord("i-" + host, "tandem", "target", "generate", "s", host=host, pid=pid)


async def test_reads_and_scales_deployments_through_the_scale_subresource(tmp_path):
    with ScaleApi({("tandem", "tandem-target"): 2, ("tandem", "tandem-draft"): 1},
                  pods={("tandem", "tandem-target-abc"), ("tandem", "tandem-target-def")}) as api:
        conn = KubernetesConnector(api_client(kubeconfig(tmp_path, api.url)), "tandem",
                                   {"target": "tandem-target", "draft": "tandem-draft"})
        assert await conn.replicas() == {"target": 2, "draft": 1}
        await conn.scale("target", 3, [], "itl_over_sla")
        assert api.deployments[("tandem", "tandem-target")] == 3
        # scale-down: the least loaded pods are marked cheapest to delete first, then the count drops
        await conn.scale("target", 2, [record("tandem-target-def"), record("tandem-target-abc")], "below_sla")
        assert api.deployments[("tandem", "tandem-target")] == 2
        assert api.pods[("tandem", "tandem-target-def")] == {DELETION_COST: "-1000"}
        assert api.pods[("tandem", "tandem-target-abc")] == {DELETION_COST: "-999"}
        patches = [(path, ctype, body) for method, path, ctype, body in api.log if method == "PATCH"]
        assert patches[0] == ("/apis/apps/v1/namespaces/tandem/deployments/tandem-target/scale",
                              "application/merge-patch+json", {"spec": {"replicas": 3}})
        assert [p[0].rsplit("/", 1)[-1] for p in patches[1:]] == ["tandem-target-def", "tandem-target-abc", "scale"]
        await conn.close()


async def test_api_errors_are_scale_errors_that_say_what_happened(tmp_path):
    with ScaleApi({("tandem", "tandem-target"): 1}) as api:
        missing = KubernetesConnector(api_client(kubeconfig(tmp_path, api.url)), "tandem", {"target": "nope"})
        with pytest.raises(ScaleError, match=r'404 .*"nope" not found'):
            await missing.replicas()
        wrong_token = KubernetesConnector(api_client(kubeconfig(tmp_path, api.url, "stolen")), "tandem",
                                          {"target": "tandem-target"})
        with pytest.raises(ScaleError, match="401"):
            await wrong_token.scale("target", 2, [], "test")
        api.forbid_patch = True
        ok = KubernetesConnector(api_client(kubeconfig(tmp_path, api.url)), "tandem", {"target": "tandem-target"})
        with pytest.raises(ScaleError, match="403 .*forbidden"):
            await ok.scale("target", 2, [], "test")
        with pytest.raises(ScaleError, match="no Deployment is named for pool 'draft'"):
            await ok.scale("draft", 2, [], "test")
        assert api.deployments[("tandem", "tandem-target")] == 1
    gone = KubernetesConnector(api_client(kubeconfig(tmp_path, api.url)), "tandem", {"target": "tandem-target"})
    with pytest.raises(ScaleError, match="reading deployments/tandem-target/scale"):
        await gone.replicas()  # the server is down: one clear error, not a hang


async def test_the_planner_process_scales_an_idle_deployment_down(tmp_path, rt, spawn):
    """``python -m planner --connector kubernetes``: the Deployment says 3 targets, one mock target is
    registered and idle; the planner waits --start-timeout for the missing two, then scales the
    Deployment down a step at a time to --min-targets, through PATCHes of its scale subresource."""
    with ScaleApi({("tandem", "tandem-target"): 3}) as api:
        spawn("workers.mock", "--token-latency-ms", "1", name="target")
        targets = await rt.client("target", "generate")
        await targets.wait_for_instances(1, timeout=60)
        planner = spawn("planner", "--connector", "kubernetes", "--kubeconfig", kubeconfig(tmp_path, api.url),
                        "--k8s-deployment", "target=tandem-target", "--itl-p90", "50ms", "--max-drafts", "0",
                        "--adjustment-interval", "0.5", "--latency-window", "1", "--down-cooldown", "1",
                        "--start-timeout", "2", name="planner")
        planner.wait_for_log("pool target: 2 -> 1 (idle)", timeout=60)
        # the decision is logged before its PATCH is sent: wait for the connector's word that it landed
        planner.wait_for_log("deployments/tandem-target in tandem scaled to 1", timeout=30)
        assert api.deployments[("tandem", "tandem-target")] == 1
        patches = [body["spec"]["replicas"] for method, path, ctype, body in api.log
                   if method == "PATCH" and path.endswith("/scale")]
        assert patches == [2, 1]
        # before the scale-down it tried to mark the idle worker's pod (its host name) cheapest to delete
        assert any(method == "PATCH" and "/pods/" in path for method, path, _, _ in api.log)
        assert "pool target: hold at 3 (starting)" in planner.logs()
