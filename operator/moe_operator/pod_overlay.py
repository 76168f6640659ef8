"""spec.podTemplate: what a user may add to the rendered pods, and the strategic merge that adds it. Pure.

The overlay is applied after rendering, to the Deployment's pod template or to both templates of a
LeaderWorkerSet. Maps merge key by key; lists merge by Kubernetes' patch merge keys (containers,
initContainers, volumes and imagePullSecrets by name, volumeMounts by mountPath, env by name,
topologySpreadConstraints by topologyKey), as `kubectl patch --type strategic` does for PodSpec.

Refused, by name and with the field to use: what the operator decides for the main container
(`engine`: image, command, args, env, resources, ports, probes, security context), the placement
(nodeSelector, tolerations, required node affinity: the planner's GPU class), the pod's isolation
(host namespaces, hostPath volumes, privileged or capability-adding containers) and the names,
labels and mounts the operator's own objects use. Extra containers may not ask for GPUs (they are
the engine's, counted by placement) nor set the environment names env_policy refuses for the engine.
"""

from __future__ import annotations

import copy
from typing import Any

from . import env_policy

MAIN = "engine"
# keys of the engine container a podTemplate may set (everything else is the operator's)
MAIN_ALLOWED = ("name", "volumeMounts", "terminationMessagePolicy", "terminationMessagePath")
MAIN_FIELDS = {
    "image": "spec.engine.image", "command": "spec.engine.args", "args": "spec.engine.args",
    "env": "spec.env", "envFrom": "spec.env", "resources": "spec.resources", "ports": "spec.service.port",
    "securityContext": "nothing (the operator's restricted security context)",
    "livenessProbe": "nothing (the operator probes the engine's /health)",
    "readinessProbe": "nothing (the operator probes the engine's readiness endpoint)",
    "startupProbe": "nothing (the operator probes the engine's /health)",
    "workingDir": "nothing (the engine image's)", "stdin": "nothing", "tty": "nothing",
    "lifecycle": "nothing (a hook would run commands in the engine container, beside its GPUs)",
}
# volume sources Kubernetes' "restricted" Pod Security profile allows (no host, no network mounts of
# the user's choosing beyond what a PVC gives: pod-security-admission policy/check_restrictedVolumes.go)
VOLUME_TYPES = ("configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret")
# pod spec keys a podTemplate may not set, with what to use instead
POD_FIELDS = {
    "nodeSelector": "spec.nodeSelector", "tolerations": "spec.tolerations",
    "nodeName": "spec.gpu (the planner places the pods)",
    "hostNetwork": "nothing (engine pods never share the node's namespaces)",
    "hostPID": "nothing (engine pods never share the node's namespaces)",
    "hostIPC": "nothing (engine pods never share the node's namespaces)",
    "shareProcessNamespace": "nothing (the engine's processes stay its own)",
    "hostUsers": "nothing", "restartPolicy": "nothing (the workload's)",
}
# names the operator's pods use: a podTemplate item of that name would replace the operator's
RESERVED_VOLUMES = ("plan", "dshm", "hf-cache", "engine-cache", "model", "model-cache", "tmp", "model-source")
RESERVED_INIT = ("fetch-model", "model-cache-ready")
# mount paths the operator's containers use (a mount at or under one would hide it)
RESERVED_MOUNTS = ("/etc/moe", "/dev/shm", "/models", "/root/.cache/huggingface", "/var/cache/moe")
RESERVED_LABEL_PREFIXES = ("moe.serving.dev/", "leaderworkerset.sigs.k8s.io/")
# the operator's selector labels, and what the workload controllers set on their pods
RESERVED_LABELS = ("app.kubernetes.io/instance", "app.kubernetes.io/name", "app.kubernetes.io/managed-by",
                   "pod-template-hash", "controller-revision-hash", "statefulset.kubernetes.io/pod-name")
# a user container's securityContext: only what narrows it (the restricted defaults fill the rest)
SIDECAR_SECURITY_ALLOWED = ("runAsUser", "runAsGroup", "runAsNonRoot", "readOnlyRootFilesystem")
POD_SECURITY_ALLOWED = ("fsGroup", "fsGroupChangePolicy", "supplementalGroups")

_MERGE_KEYS = {"containers": "name", "initContainers": "name", "volumes": "name", "imagePullSecrets": "name",
               "volumeMounts": "mountPath", "env": "name", "topologySpreadConstraints": "topologyKey"}


def _shape(where: str, obj: dict[str, Any], lists: tuple[str, ...], maps: tuple[str, ...]) -> list[str]:
    """Type errors the checks below would trip over (the API server would refuse them later, as an
    apply error on the workload instead of a refusal at admission)."""
    out = [f"{where}.{k} must be a list of objects" for k in lists
           if k in obj and not (isinstance(obj[k], list) and all(isinstance(i, dict) for i in obj[k]))]
    return out + [f"{where}.{k} must be an object" for k in maps if k in obj and not isinstance(obj[k], dict)]


def _under(path: str, roots: tuple[str, ...]) -> str | None:
    p = path.rstrip("/") or "/"
    for r in roots:
        if p == r or p.startswith(r + "/") or r.startswith(p.rstrip("/") + "/"):
            return r
    return None


def mount_refusals(where: str, mounts: list[Any], reserved: tuple[str, ...]) -> list[str]:
    out = []
    for m in mounts:
        path = m.get("mountPath") if isinstance(m, dict) else None
        if not isinstance(path, str) or not path.startswith("/"):
            out.append(f"{where}: every volumeMount needs an absolute mountPath")
        elif (r := _under(path, reserved)):
            out.append(f"{where}: mountPath {path} overlaps {r}, which the operator mounts")
    return out


def _container_refusals(where: str, c: Any, names_taken: tuple[str, ...]) -> list[str]:
    if not isinstance(c, dict) or not isinstance(c.get("name"), str) or not c["name"]:
        return [f"{where}: every container needs a name"]
    name = c["name"]
    out = _shape(f"{where} {name}", c, ("env", "ports", "volumeMounts", "envFrom"), ("securityContext", "resources"))
    if isinstance(c.get("resources"), dict):
        out += _shape(f"{where} {name}.resources", c["resources"], ("claims",), ("requests", "limits"))
    if out:
        return out
    if name in names_taken:
        return [f"{where} {name}: the name is the operator's"]
    if not isinstance(c.get("image"), str) or not c["image"]:
        out.append(f"{where} {name}: an image is required")
    else:
        from . import image_ref
        try:
            image_ref.parse(c["image"])
        except ValueError as e:
            out.append(f"{where} {name}: {e}")
    sec = c.get("securityContext") or {}
    if (bad := sorted(set(sec) - set(SIDECAR_SECURITY_ALLOWED))):
        out.append(f"{where} {name}: securityContext may set only {', '.join(SIDECAR_SECURITY_ALLOWED)} "
                   f"(privilege escalation, capabilities and privileged mode stay off), not {', '.join(bad)}")
    if "envFrom" in c:
        out.append(f"{where} {name}: envFrom is refused (its names cannot be checked): list the variables in env")
    for e in c.get("env") or []:
        if isinstance(e, dict) and isinstance(e.get("name"), str) and (why := env_policy.refusal(e["name"])):
            out.append(f"{where} {name}: {why}")
    res = c.get("resources") or {}
    for part in ("requests", "limits", "claims"):
        for k in (res.get(part) or {}) if isinstance(res, dict) else ():
            if "gpu" in str(k).lower():
                out.append(f"{where} {name}: resources.{part}.{k}: GPUs are the engine's (spec.gpusPerReplica)")
    out += mount_refusals(f"{where} {name}", c.get("volumeMounts") or [], ())
    for m in c.get("volumeMounts") or []:
        if isinstance(m, dict) and m.get("name") in RESERVED_VOLUMES and m.get("readOnly") is not True:
            out.append(f"{where} {name}: volumeMount of the operator's volume {m['name']} must be readOnly: true")
    for port in c.get("ports") or []:
        if isinstance(port, dict) and port.get("hostPort"):
            out.append(f"{where} {name}: hostPort is refused (a Service or spec.service exposes the pods)")
    return out


def refusals(template: dict[str, Any]) -> list[str]:
    """Why this podTemplate (plain dict, as the API has it) may not be applied; [] when it may."""
    out: list[str] = []
    meta = template.get("metadata") or {}
    for part in ("labels", "annotations"):
        for k in meta.get(part) or {}:
            if k.startswith(RESERVED_LABEL_PREFIXES) or k in RESERVED_LABELS:
                out.append(f"podTemplate.metadata.{part}: {k} is reserved for the operator "
                           f"({', '.join(RESERVED_LABEL_PREFIXES)}* and {', '.join(RESERVED_LABELS)})")
    spec = template.get("spec") or {}
    aff = spec.get("affinity") or {}
    if (bad := _shape("podTemplate.spec.affinity", aff, (), ("nodeAffinity", "podAffinity", "podAntiAffinity"))):
        return bad
    for c in spec.get("containers") or []:
        if isinstance(c, dict) and (bad := _shape(f"podTemplate.spec.containers {c.get('name')}", c, ("volumeMounts",), ())):
            return bad
    for k, use in POD_FIELDS.items():
        if spec.get(k) not in (None, False) or (k == "hostUsers" and spec.get(k) is not None):
            out.append(f"podTemplate.spec.{k} is the operator's: use {use}")
    sec = spec.get("securityContext") or {}
    if (bad := sorted(set(sec) - set(POD_SECURITY_ALLOWED))):
        out.append(f"podTemplate.spec.securityContext may set only {', '.join(POD_SECURITY_ALLOWED)} "
                   f"(the rest is the operator's restricted profile), not {', '.join(bad)}")
    if (aff.get("nodeAffinity") or {}).get("requiredDuringSchedulingIgnoredDuringExecution"):
        out.append("podTemplate.spec.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution is the "
                   "planner's (its terms would widen the GPU class it chose): use spec.nodeSelector or spec.gpu")
    for v in spec.get("volumes") or []:
        name = v.get("name") if isinstance(v, dict) else None
        if not isinstance(name, str) or not name:
            out.append("podTemplate.spec.volumes: every volume needs a name")
        elif name in RESERVED_VOLUMES:
            out.append(f"podTemplate.spec.volumes {name}: the name is the operator's ({', '.join(RESERVED_VOLUMES)})")
        elif "hostPath" in v:
            out.append(f"podTemplate.spec.volumes {name}: hostPath volumes are refused (use a PersistentVolumeClaim)")
        elif len(src := [k for k in v if k != "name"]) != 1 or src[0] not in VOLUME_TYPES:
            out.append(f"podTemplate.spec.volumes {name}: one source of {', '.join(VOLUME_TYPES)} (the restricted "
                       f"Pod Security profile's), not {', '.join(src) or 'none'}")
    for c in spec.get("containers") or []:
        if isinstance(c, dict) and c.get("name") == MAIN:
            for k in c:
                if k not in MAIN_ALLOWED:
                    use = MAIN_FIELDS.get(k, "nothing (the operator's)")
                    out.append(f"podTemplate.spec.containers {MAIN}: {k} is the operator's: use {use}")
            out += mount_refusals(f"podTemplate.spec.containers {MAIN}", c.get("volumeMounts") or [], RESERVED_MOUNTS)
        else:
            out += _container_refusals("podTemplate.spec.containers", c, ())
    for c in spec.get("initContainers") or []:
        out += _container_refusals("podTemplate.spec.initContainers", c, (MAIN, *RESERVED_INIT))
    names = [c.get("name") for part in ("containers", "initContainers") for c in spec.get(part) or []
             if isinstance(c, dict) and isinstance(c.get("name"), str)]
    if (dup := sorted({n for n in names if names.count(n) > 1})):
        out.append(f"podTemplate.spec: container names must be unique across containers and initContainers: {dup}")
    return out


def images(template: dict[str, Any]) -> list[str]:
    """The images a podTemplate adds (for the admin's registry policy)."""
    spec = template.get("spec") or {}
    return [c["image"] for part in ("containers", "initContainers") for c in spec.get(part) or []
            if isinstance(c, dict) and isinstance(c.get("image"), str)]


def _merge_list(base: list[Any], patch: list[Any], key: str | None) -> list[Any]:
    if key is None:
        return copy.deepcopy(patch)
    out = copy.deepcopy(base)
    for item in patch:
        i = next((n for n, b in enumerate(out) if isinstance(b, dict) and isinstance(item, dict)
                  and b.get(key) == item.get(key)), None)
        if i is None:
            out.append(copy.deepcopy(item))
        else:
            out[i] = merge(out[i], item)
    return out


def merge(base: Any, patch: Any, field: str | None = None) -> Any:
    """Strategic merge of `patch` into a copy of `base` (maps by key, lists by their patch merge key)."""
    if isinstance(base, dict) and isinstance(patch, dict):
        out = copy.deepcopy(base)
        for k, v in patch.items():
            out[k] = merge(out[k], v, k) if k in out else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list):
        return _merge_list(base, patch, _MERGE_KEYS.get(field or ""))
    return copy.deepcopy(patch)


def _with_restricted_security(c: dict[str, Any], container_security: dict[str, Any]) -> dict[str, Any]:
    return {**c, "securityContext": {**container_security, **(c.get("securityContext") or {})}}


def apply(pod: dict[str, Any], template: dict[str, Any] | None, container_security: dict[str, Any],
          pull_secrets: tuple[str, ...] = ()) -> dict[str, Any]:
    """The rendered pod template (metadata + spec) with the operator-wide pull secrets and the
    user's podTemplate merged in. `template` must have passed refusals()."""
    out = copy.deepcopy(pod)
    if pull_secrets:
        out["spec"]["imagePullSecrets"] = [{"name": n} for n in pull_secrets]
    if not template:
        return out
    meta, spec = template.get("metadata") or {}, copy.deepcopy(template.get("spec") or {})
    for part in ("labels", "annotations"):
        if meta.get(part):
            out["metadata"][part] = {**meta[part], **(out["metadata"].get(part) or {})}  # the operator's win
    for part in ("containers", "initContainers"):
        spec[part] = [c if c.get("name") == MAIN else _with_restricted_security(c, container_security)
                      for c in spec.get(part) or []]
        if not spec[part]:
            del spec[part]
    if "serviceAccountName" in spec:
        # the deprecated twin too: the API server copies one to the other when either is empty, so a
        # serviceAccount only it set would stay (and bring the name back) after the podTemplate drops it
        spec["serviceAccount"] = spec["serviceAccountName"]
    if "securityContext" in spec:
        spec["securityContext"] = {**out["spec"].get("securityContext", {}), **spec["securityContext"]}
    out["spec"] = merge(out["spec"], spec)
    return out
