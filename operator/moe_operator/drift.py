"""Field-by-field comparison of a rendered object with its live copy. Pure.

What we render must be what runs. The live object carries more than we rendered (defaults the
API server fills in, annotations other controllers add), so a map compares only the keys we set;
a list must match item for item, so an env var or an argument someone added to an owned object
counts as drift (server-side apply alone would keep it: another field manager owns it).

The pod spec, each container and the Service spec are compared whole: a key we do not render there
(hostNetwork, hostPID, a postStart hook, Service externalIPs) is drift unless it is empty or a
value the API server defaults it to (DEFAULTED). `removals()` is the merge patch that takes such
keys out again (server-side apply leaves what another field manager set).
"""

from __future__ import annotations

from typing import Any

_EMPTY = (None, "", [], {}, False, 0)
_ANY = object()
# What the API server fills in where we render nothing (k8s.io/kubernetes pkg/apis/core/v1/defaults.go,
# SetDefaults_PodSpec, SetDefaults_Container, SetDefaults_Service): key -> allowed values (_ANY: any value).
POD_DEFAULTED = {"dnsPolicy": ("ClusterFirst",), "restartPolicy": ("Always", "Never", "OnFailure"),
                 "schedulerName": ("default-scheduler",), "serviceAccountName": ("default",),
                 "serviceAccount": ("default",), "securityContext": _ANY, "terminationGracePeriodSeconds": _ANY,
                 "priority": (0,), "subdomain": _ANY}
CONTAINER_DEFAULTED = {"terminationMessagePath": ("/dev/termination-log",), "terminationMessagePolicy": _ANY,
                       "imagePullPolicy": _ANY, "resources": _ANY}
SERVICE_DEFAULTED = {"clusterIP": _ANY, "clusterIPs": _ANY, "ipFamilies": _ANY, "ipFamilyPolicy": _ANY,
                     "internalTrafficPolicy": ("Cluster",), "sessionAffinity": ("None",),
                     "externalTrafficPolicy": ("Cluster",), "allocateLoadBalancerNodePorts": (True,),
                     "healthCheckNodePort": _ANY}
_POD_PATHS = (".spec.template.spec", ".leaderTemplate.spec", ".workerTemplate.spec")


def _whole(path: str, root_kind: str | None) -> dict | None:
    """The defaulted keys of a level compared whole, or None for a level compared by rendered keys."""
    if path.endswith(_POD_PATHS):
        return POD_DEFAULTED
    tail = path.rsplit(".", 1)[-1]
    if path.endswith("]") and tail.split("[")[0] in ("containers", "initContainers") and \
            any(p in path for p in _POD_PATHS):
        return CONTAINER_DEFAULTED
    if root_kind == "Service" and path == ".spec":
        return SERVICE_DEFAULTED
    return None


def _extra(desired: dict, live: dict, defaulted: dict) -> list[str]:
    out = []
    for k, v in live.items():
        if k in desired or v in _EMPTY:
            continue
        allowed = defaulted.get(k)
        if allowed is _ANY or (allowed is not None and v in allowed):
            continue
        out.append(k)
    return sorted(out)


def removals(desired: Any, live: Any, path: str = "", root_kind: str | None = None) -> dict:
    """A JSON merge patch (null values) removing the keys `differences` counts as not rendered at the
    levels compared whole; {} when there are none. Lists are not entered: a merge patch replaces
    them whole (containers included), which the rendered object itself does."""
    if not path:
        root_kind = desired.get("kind") if isinstance(desired, dict) else None
    if not isinstance(desired, dict) or not isinstance(live, dict):
        return {}
    out: dict = {}
    if (defaulted := _whole(path, root_kind)) is not None:
        out.update({k: None for k in _extra(desired, live, defaulted)})
    for k, v in desired.items():
        if isinstance(v, dict) and (sub := removals(v, live.get(k), f"{path}.{k}", root_kind)):
            out[k] = sub
    return out


def _quantity(v: str):
    from kubernetes.utils.quantity import parse_quantity

    try:
        return parse_quantity(v)
    except ValueError:
        return v


def differences(desired: Any, live: Any, path: str = "", limit: int = 20) -> list[str]:
    out: list[str] = []
    _diff(desired, live, path, out, limit, desired.get("kind") if isinstance(desired, dict) else None)
    return out


def _diff(desired: Any, live: Any, path: str, out: list[str], limit: int, kind: str | None = None) -> None:
    if len(out) >= limit:
        return
    if isinstance(desired, dict):
        if not isinstance(live, dict):
            if not (desired == {} and live in _EMPTY):
                out.append(f"{path or '.'}: expected an object, live has {type(live).__name__}")
            return
        if (defaulted := _whole(path, kind)) is not None:
            out += [f"{path}.{k}: not rendered, live has {live[k]!r}" for k in _extra(desired, live, defaulted)]
        for k, v in desired.items():
            _diff(v, live.get(k), f"{path}.{k}", out, limit, kind)
        return
    if isinstance(desired, list):
        live_list = live if isinstance(live, list) else ([] if live is None else None)
        if live_list is None:
            out.append(f"{path}: expected a list, live has {type(live).__name__}")
        elif len(live_list) != len(desired):
            out.append(f"{path}: {len(desired)} items rendered, live has {len(live_list)}")
        else:
            for i, (d, lv) in enumerate(zip(desired, live_list)):
                _diff(d, lv, f"{path}[{i}]", out, limit, kind)
        return
    if live is None and desired in _EMPTY:
        return
    if desired == live:
        return
    if isinstance(desired, str) and isinstance(live, str) and ".resources." in path + ".":
        if _quantity(desired) == _quantity(live):  # 1000m and 1 are the same CPU
            return
    out.append(f"{path}: rendered {desired!r}, live {live!r}")
