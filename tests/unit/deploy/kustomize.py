"""A small ``kubectl kustomize`` equivalent, for tests that must run where no kubectl is installed.

It implements exactly the kustomization features ``k8s/`` uses — ``resources`` (files and
directories), ``components``, ``namespace``, ``labels``, ``images`` and ``patches`` (strategic
merge patches from files, matched by kind and name) — and raises :class:`KustomizeError` on any
other field, so a manifest that starts using a feature this builder lacks fails loudly instead of
being silently half-built.
"""

from __future__ import annotations

import copy
from pathlib import Path

import yaml

KNOWN_FIELDS = {"apiVersion", "kind", "namespace", "labels", "resources", "components", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "PersistentVolume", "StorageClass", "ClusterRole", "ClusterRoleBinding",
                  "CustomResourceDefinition", "PriorityClass", "APIService"}
# Strategic-merge keys of the Kubernetes lists ``k8s/`` patches (from the API's patchMergeKey).
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "volumes": "name",
              "volumeMounts": "mountPath", "ports": "containerPort", "imagePullSecrets": "name"}
POD_TEMPLATE_KINDS = {"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"}


class KustomizeError(ValueError):
    """A kustomization that cannot be built (missing file, unknown field, patch without target)."""


def _kustomization(directory: Path) -> dict:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        path = directory / name
        if path.exists():
            doc = yaml.safe_load(path.read_text()) or {}
            unknown = set(doc) - KNOWN_FIELDS
            if unknown:
                raise KustomizeError(f"{path}: fields this builder does not implement: {sorted(unknown)}")
            return doc
    raise KustomizeError(f"no kustomization file in {directory}")


def _load_docs(path: Path) -> list[dict]:
    if not path.exists():
        raise KustomizeError(f"resource {path} does not exist")
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


def build(directory: str | Path) -> list[dict]:
    """The objects ``kubectl kustomize directory`` would print (order aside)."""
    return _build(Path(directory).resolve(), [])


def _build(directory: Path, inherited: list[dict]) -> list[dict]:
    kz = _kustomization(directory)
    kind = kz.get("kind", "Kustomization")
    if kind == "Component" and kz.get("apiVersion") != "kustomize.config.k8s.io/v1alpha1":
        raise KustomizeError(f"{directory}: a Component must be kustomize.config.k8s.io/v1alpha1")
    objs = list(inherited)
    for res in kz.get("resources", []):
        path = (directory / res).resolve()
        objs += _build(path, []) if path.is_dir() else _load_docs(path)
    for comp in kz.get("components", []):
        path = (directory / comp).resolve()
        if _kustomization(path).get("kind") != "Component":
            raise KustomizeError(f"{path} is listed under components but is not a Component")
        objs = _build(path, objs)
    for patch in kz.get("patches", []):
        _apply_patch(objs, directory, patch)
    if "namespace" in kz:
        for obj in objs:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj.setdefault("metadata", {})["namespace"] = kz["namespace"]
    for entry in kz.get("labels", []):
        _apply_labels(objs, entry)
    for image in kz.get("images", []):
        _apply_image(objs, image)
    _check_unique(objs, directory)
    return objs


def _apply_patch(objs: list[dict], directory: Path, patch: dict) -> None:
    if set(patch) - {"path", "target"} or "path" not in patch:
        raise KustomizeError(f"{directory}: only `path` (+ optional `target`) patches are implemented: {patch}")
    docs = _load_docs(directory / patch["path"])
    for doc in docs:
        target = patch.get("target") or {"kind": doc["kind"], "name": doc["metadata"]["name"]}
        matches = [o for o in objs if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        if len(matches) != 1:
            raise KustomizeError(f"{directory / patch['path']}: patch target {target} matched {len(matches)} objects")
        strategic_merge(matches[0], doc)


def strategic_merge(base: dict, patch: dict) -> dict:
    """Merge ``patch`` into ``base`` in place: maps recursively, ``null`` deletes a key, lists with a
    merge key (containers by name, ...) merge item by item, other lists are replaced."""
    for key, value in patch.items():
        if value is None:
            base.pop(key, None)
        elif isinstance(value, dict) and isinstance(base.get(key), dict):
            strategic_merge(base[key], value)
        elif isinstance(value, list) and key in MERGE_KEYS and isinstance(base.get(key), list):
            mk = MERGE_KEYS[key]
            for item in value:
                same = [b for b in base[key] if b.get(mk) == item.get(mk)]
                if same:
                    strategic_merge(same[0], item)
                else:
                    base[key].append(copy.deepcopy(item))
        else:
            base[key] = copy.deepcopy(value)
    return base


def _apply_labels(objs: list[dict], entry: dict) -> None:
    pairs = entry.get("pairs", {})
    if entry.get("includeSelectors"):
        raise KustomizeError("labels with includeSelectors: true are not implemented")
    for obj in objs:
        obj.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
        if entry.get("includeTemplates") and obj["kind"] in POD_TEMPLATE_KINDS:
            obj["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(pairs)
            for claim in obj["spec"].get("volumeClaimTemplates", []):
                claim.setdefault("metadata", {}).setdefault("labels", {}).update(pairs)


def pod_specs(obj: dict) -> list[dict]:
    if obj["kind"] in POD_TEMPLATE_KINDS:
        return [obj["spec"]["template"]["spec"]]
    if obj["kind"] == "Pod":
        return [obj["spec"]]
    return []


def _apply_image(objs: list[dict], image: dict) -> None:
    for obj in objs:
        for spec in pod_specs(obj):
            for container in spec.get("containers", []) + spec.get("initContainers", []):
                name, _, tag = container["image"].partition(":")
                if name != image["name"]:
                    continue
                tag = image.get("newTag", tag)
                container["image"] = image.get("newName", name) + (f":{tag}" if tag else "")


def _check_unique(objs: list[dict], directory: Path) -> None:
    seen = set()
    for obj in objs:
        key = (obj.get("apiVersion"), obj["kind"], obj["metadata"].get("namespace"), obj["metadata"]["name"])
        if key in seen:
            raise KustomizeError(f"{directory}: {key} is defined twice")
        seen.add(key)
