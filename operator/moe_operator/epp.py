"""The InferencePool's endpoint picker (EPP), deployed by the operator (issue 32 item 8). Pure: dicts
from names and numbers; day2.py decides when (a rendered pool whose spec.gateway.inferencePool.
endpointPicker deploys) and render.py sets the owner references.

What the picker needs is read from the Gateway API Inference Extension's tagged release v1.0.1:
its Helm chart config/charts/inferencepool/templates/ (epp-deployment.yaml, epp-service.yaml,
rbac.yaml, leader-election-rbac.yaml, epp-config.yaml) and config/manifests/inferencepool-resources.yaml;
flags from cmd/epp/runner/runner.go and their defaults from pkg/epp/server/runserver.go.

Not rendered: the chart's ClusterRole for tokenreviews/subjectaccessreviews, which only guards the
picker's own /metrics endpoint. A namespaced MoEDeployment cannot own a cluster-scoped binding, so
scraping the picker's metrics needs that binding made by the cluster's admin; routing does not.

Names and labels never meet the workload's: every object is named <service> (default <name>-epp),
its pods carry neither moe.serving.dev/deployment nor app.kubernetes.io/instance=<name>, so the
workload's, the Service's, the PDB's and the pool's selectors do not pick them, and day2's pruning
(kind under the MoEDeployment's name) never reaches them: they are pruned by `stale` instead.
"""

from __future__ import annotations

from typing import Any

IMAGE = "registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"
HEALTH_PORT, METRICS_PORT = 9003, 9090  # runserver.go DefaultGrpcHealthPort, DefaultMetricsPort
PICKER_LABEL = "moe.serving.dev/endpoint-picker"  # value: the MoEDeployment's name
MARKER = "EndpointPicker/"  # status.optionalObjects entry of a deployed picker: EndpointPicker/<service>
KINDS = ("Deployment", "Service", "RoleBinding", "Role", "ServiceAccount")  # deletion order
# The chart's default plugins (epp-config.yaml, v1.0.1), passed as --config-text: no ConfigMap to own.
PLUGINS = """apiVersion: inference.networking.x-k8s.io/v1alpha1
kind: EndpointPickerConfig
plugins:
- type: queue-scorer
- type: kv-cache-utilization-scorer
- type: prefix-cache-scorer
schedulingProfiles:
- name: default
  plugins:
  - pluginRef: queue-scorer
  - pluginRef: kv-cache-utilization-scorer
  - pluginRef: prefix-cache-scorer
"""
# What the picker reads (rbac.yaml, v1.0.1): its pool, the objectives naming it, the pool's pods.
RULES = [{"apiGroups": ["inference.networking.x-k8s.io"], "resources": ["inferenceobjectives"],
          "verbs": ["get", "watch", "list"]},
         {"apiGroups": ["inference.networking.k8s.io"], "resources": ["inferencepools"],
          "verbs": ["get", "watch", "list"]},
         {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "watch", "list"]}]
# More than one replica: leader election (leader-election-rbac.yaml, v1.0.1).
LEADER_RULES = [{"apiGroups": ["coordination.k8s.io"], "resources": ["leases"],
                 "verbs": ["get", "list", "watch", "create", "update", "patch", "delete"]},
                {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "patch"]}]


def labels(name: str, service: str) -> dict[str, str]:
    return {**selector(name, service), "app.kubernetes.io/name": "endpoint-picker",
            "app.kubernetes.io/component": "endpoint-picker", "app.kubernetes.io/part-of": name,
            "app.kubernetes.io/managed-by": "moe-operator"}  # the operator's watch cache selects on this


def selector(name: str, service: str) -> dict[str, str]:
    return {"app.kubernetes.io/instance": service, PICKER_LABEL: name}


def ports(port: int) -> tuple[int, int]:
    """(health, metrics) ports: the release's defaults unless the gRPC port took one."""
    health = HEALTH_PORT if port != HEALTH_PORT else HEALTH_PORT + 1
    metrics = METRICS_PORT if port != METRICS_PORT else METRICS_PORT + 1
    return health, metrics


def args(pool: str, namespace: str, port: int, replicas: int, queue_metric: str, kv_metric: str,
         lora_metric: bool) -> list[str]:
    health, metrics = ports(port)
    out = ["--pool-name", pool, "--pool-namespace", namespace, "--zap-encoder", "json",
           "--grpc-port", str(port), "--grpc-health-port", str(health), "--metrics-port", str(metrics),
           "--config-text", PLUGINS,
           # the engine's names: the release defaults are vLLM's, and its KV default
           # (vllm:gpu_cache_usage_perc) is the name before vLLM's rename to vllm:kv_cache_usage_perc
           "--total-queued-requests-metric", queue_metric, "--kv-cache-usage-percentage-metric", kv_metric]
    if not lora_metric:  # an engine without vllm:lora_requests_info: "" turns the scrape of it off (as the chart does for Triton)
        out += ["--lora-info-metric", ""]
    if replicas > 1:
        out.append("--ha-enable-leader-election")
    return out


def objects(name: str, namespace: str, service: str, port: int, replicas: int, image: str | None,
            queue_metric: str, kv_metric: str, lora_metric: bool) -> list[dict[str, Any]]:
    """Service, ServiceAccount, Role, RoleBinding and Deployment of the picker of pool `name`, in apply
    order (the Deployment's account and rights before its pods)."""
    lab, sel = labels(name, service), selector(name, service)
    meta = {"name": service, "namespace": namespace, "labels": lab}
    health, metrics = ports(port)
    probe_service = ("inference-extension", "inference-extension") if replicas == 1 else ("liveness", "readiness")
    container = {
        "name": "epp", "image": image or IMAGE, "imagePullPolicy": "IfNotPresent",
        "args": args(name, namespace, port, replicas, queue_metric, kv_metric, lora_metric),
        "env": [{"name": "NAMESPACE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}}],
        "ports": [{"name": "grpc", "containerPort": port}, {"name": "grpc-health", "containerPort": health},
                  {"name": "metrics", "containerPort": metrics}],
        "livenessProbe": {"grpc": {"port": health, "service": probe_service[0]}, "initialDelaySeconds": 5,
                          "periodSeconds": 10},
        "readinessProbe": {"grpc": {"port": health, "service": probe_service[1]}, "periodSeconds": 2},
        # the release image is distroless static:nonroot (Dockerfile BASE_IMAGE, v1.0.1)
        "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                            "runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
    }
    deployment = {
        "apiVersion": "apps/v1", "kind": "Deployment", "metadata": meta,
        "spec": {"replicas": replicas,
                 # one active picker; Recreate lets a new one take over at once (epp-deployment.yaml)
                 "strategy": {"type": "Recreate"},
                 "selector": {"matchLabels": sel},
                 "template": {"metadata": {"labels": lab},
                              "spec": {"serviceAccountName": service,
                                       # the release's: as long as the longest grace period of the pool's pods
                                       "terminationGracePeriodSeconds": 130,
                                       "containers": [container]}}},
    }
    service_obj = {"apiVersion": "v1", "kind": "Service", "metadata": dict(meta),
                   "spec": {"type": "ClusterIP", "selector": sel,
                            "ports": [{"name": "grpc-ext-proc", "protocol": "TCP", "port": port, "targetPort": port,
                                       "appProtocol": "http2"},
                                      {"name": "http-metrics", "protocol": "TCP", "port": metrics,
                                       "targetPort": metrics}]}}
    return [
        service_obj,  # first: the name the pool calls, checked first (reconcile skips the rest when it is not ours)
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": dict(meta)},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": dict(meta),
         "rules": RULES + (LEADER_RULES if replicas > 1 else [])},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": dict(meta),
         "subjects": [{"kind": "ServiceAccount", "name": service, "namespace": namespace}],
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": service}},
        deployment,
    ]


def controlled(live: dict[str, Any], uid: str) -> bool:
    """Whether the MoEDeployment of `uid` controls the live object (pruning deletes only those)."""
    return any(r.get("uid") == uid and r.get("controller")
               for r in (live.get("metadata") or {}).get("ownerReferences") or [])


def not_owned(obj: dict[str, Any], live: dict[str, Any] | None, uid: str) -> str | None:
    """Why the rendered picker object must not be applied over `live`, None when it may: an object of
    that name the MoEDeployment does not control is someone's (a picker deployed by hand behind
    <name>-epp, as the condition used to advise, or another MoEDeployment named <name>-epp), and a
    forced apply would take its fields over."""
    if live is None or controlled(live, uid):
        return None
    refs = (live.get("metadata") or {}).get("ownerReferences") or []
    m = obj["metadata"]
    owner = next((f"{r.get('kind')} {r.get('name')}" for r in refs if r.get("controller")), None)
    return (f"{obj['kind']} {m['name']} exists and is {'controlled by ' + owner if owner else 'not owned by it'}: "
            f"the endpoint picker is not deployed over it; set spec.gateway.inferencePool.endpointPicker.deploy "
            f"false to use yours, or name another in endpointPicker.name")


def is_picker(obj: dict[str, Any]) -> bool:
    return PICKER_LABEL in ((obj.get("metadata") or {}).get("labels") or {})


def markers(objs: list[dict[str, Any]]) -> list[str]:
    """status.optionalObjects entries of the pickers among `objs`."""
    return sorted({MARKER + o["metadata"]["name"] for o in objs if is_picker(o)})


def stale(before: list[str], now: list[str]) -> list[tuple[str, str]]:
    """(kind, name) of the picker objects rendered before and no longer (deploy turned off, the pool
    gone, the Service renamed)."""
    return [(kind, entry[len(MARKER):]) for entry in sorted(set(before) - set(now)) if entry.startswith(MARKER)
            for kind in KINDS]
