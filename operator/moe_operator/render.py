"""Rendering: (MoEDeployment, placement, plan) -> Kubernetes objects, with jinja2 templates kept as files.

Pure: returns dicts. A replica that fits one node becomes a Deployment, a multi-node replica a
LeaderWorkerSet; both get a Service and a ConfigMap holding the plan the runtime re-checks.
Each engine renders its own image, command and flags from the same plan (engines/<engine>/command.py,
asked through engines.registry).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jinja2
import yaml

from . import day2
from .api import MoEDeploymentSpec
from .engines import registry as engines
from .engines.command import Launch
from .field_manager import FIELD_MANAGER  # noqa: F401  (kube.py imports it from here)
from moe_core.gpu import GpuClass
from . import images
from . import model_cache, pod_overlay
from .images import Registries, runtime_image
from .model_uri import ModelURI
from .security import container_security, pod_security, runtime_pod_security
from moe_core.plan import Plan

TEMPLATES = Path(__file__).parent / "templates"
_env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATES)), undefined=jinja2.StrictUndefined,
                          keep_trailing_newline=True)
_env.policies["json.dumps_kwargs"] = {"sort_keys": False}

PORT = 8000
DIST_PORT = 29500  # torch.distributed rendezvous of a bundled multi-node replica (moe-runtime serve --dist-port)
PLAN_DIR = "/etc/moe"
CACHE_DIR = "/var/cache/moe"


@dataclass(frozen=True)
class Owner:
    name: str
    namespace: str
    uid: str


@dataclass(frozen=True)
class ModelLocation:
    """Where the engine reads the model from, and the volumes that put it there."""

    path: str  # what the engine gets as the model argument
    volumes: list[dict[str, Any]]
    mounts: list[dict[str, Any]]
    init_containers: list[dict[str, Any]]
    extra_env: list[dict[str, Any]]
    extra_args: list[str]


def model_location(spec: MoEDeploymentSpec, engine: str, image: str) -> ModelLocation:
    uri = ModelURI.parse(spec.model.uri)
    token_env = []
    if spec.model.tokenSecretRef:
        ref = spec.model.tokenSecretRef
        token_env = [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}}]
    if uri.scheme == "pvc" and model_cache.enabled(spec):
        # the copy of the claim in the cache PVC (the storage class the spec asked for), read-only
        # behind the ready check; sglang/vllm keep serving it under the source path's name
        parts = model_cache.pod_parts(spec, image)
        return ModelLocation(model_cache.MOUNT, [parts.volume], [parts.mount], [parts.init_container], [], [])
    if uri.scheme in ("file", "pvc"):
        volume, mount, path = uri.volume()
        return ModelLocation(path, [volume], [mount], [], [], [])
    repo, revision = uri.repo, uri.revision
    # the pinned hub commit (status.revision) in the environment too, for engines and tools that read it
    token_env = token_env + ([{"name": "HF_REVISION", "value": revision}] if revision else [])
    # a container that downloads from the hub itself goes where the operator goes (its configured
    # mirror), never where a tenant's env would send the token (env_policy refuses HF_ENDPOINT there)
    if (endpoint := model_cache.hub_endpoint()):
        token_env = token_env + [{"name": "HF_ENDPOINT", "value": endpoint}]
    if model_cache.enabled(spec) and revision:
        # the shared cache PVC of (model, revision), read-only; the engine reads the local copy (no
        # token, no hub); the served name is spec.model.servedName as for every source
        parts = model_cache.pod_parts(spec, image)
        return ModelLocation(model_cache.MOUNT, [parts.volume], [parts.mount], [parts.init_container],
                             [{"name": "HF_REVISION", "value": revision}, {"name": "HF_HUB_OFFLINE", "value": "1"}], [])
    cache = {"name": "hf-cache", "emptyDir": {}}
    if engines.get(engine).serves_local_dir:
        # The bundled runtime serves a local directory: fetch it first (weights included) in an init container.
        dl_args = ["download", repo, "--local-dir", "/models/hf"] + (["--revision", revision] if revision else [])
        init = [{"name": "fetch-model", "image": image, "command": ["hf"], "args": dl_args, "env": token_env,
                 "securityContext": container_security(),
                 "volumeMounts": [{"name": "hf-cache", "mountPath": "/models"}]}]
        # the engine serves the fetched directory: the token stays in the init container that downloads
        revision_env = [{"name": "HF_REVISION", "value": revision}] if revision else []
        return ModelLocation("/models/hf", [cache], [{"name": "hf-cache", "mountPath": "/models"}], init, revision_env, [])
    extra = ["--revision", revision] if revision else []
    return ModelLocation(repo, [cache], [{"name": "hf-cache", "mountPath": "/root/.cache/huggingface"}], [], token_env, extra)


def engine_image(spec: MoEDeploymentSpec, plan: Plan, gpu: GpuClass, runtime_repository: str | None = None,
                 registries: Registries | None = None) -> str:
    """The image the pods run: spec.engine.image, else the engine's default from the configured
    registries (images.Registries: the chart's runtimeImage/engineImages)."""
    if spec.engine.image:
        return spec.engine.image
    if runtime_repository and engines.get(spec.engine.name).runs_runtime_image:  # the caller's repository (reconcile's Config)
        r = registries or images.REGISTRIES
        return runtime_image(gpu, runtime_repository, r.runtime_tag)
    return images.default_image(spec.engine.name, plan.engine.version, gpu, registries)  # per CPU arch


def served_name(spec: MoEDeploymentSpec, name: str) -> str:
    """The model id clients send: spec.model.servedName, default the MoEDeployment's name."""
    return spec.model.servedName or name


def endpoint(name: str, namespace: str, spec: MoEDeploymentSpec) -> str:
    """The OpenAI-compatible base URL of the Service, inside the cluster (status.endpoint)."""
    return f"http://{name}.{namespace}.svc:{spec.service.port}/v1"


def engine_command(spec: MoEDeploymentSpec, plan: Plan, loc: ModelLocation, role: str,
                   served: str) -> tuple[list[str], list[str]]:
    """The engine's command and arguments: the operator's flags, the plan's, then spec.engine.args
    (engine_args.py refuses the flags the first two own, so the user's never override them)."""
    engine = engines.get(spec.engine.name)
    max_len = spec.engine.maxModelLen  # what sizing sized the KV cache for: the engine must not take more
    extra = [*loc.extra_args, "--served-model-name", served]
    if max_len:
        extra += [engine.max_len_flag, str(max_len)]
    command, args = engine.command(Launch(model=loc.path, extra=extra, plan_args=list(plan.args),
                                          nodes=spec.nodesPerReplica, role=role, port=PORT,
                                          plan_file=f"{PLAN_DIR}/plan.json", dist_port=DIST_PORT))
    return command, args + list(spec.engine.args)


def bundled_lws_env() -> list[dict[str, Any]]:
    """The rendezvous env of a bundled multi-node pod. The LeaderWorkerSet pod webhook sets LWS_LEADER_ADDRESS,
    LWS_GROUP_SIZE and LWS_WORKER_INDEX itself (its values replace ones of the same name in the template);
    the group size and worker index are also given here from the pod's own LWS annotation and label (the
    downward API), so a pod whose webhook predates LWS_WORKER_INDEX (LWS < 0.6) still knows its place.
    `moe-runtime serve` reads them (moe_runtime.parallel.rendezvous): global rank = LWS_WORKER_INDEX x GPUs
    per node + local GPU, the group's rank 0 on the leader pod."""
    return [
        {"name": "LWS_GROUP_SIZE", "valueFrom": {"fieldRef": {"fieldPath": "metadata.annotations['leaderworkerset.sigs.k8s.io/size']"}}},
        {"name": "LWS_WORKER_INDEX", "valueFrom": {"fieldRef": {"fieldPath": "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"}}},
    ]


def inputs_hash(spec: MoEDeploymentSpec, plan: Plan, gpu: GpuClass, image: str) -> str:
    """Hash of what decides the pods: the plan's decisions (not its prose), GPU class, image, model.

    Stamped on the workload and pod template so pods roll only when a decision really changes.
    """
    data = {"moe": plan.moe.model_dump(), "env": plan.env, "args": plan.args, "gpu": gpu.key(),
            "format": plan.checkpoint.format, "engine": plan.engine.model_dump(), "image": image,
            "model": spec.model.uri, "per_node": spec.gpus_per_node(), "nodes": spec.nodesPerReplica,
            "resources": spec.resources.model_dump(), "tolerations": [t.model_dump() for t in spec.tolerations],
            "nodeSelector": spec.nodeSelector}
    # keys only when set, so objects without them keep the hash (and their pods) they had
    if spec.engine.args:
        data["engineArgs"] = spec.engine.args
    if spec.podTemplate:
        data["podTemplate"] = spec.podTemplate.overlay()
    if spec.model.servedName:
        data["servedName"] = spec.model.servedName
    return hashlib.sha256(json.dumps(data, sort_keys=True).encode()).hexdigest()[:16]


def _affinity(gpu: GpuClass) -> list[tuple[str, str]]:
    if gpu.is_rocm:
        out = [("amd.com/gpu.product-name", gpu.product)] if gpu.product and gpu.product != gpu.family else []
    else:
        major = (gpu.computeCapability or "").split(".")[0]
        out = [("nvidia.com/gpu.compute.major", major)] if major else []
        if gpu.product and gpu.product != gpu.family:
            out.append(("nvidia.com/gpu.product", gpu.product))
    out.append(("kubernetes.io/arch", gpu.arch))
    return out


def _resources(spec: MoEDeploymentSpec, gpu: GpuClass) -> dict[str, Any]:
    gpu_key = "amd.com/gpu" if gpu.is_rocm else "nvidia.com/gpu"
    limits = {gpu_key: str(spec.gpus_per_node()), **spec.resources.limits}
    requests = dict(spec.resources.requests)
    out: dict[str, Any] = {"limits": limits}
    if requests:
        out["requests"] = requests
    return out


def _tolerations(spec: MoEDeploymentSpec, gpu: GpuClass) -> list[dict[str, Any]]:
    gpu_key = "amd.com/gpu" if gpu.is_rocm else "nvidia.com/gpu"
    tols = [t.model_dump(exclude_none=True) for t in spec.tolerations]
    if not any(t.get("key") == gpu_key for t in tols):
        tols.append({"key": gpu_key, "operator": "Exists", "effect": "NoSchedule"})
    return tols


def _yaml_block(d: dict[str, str]) -> str:
    return yaml.safe_dump(d, sort_keys=True).rstrip("\n")


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment", "name": owner.name,
            "uid": owner.uid, "controller": True, "blockOwnerDeletion": True}


def engine_cache_volume(owner: Owner, gpu: GpuClass, plan: Plan, host_root: str | None) -> dict[str, Any]:
    """Autotune cache keyed by (arch, engine version) (rule E1). On the node only where the admin
    gave a root for it, and then one directory per namespace: a writable host directory shared
    by every tenant would let one tenant's pods poison another's kernels."""
    if not host_root:
        return {"name": "engine-cache", "emptyDir": {}}
    key = f"{gpu.family}-{plan.engine.name}{plan.engine.version}"
    return {"name": "engine-cache", "hostPath": {"path": f"{host_root.rstrip('/')}/{owner.namespace}/{key}",
                                                 "type": "DirectoryOrCreate"}}


def render(owner: Owner, spec: MoEDeploymentSpec, plan: Plan, gpu: GpuClass,
           runtime_repository: str | None = None, engine_cache_root: str | None = None,
           rollout: day2.Rollout | None = None, registries: Registries | None = None) -> list[dict[str, Any]]:
    """All objects for one MoEDeployment, owner references set, ready for server-side apply.

    `rollout`: maxSurge/maxUnavailable from the free capacity the inventory sees (day2.rollout_policy);
    None renders the no-spare-capacity policy (one replica at a time), or the spec's own numbers.
    `registries`: default images and operator-wide pull secrets (None: what `moe-operator run` configured).
    spec.podTemplate and the pull secrets are merged into every pod template after rendering."""
    registries = registries or images.REGISTRIES
    image = engine_image(spec, plan, gpu, runtime_repository, registries)
    served = served_name(spec, owner.name)
    loc = model_location(spec, spec.engine.name, image)
    engine = engines.get(spec.engine.name)
    h = inputs_hash(spec, plan, gpu, image)
    selector = {"app.kubernetes.io/instance": owner.name, "moe.serving.dev/deployment": owner.name}
    labels = {**selector, "app.kubernetes.io/name": "moe-inference", "app.kubernetes.io/managed-by": "moe-operator",
              "moe.serving.dev/gpu-family": gpu.family, "moe.serving.dev/engine": spec.engine.name}
    env = [{"name": k, "value": v} for k, v in plan.env.items()] + loc.extra_env
    volumes = [{"name": "plan", "configMap": {"name": f"{owner.name}-plan"}},
               {"name": "dshm", "emptyDir": {"medium": "Memory"}}] + loc.volumes
    mounts = [{"name": "plan", "mountPath": PLAN_DIR, "readOnly": True},
              {"name": "dshm", "mountPath": "/dev/shm"}] + loc.mounts
    if "SGLANG_CACHE_DIR" in plan.env:
        volumes.append(engine_cache_volume(owner, gpu, plan, engine_cache_root))
        mounts.append({"name": "engine-cache", "mountPath": plan.env["SGLANG_CACHE_DIR"]})

    def pod(role: str) -> str:
        command, args = engine_command(spec, plan, loc, role, served)
        pod_env = env
        if engine.rendezvous and role in ("leader", "worker"):
            pod_env = bundled_lws_env() + env
        return _env.get_template("_pod.yaml.j2").render(
            labels=_yaml_block({**labels, "moe.serving.dev/role": role, **day2.pool_pod_labels(spec, role)}),
            inputs_hash=h, plan=plan,
            affinity=_affinity(gpu), node_selector=spec.nodeSelector, tolerations=_tolerations(spec, gpu),
            init_containers=loc.init_containers, image=image, command=command, args=args, env=pod_env, port=PORT,
            dist_port=DIST_PORT if engine.rendezvous and role == "leader" else None,
            resources=_resources(spec, gpu), ready_path=engine.ready_path,
            volume_mounts=mounts, volumes=volumes, role=role, pod_security=pod_security(spec.engine.name),
            container_security=container_security()).rstrip("\n")

    common = dict(name=owner.name, namespace=owner.namespace, labels=_yaml_block(labels), inputs_hash=h,
                  gpu_class=gpu.key())
    rollout = rollout or day2.rollout_policy(spec, gpu.key(), 0)
    strategy = dict(max_surge=rollout.max_surge, max_unavailable=rollout.max_unavailable)
    objects = [yaml.safe_load(_env.get_template("plan-configmap.yaml.j2").render(
        **common, plan_json=plan.model_dump_json(indent=2)))]
    if spec.nodesPerReplica > 1:
        workload = yaml.safe_load(_env.get_template("leaderworkerset.yaml.j2").render(
            **common, **strategy, replicas=spec.replicas, group_size=spec.nodesPerReplica,
            leader_pod=pod("leader"), worker_pod=pod("worker")))
        service_selector = {**selector, "leaderworkerset.sigs.k8s.io/worker-index": "0"}
        pods = workload["spec"]["leaderWorkerTemplate"]
        for key in ("leaderTemplate", "workerTemplate"):
            pods[key] = _overlay(pods[key], spec, registries)
    else:
        workload = yaml.safe_load(_env.get_template("deployment.yaml.j2").render(
            **common, **strategy, replicas=spec.replicas, selector=_yaml_block(selector), pod=pod("single")))
        workload["spec"]["template"] = _overlay(workload["spec"]["template"], spec, registries)
        service_selector = selector
    objects.append(yaml.safe_load(_env.get_template("service.yaml.j2").render(
        **common, service_type=spec.service.type, service_port=spec.service.port,
        service_selector=_yaml_block(service_selector))))
    objects.append(workload)  # after the ConfigMap it mounts and the Service
    # PDB, autoscaler, InferencePool: after the workload (an optional CRD missing must not hold it back)
    objects += day2.objects(owner.name, owner.namespace, labels, selector, PORT, spec)
    for obj in objects:
        obj["metadata"]["ownerReferences"] = [owner_reference(owner)]
    return objects


def _overlay(pod: dict[str, Any], spec: MoEDeploymentSpec, registries: Registries) -> dict[str, Any]:
    """Operator-wide pull secrets, then spec.podTemplate (validated by the API model), into one pod template."""
    template = spec.podTemplate.overlay() if spec.podTemplate else None
    return pod_overlay.apply(pod, template, container_security(), registries.pull_secrets)


def inspection_job(namespace: str, name: str, uri: str, image: str, owner: Owner) -> dict[str, Any]:
    """The Job that runs `moe-runtime inspect` where the operator cannot read the model (pvc://,
    file:// paths only nodes see); the result comes back as the container's termination message.
    Locked down like the engine pods; pinned to amd64 nodes because its image is the amd64 one."""
    volume, mount, path = ModelURI.parse(uri).volume()
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "moe-operator", "moe.serving.dev/role": "inspect",
                                "moe.serving.dev/deployment": owner.name},
                     "ownerReferences": [owner_reference(owner)]},
        "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": 600, "template": {"spec": {
            "restartPolicy": "Never",
            "automountServiceAccountToken": False,
            "enableServiceLinks": False,
            "nodeSelector": {"kubernetes.io/arch": "amd64"},
            "securityContext": runtime_pod_security(),  # the runtime image's (moe-runtime inspect)
            **({"imagePullSecrets": [{"name": n} for n in images.REGISTRIES.pull_secrets]}
               if images.REGISTRIES.pull_secrets else {}),
            "containers": [{"name": "inspect", "image": image, "command": ["moe-runtime", "inspect", path,
                                                                           "--termination-log", "/dev/termination-log"],
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                            "securityContext": container_security(),
                            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}, "limits": {"memory": "512Mi"}},
                            "volumeMounts": [mount]}],
            "volumes": [volume]}}},
    }
