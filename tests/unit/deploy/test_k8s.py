"""k8s/: every overlay builds with the real ``kubectl kustomize``, every object is valid against the
Kubernetes schemas, and the wiring between objects holds."""

from __future__ import annotations

import importlib
import os

import jsonschema
import kubernetes_validate
import pytest
import yaml

from runtime.config import RuntimeConfig, config_from_args
from tests.support.kustomize import K8S, MODULES, KustomizeError, build, by_kind, pod_specs

pytestmark = pytest.mark.unit

OVERLAYS = ["base", "overlays/cpu-demo", "overlays/gpu"]
# Overlays made of another overlay and a component: every check on OVERLAYS holds for them too.
VARIANTS = ["overlays/gpu-disagg"]
# Oldest and newest Kubernetes minor versions the manifests are checked against.
K8S_VERSIONS = ["1.29.0", kubernetes_validate.utils.latest_version()]

# ServiceMonitor is a CRD (monitoring.coreos.com/v1) whose schema kubernetes-validate lacks: a strict
# schema of the fields k8s/ uses, from the prometheus-operator API reference.
SERVICE_MONITOR_SCHEMA = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object", "required": ["name"]},
        "spec": {
            "type": "object",
            "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {
                "selector": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
                        "matchExpressions": {"type": "array", "items": {
                            "type": "object", "required": ["key", "operator"], "additionalProperties": False,
                            "properties": {"key": {"type": "string"},
                                           "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                                           "values": {"type": "array", "items": {"type": "string"}}}}},
                    },
                },
                "namespaceSelector": {"type": "object"},
                "jobLabel": {"type": "string"},
                "endpoints": {"type": "array", "minItems": 1, "items": {
                    "type": "object", "required": ["port"], "additionalProperties": False,
                    "properties": {
                        "port": {"type": "string"}, "path": {"type": "string"},
                        "interval": {"type": "string", "pattern": "^[0-9]+(ms|s|m|h)$"},
                        "relabelings": {"type": "array", "items": {
                            "type": "object", "additionalProperties": False,
                            "properties": {"sourceLabels": {"type": "array", "items": {"type": "string"}},
                                           "targetLabel": {"type": "string"}, "action": {"type": "string"},
                                           "regex": {"type": "string"}, "replacement": {"type": "string"}}}},
                    }}},
            },
        },
    },
}


@pytest.fixture(scope="module", params=OVERLAYS + VARIANTS)
def built(request) -> tuple[str, list[dict]]:
    return request.param, build(K8S / request.param)


TANDEM_COMPONENTS = ("frontend", "router", "target", "draft")


def tandem_deployments(objs: list[dict]) -> dict[str, dict]:
    """The Deployments that run a Tandem process (not the infra: NATS)."""
    return {n: d for n, d in by_kind(objs, "Deployment").items()
            if d["spec"]["template"]["metadata"]["labels"].get("app.kubernetes.io/component") in TANDEM_COMPONENTS}


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_every_object_is_valid_against_the_kubernetes_schema(built, version):
    _, objs = built
    for obj in objs:
        if obj["kind"] == "ServiceMonitor":
            jsonschema.validate(obj, SERVICE_MONITOR_SCHEMA)
            continue
        kubernetes_validate.validate(obj, version, strict=True)


def test_schema_validation_rejects_a_broken_object():
    objs = build(K8S / "base")
    dep = next(o for o in objs if o["kind"] == "Deployment")
    dep["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}  # misspelt field
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, K8S_VERSIONS[-1], strict=True)
    monitor = {"apiVersion": "monitoring.coreos.com/v1", "kind": "ServiceMonitor", "metadata": {"name": "x"},
               "spec": {"selector": {}, "endpoints": [{"port": "http", "intervall": "5s"}]}}
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(monitor, SERVICE_MONITOR_SCHEMA)


def test_overlays_contain_what_they_promise():
    base, cpu, gpu = ({(o["kind"], o["metadata"]["name"]) for o in build(K8S / overlay)} for overlay in OVERLAYS)
    for name in ("tandem-frontend", "tandem-router", "tandem-target", "tandem-draft", "tandem-nats"):
        assert ("Deployment", name) in base
    assert {("StatefulSet", "tandem-etcd"), ("Service", "tandem-frontend"), ("Service", "tandem-etcd")} <= base
    assert {("PodDisruptionBudget", n) for n in ("tandem-frontend", "tandem-router", "tandem-etcd")} <= base
    # the demo only patches (and drops the budgets of what it runs once)
    assert cpu == base - {("PodDisruptionBudget", "tandem-frontend"), ("PodDisruptionBudget", "tandem-router")}
    assert gpu - base == {("ServiceMonitor", "tandem-http"), ("ServiceMonitor", "tandem-workers"),
                          ("HorizontalPodAutoscaler", "tandem-frontend"), ("HorizontalPodAutoscaler", "tandem-target"),
                          ("HorizontalPodAutoscaler", "tandem-draft"), ("PersistentVolumeClaim", "tandem-models")}


# Kinds that live outside any namespace; every other object must carry the overlay's namespace, or
# `kubectl apply` puts it in the caller's current one (a PVC no pod finds, an HPA scaling nothing).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "PersistentVolume", "StorageClass",
                  "CustomResourceDefinition", "PriorityClass"}


def test_every_namespaced_object_of_every_overlay_has_the_tandem_namespace(built):
    overlay, objs = built
    [namespace] = [o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"]
    missing = [(o["kind"], o["metadata"]["name"]) for o in objs
               if o["kind"] not in CLUSTER_SCOPED and o["metadata"].get("namespace") != namespace]
    assert not missing, f"{overlay}: not in namespace {namespace}: {missing}"


def test_hpas_and_monitors_find_their_targets_in_their_own_namespace(built):
    overlay, objs = built
    present = {(o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"]) for o in objs}
    for hpa in (o for o in objs if o["kind"] == "HorizontalPodAutoscaler"):
        ref = hpa["spec"]["scaleTargetRef"]
        assert ref["apiVersion"] == "apps/v1", (overlay, hpa["metadata"]["name"])
        assert (ref["kind"], hpa["metadata"].get("namespace"), ref["name"]) in present, (overlay, hpa["metadata"]["name"])
    services = [o for o in objs if o["kind"] == "Service"]
    for monitor in (o for o in objs if o["kind"] == "ServiceMonitor"):
        assert "namespaceSelector" not in monitor["spec"]  # its own namespace only
        matched = [s for s in services if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])
                   and s["metadata"].get("namespace") == monitor["metadata"].get("namespace")]
        assert matched, (overlay, monitor["metadata"]["name"])


def test_tandem_pods_probe_health_and_live_and_terminate_gracefully(built):
    _, objs = built
    drain = RuntimeConfig().drain_timeout
    for name, dep in tandem_deployments(objs).items():
        spec = dep["spec"]["template"]["spec"]
        [container] = spec["containers"]
        ports = {p["name"]: p["containerPort"] for p in container["ports"]}
        assert container["readinessProbe"]["httpGet"]["path"] == "/health", name
        assert container["livenessProbe"]["httpGet"]["path"] == "/live", name
        assert container["readinessProbe"]["httpGet"]["port"] in ports, name
        pre_stop = container["lifecycle"]["preStop"]["exec"]["command"]
        assert pre_stop[0] == "sleep"
        # The grace period covers the preStop pause and the whole drain.
        assert spec["terminationGracePeriodSeconds"] >= int(pre_stop[1]) + drain, name
        assert spec["securityContext"]["runAsNonRoot"] is True
        args = container["args"]
        if args[0] in ("target", "draft"):
            # The health server listens where the probes look, on all interfaces.
            assert f"--health-port={ports['health']}" in args and "--health-host=0.0.0.0" in args, name
        else:
            assert f"--http-port={ports['http']}" in args, name
            # Bound where the kubelet and Prometheus reach it (the router's HTTP is its health server).
            assert ("--host=0.0.0.0" if args[0] == "frontend" else "--health-host=0.0.0.0") in args, name
        for ref in container.get("envFrom", []):
            assert ref["configMapRef"]["name"] in by_kind(objs, "ConfigMap")


def test_gpu_overlay_requests_gpus_for_target_and_draft_only():
    for overlay, want in (("overlays/gpu", True), ("overlays/cpu-demo", False), ("base", False)):
        deps = by_kind(build(K8S / overlay), "Deployment")
        for name, dep in deps.items():
            res = dep["spec"]["template"]["spec"]["containers"][0]["resources"]
            has_gpu = "nvidia.com/gpu" in res.get("limits", {})
            assert has_gpu == (want and name in ("tandem-target", "tandem-draft")), (overlay, name)
    gpu = build(K8S / "overlays/gpu")
    target = by_kind(gpu, "Deployment")["tandem-target"]["spec"]["template"]["spec"]
    [models] = [v for v in target["volumes"] if v["name"] == "models"]
    assert models == {"name": "models", "persistentVolumeClaim": {"claimName": "tandem-models", "readOnly": True}}
    pvc = by_kind(gpu, "PersistentVolumeClaim")["tandem-models"]
    # Written once, then read by pods on many nodes: ReadWriteMany (a ReadOnlyMany claim admits no writer
    # and most provisioners cannot make one, so every worker stayed Pending).
    assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
    for overlay in ("overlays/gpu", "overlays/gpu-disagg", "overlays/gpu-tp2"):
        for obj in build(K8S / overlay):
            for spec in pod_specs(obj):
                for v in spec.get("volumes", []):
                    if v.get("persistentVolumeClaim", {}).get("claimName") == "tandem-models":
                        assert v["persistentVolumeClaim"].get("readOnly") is True, (overlay, obj["metadata"]["name"])


@pytest.mark.parametrize("overlay", ["overlays/gpu", "overlays/gpu-tp2", "overlays/gpu-disagg"])
def test_gpu_deployments_roll_without_a_spare_gpu(overlay):
    # Each pod takes every GPU it asks for and a cluster has none spare: a surge pod would stay Pending and
    # the rollout with it. Stop one old pod, then start its successor.
    for dep in by_kind(build(K8S / overlay), "Deployment").values():
        limits = dep["spec"]["template"]["spec"]["containers"][0].get("resources", {}).get("limits", {})
        if "nvidia.com/gpu" in limits:
            rolling = dep["spec"].get("strategy", {}).get("rollingUpdate", {})
            assert (rolling.get("maxSurge"), rolling.get("maxUnavailable")) == (0, 1), (overlay, dep["metadata"]["name"])


def _selects(selector: dict, labels: dict) -> bool:
    if any(labels.get(k) != v for k, v in selector.get("matchLabels", {}).items()):
        return False
    for expr in selector.get("matchExpressions", []):
        if expr["operator"] == "In" and labels.get(expr["key"]) not in expr["values"]:
            return False
    return True


def test_selectors_find_their_pods_services_and_deployments(built):
    _, objs = built
    pods = {n: o["spec"]["template"]["metadata"]["labels"] for n, o in
            {**by_kind(objs, "Deployment"), **by_kind(objs, "StatefulSet")}.items()}
    for kind in ("Deployment", "StatefulSet"):
        for name, obj in by_kind(objs, kind).items():
            assert _selects(obj["spec"]["selector"], pods[name]), name
    for name, svc in by_kind(objs, "Service").items():
        assert any(_selects({"matchLabels": svc["spec"]["selector"]}, labels) for labels in pods.values()), name
    for name, pdb in by_kind(objs, "PodDisruptionBudget").items():
        assert sum(_selects(pdb["spec"]["selector"], labels) for labels in pods.values()) == 1, name
    deployments = by_kind(objs, "Deployment")
    for name, hpa in by_kind(objs, "HorizontalPodAutoscaler").items():
        assert hpa["spec"]["scaleTargetRef"]["name"] in deployments, name
        assert hpa["spec"]["minReplicas"] <= hpa["spec"]["maxReplicas"]
    services = by_kind(objs, "Service")
    for name, monitor in by_kind(objs, "ServiceMonitor").items():
        matched = [s for s in services.values() if _selects(monitor["spec"]["selector"], s["metadata"]["labels"])]
        assert matched, name
        for svc in matched:
            port_names = {p["name"] for p in svc["spec"]["ports"]}
            assert all(ep["port"] in port_names for ep in monitor["spec"]["endpoints"]), (name, svc["metadata"]["name"])


def test_images_are_pinned():
    for overlay in OVERLAYS:
        for obj in build(K8S / overlay):
            for spec in pod_specs(obj):
                for c in spec["containers"] + spec.get("initContainers", []):
                    assert ":" in c["image"] and not c["image"].endswith(":latest"), (overlay, c["image"])


def test_build_fails_loudly(tmp_path):
    (tmp_path / "kustomization.yaml").write_text("resources: [missing.yaml]\n")
    with pytest.raises(KustomizeError, match="missing.yaml"):
        build(tmp_path)


def _source_of(spec: dict, container: dict, path: str) -> tuple[str, dict, bool]:
    """(mount path, volume source, filled by the demo-model init container) holding ``path``."""
    mounts = [m for m in container.get("volumeMounts", []) if path.startswith(m["mountPath"].rstrip("/") + "/")]
    assert mounts, f"{path} is on no volume"
    mount = max(mounts, key=lambda m: len(m["mountPath"]))
    [volume] = [v for v in spec["volumes"] if v["name"] == mount["name"]]
    filled = any("workers.demo_model" in init.get("args", []) and
                 any(m["name"] == mount["name"] for m in init.get("volumeMounts", []))
                 for init in spec.get("initContainers", []))
    return mount["mountPath"], {k: v for k, v in volume.items() if k != "name"}, filled


def test_the_frontend_sees_the_tokenizer_at_the_path_the_targets_model_card_names(built):
    # The frontend loads the tokenizer from the model card's local path, so that path must hold
    # the same files in the frontend's pod: the same PVC, or the same demo model prepared there.
    overlay, objs = built
    deps = by_kind(objs, "Deployment")
    target = deps["tandem-target"]["spec"]["template"]["spec"]
    frontend = deps["tandem-frontend"]["spec"]["template"]["spec"]
    [model] = [a.split("=", 1)[1] for a in target["containers"][0]["args"] if a.startswith("--model=")]
    t_mount, t_source, t_filled = _source_of(target, target["containers"][0], model)
    f_mount, f_source, f_filled = _source_of(frontend, frontend["containers"][0], model)
    assert (f_mount, f_source) == (t_mount, t_source), overlay
    if "emptyDir" in t_source and overlay != "base":
        assert t_filled and f_filled, f"{overlay}: an emptyDir holds the model but nothing prepares it"


def test_drafts_register_a_grpc_address_other_pods_can_dial(built):
    _, objs = built
    [container] = by_kind(objs, "Deployment")["tandem-draft"]["spec"]["template"]["spec"]["containers"]
    assert "--grpc-host=$(POD_IP)" in container["args"]
    [pod_ip] = [e for e in container["env"] if e["name"] == "POD_IP"]
    assert pod_ip["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"


def _flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"--{name}=")]
    return value


def _min_replicas(objs: list[dict], workload: dict) -> int:
    """The fewest pods ``workload`` runs: its HPA's minReplicas when one scales it, else its replicas."""
    for hpa in by_kind(objs, "HorizontalPodAutoscaler").values():
        ref = hpa["spec"]["scaleTargetRef"]
        if (ref["kind"], ref["name"]) == (workload["kind"], workload["metadata"]["name"]):
            return hpa["spec"].get("minReplicas", 1)
    return workload["spec"].get("replicas", 1)


def test_etcd_members_form_one_cluster(built):
    # Every member's --initial-cluster must list all members by the names the peer Service gives
    # them; a list of only the pod itself makes `replicas` separate one-member clusters.
    overlay, objs = built
    sts = by_kind(objs, "StatefulSet")["tandem-etcd"]
    replicas = sts["spec"]["replicas"]
    peer = by_kind(objs, "Service")[sts["spec"]["serviceName"]]
    assert peer["spec"]["clusterIP"] == "None" and peer["spec"]["publishNotReadyAddresses"] is True, overlay
    assert {p["name"]: p["port"] for p in peer["spec"]["ports"]}["peer"] == 2380
    [container] = sts["spec"]["template"]["spec"]["containers"]
    args = container["command"]
    members = dict(m.split("=", 1) for m in _flag(args, "initial-cluster").split(","))
    service = sts["spec"]["serviceName"]
    assert members == {f"tandem-etcd-{i}": f"http://tandem-etcd-{i}.{service}:2380" for i in range(replicas)}, overlay
    assert _flag(args, "name") == "$(POD_NAME)"
    assert _flag(args, "initial-advertise-peer-urls") == f"http://$(POD_NAME).{service}:2380"
    assert _flag(args, "initial-cluster-state") == "new" and _flag(args, "initial-cluster-token")
    if replicas > 1:
        # OrderedReady would wait for member 0 to be ready, which it never is without a quorum.
        assert sts["spec"]["podManagementPolicy"] == "Parallel", overlay
        assert replicas % 2 == 1, "an even member count adds no fault tolerance"
    # Clients go through a Service that lists ready members only.
    [etcd_url] = {c["data"]["TANDEM_ETCD"] for c in by_kind(objs, "ConfigMap").values() if "TANDEM_ETCD" in c["data"]}
    client = by_kind(objs, "Service")[etcd_url.split("//")[1].split(":")[0]]
    assert client["spec"].get("clusterIP") != "None" and not client["spec"].get("publishNotReadyAddresses")
    assert _selects({"matchLabels": client["spec"]["selector"]}, sts["spec"]["template"]["metadata"]["labels"])


def test_etcd_check_catches_members_that_list_only_themselves():
    objs = build(K8S / "base")
    [container] = by_kind(objs, "StatefulSet")["tandem-etcd"]["spec"]["template"]["spec"]["containers"]
    container["command"] = [a if not a.startswith("--initial-cluster=") else
                            "--initial-cluster=$(POD_NAME)=http://$(POD_NAME).tandem-etcd-peer:2380"
                            for a in container["command"]]
    with pytest.raises(AssertionError):
        test_etcd_members_form_one_cluster(("base", objs))


def test_nats_runs_without_jetstream_and_without_state(built):
    # No Tandem code uses JetStream: core request/reply and pub/sub only.
    overlay, objs = built
    nats = [o for o in objs if o["metadata"]["name"] == "tandem-nats" and o["kind"] in ("Deployment", "StatefulSet")]
    assert len(nats) == 1, overlay
    spec = nats[0]["spec"]
    [container] = spec["template"]["spec"]["containers"]
    words = " ".join(container.get("command", []) + container.get("args", []))
    assert "jetstream" not in words and "-js" not in words.split() and "store_dir" not in words, overlay
    for probe in ("readinessProbe", "livenessProbe"):
        assert "js-" not in container[probe]["httpGet"]["path"], overlay
    assert not spec.get("volumeClaimTemplates") and not container.get("volumeMounts"), overlay


def test_disruption_budgets_protect_replicated_workloads_and_never_block_a_drain(built):
    overlay, objs = built
    workloads = [o for o in objs if o["kind"] in ("Deployment", "StatefulSet")]
    budgets = by_kind(objs, "PodDisruptionBudget")
    covered = set()
    for name, pdb in budgets.items():
        [workload] = [w for w in workloads if _selects(pdb["spec"]["selector"], w["spec"]["template"]["metadata"]["labels"])]
        covered.add(workload["metadata"]["name"])
        pods = _min_replicas(objs, workload)
        assert pods >= 2, f"{overlay}: {name} guards a one-replica {workload['kind']}: it protects nothing"
        if "maxUnavailable" in pdb["spec"]:
            allowed = pdb["spec"]["maxUnavailable"]
        else:
            allowed = pods - pdb["spec"]["minAvailable"]
        assert isinstance(allowed, int) and allowed >= 1, f"{overlay}: {name} blocks every node drain"
        if workload["metadata"]["name"] == "tandem-etcd":
            assert pods - allowed > pods // 2, f"{overlay}: {name} lets etcd lose its quorum"
    for workload in workloads:
        if _min_replicas(objs, workload) >= 2:
            assert workload["metadata"]["name"] in covered, f"{overlay}: {workload['metadata']['name']} has no budget"


def test_every_pod_is_locked_down(built):
    # Pod Security "restricted": non-root, RuntimeDefault seccomp, no privilege escalation, no
    # capabilities; plus a read-only root filesystem, with emptyDir volumes where a process writes;
    # no service-account token in pods that never call the Kubernetes API.
    overlay, objs = built
    for obj in objs:
        for spec in pod_specs(obj):
            where = f"{overlay}: {obj['kind']}/{obj['metadata']['name']}"
            # The planner (its own service account, RBAC to scale Deployments) is the one caller.
            token = spec.get("automountServiceAccountToken", True)
            assert token is ("serviceAccountName" in spec), where
            pod = spec.get("securityContext", {})
            assert pod.get("runAsNonRoot") is True and pod.get("runAsUser", 0) != 0, where
            for container in spec["containers"] + spec.get("initContainers", []):
                sc = container.get("securityContext", {})
                seccomp = sc.get("seccompProfile", pod.get("seccompProfile", {}))
                assert seccomp.get("type") == "RuntimeDefault", (where, container["name"])
                assert sc.get("allowPrivilegeEscalation") is False, (where, container["name"])
                assert sc.get("readOnlyRootFilesystem") is True, (where, container["name"])
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], (where, container["name"])
                if container.get("image", "").split("/")[-1].startswith("tandem"):
                    # Python, torch and Triton write to /tmp and the home directory.
                    mounts = {m["mountPath"]: m["name"] for m in container.get("volumeMounts", [])}
                    volumes = {v["name"]: v for v in spec["volumes"]}
                    for path in ("/tmp",) + (("/home/tandem",) if container in spec["containers"] else ()):
                        assert path in mounts and "emptyDir" in volumes[mounts[path]], (where, container["name"], path)


SECRET_ENV = {"TANDEM_NATS": "nats-url", "TANDEM_ETCD_USER": "etcd-user", "TANDEM_ETCD_PASSWORD": "etcd-password"}


def _secret_refs(container: dict) -> dict[str, dict]:
    return {e["name"]: e["valueFrom"]["secretKeyRef"] for e in container.get("env", [])
            if "secretKeyRef" in e.get("valueFrom", {})}


def test_credentials_come_from_the_secret_and_each_component_reads_them(built, monkeypatch):
    overlay, objs = built
    assert not [o for o in objs if o["kind"] == "Secret"], "secrets are created by the operator, not committed"
    sample = {"TANDEM_NATS": "nats://token@tandem-nats:4222", "TANDEM_ETCD_USER": "tandem",
              "TANDEM_ETCD_PASSWORD": "pw", "TANDEM_API_KEY": "k1,k2"}
    for name, dep in tandem_deployments(objs).items():
        [container] = dep["spec"]["template"]["spec"]["containers"]
        refs = _secret_refs(container)
        want = dict(SECRET_ENV, **({"TANDEM_API_KEY": "api-key"} if container["args"][0] == "frontend" else {}))
        assert {k: v["key"] for k, v in refs.items()} == want, (overlay, name)
        assert {v["name"] for v in refs.values()} == {"tandem-secrets"}
        for ref_name, ref in refs.items():
            # Optional, so a cluster without the key runs without that setting; the API key is required
            # in the production overlays (gpu and those built on it).
            assert ref["optional"] is (not (overlay.startswith("overlays/gpu") and ref_name == "TANDEM_API_KEY")), \
                (overlay, name, ref_name)
        words = " ".join(container["args"])
        assert "--api-key" not in words and "--etcd-password" not in words  # flags show in ps
        # The component reads every variable it is given.
        for var in [v for v in os.environ if v.startswith("TANDEM_")]:
            monkeypatch.delenv(var)
        for var in refs:
            monkeypatch.setenv(var, sample[var])
        module = importlib.import_module(MODULES[container["args"][0]])
        args = module.parse_args(container["args"][1:])
        config = config_from_args(args)
        assert config.nats_url == sample["TANDEM_NATS"] and config.etcd_credentials == ("tandem", "pw"), name
        if "TANDEM_API_KEY" in refs:
            assert args.api_key == ["k1", "k2"]


# ------------------------------------------------------------------ NetworkPolicy, evaluated as the CNI would


def _pods(objs: list[dict]) -> dict[str, tuple[dict, dict]]:
    """workload name -> (pod labels, {port name or number: port number}) of its pods."""
    out = {}
    for obj in objs:
        for spec in pod_specs(obj):
            ports = {}
            for c in spec["containers"]:
                for p in c.get("ports", []):
                    ports[p["containerPort"]] = p["containerPort"]
                    if "name" in p:
                        ports[p["name"]] = p["containerPort"]
            out[obj["metadata"]["name"]] = (obj["spec"]["template"]["metadata"]["labels"], ports)
    return out


def _peer_matches(peer: dict, namespace: str, src_ns: dict, src_pod: dict) -> bool:
    if "ipBlock" in peer:
        return False
    if "namespaceSelector" in peer:
        if not _selects(peer["namespaceSelector"], src_ns):
            return False
    elif src_ns.get("kubernetes.io/metadata.name") != namespace:
        return False  # a podSelector alone means pods of the policy's own namespace
    return _selects(peer.get("podSelector", {}), src_pod)


def _port_matches(entry: dict, ports: dict, port: int) -> bool:
    """Whether a rule's port entry admits TCP ``port``: no port is every port of its protocol, a number
    is that port (up to ``endPort``), a name is the pods' port of that name."""
    if entry.get("protocol", "TCP") != "TCP":
        return False  # every flow Tandem needs is TCP
    if "port" not in entry:
        return True
    if isinstance(entry["port"], int):
        return entry["port"] <= port <= entry.get("endPort", entry["port"])
    return ports.get(entry["port"]) == port


def ingress_allowed(objs: list[dict], src: tuple[dict, dict], dst: str, port: int) -> bool:
    """Whether NetworkPolicy lets a pod with (namespace labels, pod labels) ``src`` reach TCP ``port``
    on the pods of workload ``dst``."""
    labels, ports = _pods(objs)[dst]
    policies = [p for p in objs if p["kind"] == "NetworkPolicy" and "Ingress" in p["spec"]["policyTypes"]
                and _selects(p["spec"]["podSelector"], labels)]
    if not policies:
        return True
    for policy in policies:
        namespace = policy["metadata"]["namespace"]
        for rule in policy["spec"].get("ingress", []):
            peers_ok = "from" not in rule or any(_peer_matches(peer, namespace, *src) for peer in rule["from"])
            ports_ok = "ports" not in rule or any(_port_matches(p, ports, port) for p in rule["ports"])
            if peers_ok and ports_ok:
                return True
    return False


def test_network_policy_allows_what_tandem_needs_and_nothing_else(built):
    overlay, objs = built
    [namespace] = [o["metadata"]["name"] for o in objs if o["kind"] == "Namespace"]
    here = {"kubernetes.io/metadata.name": namespace}
    pods = _pods(objs)
    src = {name: (here, labels) for name, (labels, _) in pods.items()}
    outside = ({"kubernetes.io/metadata.name": "default"}, {"app": "client"})
    monitoring = ({"kubernetes.io/metadata.name": "monitoring"}, {"app.kubernetes.io/name": "prometheus"})
    config = next(o for o in objs if o["kind"] == "ConfigMap")["data"]
    etcd_port, nats_port = (int(config[k].rsplit(":", 1)[1]) for k in ("TANDEM_ETCD", "TANDEM_NATS"))
    tandem = list(tandem_deployments(objs))
    [draft] = by_kind(objs, "Deployment")["tandem-draft"]["spec"]["template"]["spec"]["containers"]
    grpc = int(_flag(draft["args"], "grpc-port"))
    assert grpc != 0, "a free gRPC port cannot be opened by a policy"
    for name in tandem:
        assert ingress_allowed(objs, src[name], "tandem-etcd", etcd_port), (overlay, name)
        assert ingress_allowed(objs, src[name], "tandem-nats", nats_port), (overlay, name)
    assert ingress_allowed(objs, src["tandem-etcd"], "tandem-etcd", 2380)
    assert ingress_allowed(objs, src["tandem-target"], "tandem-draft", grpc)
    assert ingress_allowed(objs, outside, "tandem-frontend", pods["tandem-frontend"][1]["http"])
    for monitor in by_kind(objs, "ServiceMonitor").values():
        for svc in by_kind(objs, "Service").values():
            if _selects(monitor["spec"]["selector"], svc["metadata"]["labels"]):
                [workload] = [n for n, (labels, _) in pods.items() if _selects({"matchLabels": svc["spec"]["selector"]}, labels)]
                for ep in monitor["spec"]["endpoints"]:
                    port = pods[workload][1][ep["port"]]
                    assert ingress_allowed(objs, monitoring, workload, port), (overlay, workload, ep["port"])
    # and nothing else: no client reaches the infra or the workers, no other pod the draft's gRPC
    for dst, port in (("tandem-etcd", etcd_port), ("tandem-etcd", 2380), ("tandem-nats", nats_port),
                      ("tandem-draft", grpc), ("tandem-target", 9100), ("tandem-router", 8001)):
        assert not ingress_allowed(objs, outside, dst, port), (overlay, dst, port)
    for name in ("tandem-frontend", "tandem-router", "tandem-draft"):
        assert not ingress_allowed(objs, src[name], "tandem-draft", grpc), (overlay, name)
    assert not ingress_allowed(objs, src["tandem-frontend"], "tandem-etcd", 2380)


# --------------------------------------------------------------------------------------- autoscaling

ROOT = K8S.parent
# Where each role's metrics are defined, and how a stem becomes the exported series name.
EXPORTERS = {"tandem-frontend": ("frontend/metrics.py", "tandem_frontend_"),
             "tandem-target": ("workers/target/metrics.py", "vllm:"),
             "tandem-draft": ("workers/draft/metrics.py", "tandem_draft_")}


def _adapter_rules() -> dict[str, str]:
    """prometheus-adapter: the metric name the HPA asks for -> the Prometheus series it reads."""
    values = yaml.safe_load((K8S / "components/autoscaling/prometheus-adapter-values.yaml").read_text())
    out = {}
    for kind in ("custom", "external"):
        for rule in values["rules"].get(kind, []):
            query = rule["seriesQuery"]
            name = query.split('__name__="')[1].split('"')[0] if "__name__" in query else query.split("{")[0]
            out[rule["name"]["as"]] = name.removesuffix("_count")
    return out


def test_each_role_scales_on_its_own_load():
    # Targets on their queue and KV cache use, drafts on their own load: not the frontends' in-flight
    # requests, which say nothing about which pool is short.
    gpu = build(K8S / "overlays/gpu")
    rules = _adapter_rules()
    hpas = by_kind(gpu, "HorizontalPodAutoscaler")
    assert set(hpas) == set(EXPORTERS)
    for name, hpa in hpas.items():
        source, prefix = EXPORTERS[name]
        text = (ROOT / source).read_text()
        for metric in hpa["spec"]["metrics"]:
            assert metric["type"] == "Pods", (name, metric)  # the scaled pods' own series
            series = rules[metric["pods"]["metric"]["name"]]
            assert series.startswith(prefix), (name, series)
            assert f'"{series.removeprefix(prefix)}"' in text, f"{name}: {series} is not exported by {source}"
    target = {rules[m["pods"]["metric"]["name"]] for m in hpas["tandem-target"]["spec"]["metrics"]}
    assert target == {"vllm:num_requests_waiting", "vllm:kv_cache_usage_perc"}
    usage = next(m for m in hpas["tandem-target"]["spec"]["metrics"]
                 if rules[m["pods"]["metric"]["name"]] == "vllm:kv_cache_usage_perc")
    assert usage["pods"]["target"]["averageValue"].endswith("m")  # a fraction of 1 (the gauge is 0-1)


def test_gpu_targets_size_their_kv_cache_for_a_gpu():
    # The target's default (--kv-cache-gb 1) is for the CPU demo; a GPU target left on it serves a
    # handful of sequences from a GPU with tens of GiB free.
    import workers.target.__main__ as target_main

    default = target_main.parse_args([]).kv_cache_gb
    for name, dep in by_kind(build(K8S / "overlays/gpu"), "Deployment").items():
        [container] = dep["spec"]["template"]["spec"]["containers"]
        if container.get("args", [None])[0] != "target":
            continue
        args = target_main.parse_args(container["args"][1:])
        assert args.num_blocks is not None or args.kv_cache_gb > 4 * default, (name, args.kv_cache_gb)


def assert_valid_and_locked_down(overlay: str, objs: list[dict]) -> None:
    """What a component added to an overlay must keep: every object valid against the newest
    Kubernetes schema, pods locked down, the namespace, and the network policy."""
    for obj in objs:
        if obj["kind"] != "ServiceMonitor":
            kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)
    test_every_pod_is_locked_down((overlay, objs))
    test_every_namespaced_object_of_every_overlay_has_the_tandem_namespace((overlay, objs))
    test_network_policy_allows_what_tandem_needs_and_nothing_else((overlay, objs))
