"""The MoEDeployment API (moe.serving.dev/v1alpha1): pydantic v2 models of spec and status.

These models are the single source of truth: `crd.py` generates the CRD's OpenAPI schema from
them (plus the CEL rules declared here), and a test checks that crds/moedeployments.yaml is what
the generator produces.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from moe_core import registry
from moe_core.checkpoint import CheckpointInfo
from moe_core.formats import FORMATS
from moe_core.gpu import FAMILIES
from moe_core.plan import Plan
from moe_core.runtime import BUNDLED

from . import engine_args, env_policy, image_ref, pod_overlay
from .image_ref import IMAGE_PATTERN
from .engines.vocabulary import ALL_A2A, ALL_RUNNERS, sglang as _sglang, vllm as _vllm


def _cel_list(values) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"

# A revision may not start with '-' (it reaches engines as a command-line argument) or '.'.
# pvc:// sub-paths: letters, digits and ._+=@- per segment (no quote, space, '$' or ';' can reach any
# command line or path the operator builds from it).
PVC_SEGMENT = r"[A-Za-z0-9._+=@-]+"
MODEL_URI_PATTERN = (r"^(hf://[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*(@[A-Za-z0-9_][A-Za-z0-9._/-]*)?"
                     r"|pvc://[a-z0-9]([-a-z0-9]*[a-z0-9])?(/" + PVC_SEGMENT + r")*/?|file:///.*)$")
ENV_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]*$"
# an OpenAI model id: no space or quote (it reaches a command line); '/' and ':' as hub ids have them
SERVED_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._/:@+-]*$"

# Env names a MoEDeployment may not set, by class of harm: env_policy.py (the one list the CEL rules
# and the pydantic validators are both made from).
ENV_TOTAL_BYTES = 65536  # names + values; keeps status.plan and kopf's annotations far below their limits

# metadata.name becomes a Service name (DNS-1035 label), label values (63) and pod names with
# LeaderWorkerSet suffixes: refuse at admission what the API server would refuse later.
NAME_MAX = 52
NAME_RULES = [
    {"rule": f"self.metadata.name.size() <= {NAME_MAX}",
     "message": f"metadata.name must be at most {NAME_MAX} characters (it names the Service, labels and pods)"},
    # A LeaderWorkerSet names a worker StatefulSet <name>-<group> per replica, whose pods carry the label
    # controller-revision-hash=<name>-<group>-<hash of up to 10> (63 at most): the name leaves room for
    # the largest group index the replicas (or the autoscaler's maximum) reach.
    {"rule": "self.spec.nodesPerReplica <= 1 || self.metadata.name.size() + string(("
             "self.spec.autoscaling.enabled && self.spec.autoscaling.maxReplicas > self.spec.replicas ? "
             "self.spec.autoscaling.maxReplicas : self.spec.replicas) - 1).size() + 12 <= 63",
     "message": "metadata.name is too long for a multi-node MoEDeployment: <name>-<replica index>-<10-character hash> "
     "names its pods' revision label, at most 63 characters"},
    {"rule": "self.metadata.name.matches('^[a-z]([-a-z0-9]*[a-z0-9])?$')",
     "message": "metadata.name must be a DNS-1035 label (lower case letters, digits and '-', starting with a letter): it names the Service"},
    # a deployed picker is a Deployment and a Service named endpointPicker.name: under the object's own
    # name they would be applied over the workload's Deployment and Service (same owner)
    {"rule": "!has(self.spec.gateway) || !has(self.spec.gateway.inferencePool) || "
             "!has(self.spec.gateway.inferencePool.endpointPicker) || "
             "!has(self.spec.gateway.inferencePool.endpointPicker.name) || "
             "self.spec.gateway.inferencePool.endpointPicker.name != self.metadata.name",
     "message": "spec.gateway.inferencePool.endpointPicker.name must differ from metadata.name: the workload's "
     "Deployment and Service have that name"},
]
LABEL_KEY_PATTERN = r"^([a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?[A-Za-z0-9]([-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$"
LABEL_VALUE_PATTERN = r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$"


def _cel(*rules: tuple[str, str]) -> dict:
    return {"x-kubernetes-validations": [{"rule": r, "message": m} for r, m in rules]}


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class SecretKeyRef(_Model):
    name: str = Field(min_length=1, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$",
                      description="Secret in the MoEDeployment's namespace; it must carry the label moe.serving.dev/model-token=true")
    key: str = Field("token", min_length=1, max_length=253, pattern=r"^[-._a-zA-Z0-9]+$",
                     description="key of the Secret's data holding the token")


class ModelSource(_Model):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_cel(
        ("!self.uri.contains('/../') && !self.uri.endsWith('/..') && !self.uri.contains('/./') && !self.uri.endsWith('/.')",
         "model.uri must not contain '.' or '..' path segments"),
    ))
    uri: str = Field(pattern=MODEL_URI_PATTERN, max_length=2048,
                     description="hf://org/name[@revision], pvc://claim/sub/path or file:///path")
    format: Literal[("auto",) + FORMATS] = Field(  # type: ignore[valid-type]
        "auto", description="checkpoint format; 'auto' inspects config.json, hf_quant_config.json and safetensors headers")
    architecture: str | None = Field(None, max_length=128,
                                     description="config.json architectures[0]; only needed when format is explicit (inspection skipped)")
    tokenSecretRef: SecretKeyRef | None = Field(None, description="Hugging Face token for gated hf:// repositories")
    revisionPolicy: Literal["pin", "follow"] = Field("pin", description=(
        "hf:// without @revision: pin resolves the hub's commit at first use and keeps it (status.revision) until "
        "the spec changes; follow re-resolves it, so a new upload rolls the pods"))
    cache: ModelCache = Field(default_factory=lambda: ModelCache(), description=(
        "hf:// only: download the model once into a PVC per (model, revision) shared by every MoEDeployment "
        "of the namespace, mounted read-only"))
    servedName: str | None = Field(None, min_length=1, max_length=256, pattern=SERVED_NAME_PATTERN, description=(
        "the model id clients send (OpenAI 'model'), given to every engine as --served-model-name; "
        "default: the MoEDeployment's name (status.modelName says which)"))


class EngineSpec(_Model):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_cel(
        ("self.name == 'bundled' || !has(self.flashinferVersion) || self.flashinferVersion != ''",
         "flashinferVersion must not be empty"),
    ))
    name: Literal["bundled", "sglang", "vllm"] = Field("bundled", description="inference engine the pods run")
    version: str | None = Field(None, pattern=r"^v?[0-9]+\.[0-9]+(\.[0-9]+)?([.-][0-9A-Za-z.]+)?$", max_length=64,
                                description="engine version (tuning rules are version dependent); default: the tested release")
    image: str | None = Field(None, max_length=512, pattern=IMAGE_PATTERN,
                              description="container image reference (registry/path[:tag][@digest]); default: follows the engine and the node")

    @field_validator("image")
    @classmethod
    def _reference(cls, v: str | None) -> str | None:
        if v is not None:
            image_ref.parse(v)  # ValueError names what is wrong
        return v
    flashinferVersion: str | None = Field(None, max_length=32,
                                          description="flashinfer-python in a custom image ('none' if absent); default: the engine's pin")
    maxModelLen: int | None = Field(None, ge=16, le=16777216, description=(
        "longest sequence (prompt + output) the KV cache is sized for; default config.json max_position_embeddings"))
    maxConcurrency: int | None = Field(None, ge=1, le=65536, description=(
        "sequences of maxModelLen the KV cache must hold at once (sizing); default 1, the engines' own start-up check"))
    args: list[Annotated[str, Field(max_length=engine_args.MAX_ARG_CHARS)]] = Field(
        default_factory=list, max_length=engine_args.MAX_ARGS, description=(
            "extra engine command-line arguments, one token per item (e.g. --max-num-seqs, 256), appended after "
            "the operator's; the flags the operator or the planner set (model, port, parallelism, MoE and "
            "attention backends, served name, maxModelLen) are refused with the field to use instead"))

    @model_validator(mode="after")
    def _args_not_owned(self) -> "EngineSpec":
        if (why := engine_args.refusals(self.name, self.args)):
            raise ValueError("; ".join(why))
        return self


class Parallelism(_Model):
    tp: int | None = Field(None, ge=1, le=64, description=(
        "tensor parallel size; unset (and gpusPerReplica unset): the smallest that fits the checkpoint's weights "
        "and KV cache in the GPU class's memory"))
    ep: int = Field(1, ge=1, le=64, description="expert parallel size")
    dp: int = Field(1, ge=1, le=64, description="data parallel (attention) size")


class MoESpec(_Model):
    runnerBackend: Literal[ALL_RUNNERS] = Field("auto", description="MoE kernel backend; 'auto' lets the planner choose")  # type: ignore[valid-type]
    a2aBackend: Literal[ALL_A2A] = Field("none", description="all-to-all backend for expert parallelism")  # type: ignore[valid-type]
    deferredFinalize: Literal["auto", "on", "off"] = Field(
        "auto", description="fuse the top-k reduction with the shared-expert add (moe_finalize_fuse_shared)")


class EnvVar(_Model):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_cel(*env_policy.cel_item_rules()))
    name: str = Field(pattern=ENV_NAME_PATTERN, max_length=256, description=(
        "variable name; names that reach GPU access, load code, or that the operator sets are refused"))
    value: str = Field("", max_length=32768, description="variable value")

    @field_validator("name")
    @classmethod
    def _not_reserved(cls, v: str) -> str:
        if (why := env_policy.refusal(v)):
            raise ValueError(why)
        return v


class GpuSelection(_Model):
    allowedArchitectures: list[Literal[FAMILIES]] = Field(  # type: ignore[valid-type]
        default_factory=list, max_length=len(FAMILIES),
        description="GPU architectures the operator may place this on (empty: any that can run it)")
    product: str | None = Field(None, max_length=63, pattern=LABEL_VALUE_PATTERN,
                                description="pin to one nvidia.com/gpu.product")


# What the API server refuses in a pod's tolerations (core validation), refused here at admission
# instead of as a ReplicaSet that silently cannot create pods.
TOLERATION_RULES = [
    ("!has(self.tolerationSeconds) || (has(self.effect) && self.effect == 'NoExecute')",
     "tolerationSeconds applies only to effect NoExecute",
     lambda t: t.tolerationSeconds is None or t.effect == "NoExecute"),
    ("!has(self.operator) || self.operator != 'Exists' || !has(self.value) || self.value == ''",
     "a toleration with operator Exists must have no value",
     lambda t: t.operator != "Exists" or not t.value),
    ("has(self.key) || (has(self.operator) && self.operator == 'Exists')",
     "a toleration without a key must use operator Exists",
     lambda t: t.key is not None or t.operator == "Exists"),
]


class Toleration(_Model):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_cel(*[(r, m) for r, m, _ in TOLERATION_RULES]))
    key: str | None = Field(None, max_length=316, pattern=LABEL_KEY_PATTERN,
                            description="taint key the toleration matches (unset: every key, with operator Exists)")
    operator: Literal["Exists", "Equal"] | None = Field(None, description="Equal (default) or Exists")
    value: str | None = Field(None, max_length=63, pattern=LABEL_VALUE_PATTERN, description="taint value (operator Equal)")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        None, description="taint effect matched (unset: all)")
    # int64 as Kubernetes has it: `format: int64` in the schema, the range checked here only (the
    # API server stores a CRD's minimum/maximum as float64, so int64 bounds there never compare
    # equal to the manifest and every `kubectl apply` reports the CRD "configured")
    tolerationSeconds: int | None = Field(None, json_schema_extra={"format": "int64"}, description=(
        "NoExecute only: seconds the pod stays bound after the taint appears (unset: forever)"))

    @field_validator("tolerationSeconds")
    @classmethod
    def _int64(cls, v: int | None) -> int | None:
        if v is not None and not -(2 ** 63) <= v < 2 ** 63:
            raise ValueError("tolerationSeconds must fit in a 64-bit integer")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> "Toleration":
        for _, msg, ok in TOLERATION_RULES:
            if not ok(self):
                raise ValueError(msg)
        return self


# Map keys cannot be bounded in a CRD schema, so CEL over them costs too much for the API server's
# budget: keys are checked by the pydantic model (the webhook and the reconcile), values by the
# schema (pattern, maxLength) and, for quantities, by CEL isQuantity on bounded strings.
QUANTITY_PATTERN = r"^[+-]?([0-9]+(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+|[numkMGTPE]|[KMGTPE]i)?$"
LabelKey = Annotated[str, Field(pattern=LABEL_KEY_PATTERN, max_length=316)]
LabelValue = Annotated[str, Field(pattern=LABEL_VALUE_PATTERN, max_length=63)]
Quantity = Annotated[str, Field(pattern=QUANTITY_PATTERN, max_length=64)]
_QUANTITIES = ("self.all(k, isQuantity(self[k]))", "resource values must be Kubernetes quantities (e.g. 500m, 64Gi)")


class ModelCache(_Model):
    enabled: bool | None = Field(None, description=(
        "hf://: download into a shared PVC instead of every pod's emptyDir; unset: the operator's default (chart value "
        "modelCache.enabled, off unless the admin turns it on). pvc://: true copies the claim into a PVC of "
        "storageClassName (e.g. a faster class) that the pods mount instead; only when set here"))
    storageClassName: str | None = Field(None, max_length=253, pattern=r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$", description=(
        "StorageClass of the PVC (default: the chart value modelCache.storageClassName, else the cluster's default class)"))
    size: Quantity | None = Field(None, description="PVC size (default: the checkpoint's bytes + 10%, at least 1Gi)")
    accessMode: Literal["ReadWriteOnce", "ReadWriteMany", "ReadWriteOncePod"] = Field(
        "ReadWriteMany", description="ReadWriteMany lets replicas on several nodes share it; ReadWriteOnce keeps them on one node")


class Resources(_Model):
    requests: dict[LabelKey, Quantity] = Field(default_factory=dict, max_length=32, json_schema_extra=_cel(_QUANTITIES),
                                               description="engine container requests (e.g. cpu, memory)")
    limits: dict[LabelKey, Quantity] = Field(default_factory=dict, max_length=32, json_schema_extra=_cel(_QUANTITIES),
                                             description="engine container limits; the GPU limit is the operator's (GPUs per node)")


class ServiceSpec(_Model):
    type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = Field(
        "ClusterIP", description="Service type (the admin's policy may allow only ClusterIP)")
    port: int = Field(8000, ge=1, le=65535, description="Service port of the OpenAI-compatible API (status.endpoint)")


# --- day-2: rollout, disruption budget, autoscaling, gateway (issue 22) ---------------------------

class RolloutSpec(_Model):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_cel(
        ("!has(self.maxSurge) || !has(self.maxUnavailable) || self.maxSurge + self.maxUnavailable > 0",
         "rollout.maxSurge and rollout.maxUnavailable must not both be 0 (the roll could never start)"),
    ))
    maxSurge: int | None = Field(None, ge=0, le=1000, description=(
        "replicas created above spec.replicas during a roll; default: 1 when the inventory sees a spare GPU set "
        "of the planned class, else 0"))
    maxUnavailable: int | None = Field(None, ge=0, le=1000, description=(
        "replicas that may be down during a roll; default: 0 when a spare GPU set of the class is free, else 1 "
        "(replace one replica at a time instead of waiting for a GPU that never frees)"))
    minAvailable: int | None = Field(None, ge=0, le=1000, description=(
        "PodDisruptionBudget: replicas kept through voluntary disruptions (node drains); default replicas - 1. "
        "A budget is rendered only when replicas > 1"))


AUTOSCALING_METRICS = ("queue", "kv")


class AutoscalingSpec(_Model):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_cel(
        # has() guards: the CRD's default ({}) is checked against these rules before field defaults apply
        ("!has(self.minReplicas) || !has(self.maxReplicas) || self.minReplicas <= self.maxReplicas",
         "autoscaling.minReplicas must not exceed autoscaling.maxReplicas"),
        ("!has(self.minReplicas) || self.minReplicas > 0 || (has(self.provider) && self.provider == 'keda')",
         "autoscaling.minReplicas 0 (scale to zero) needs provider keda (the HPA cannot scale to zero)"),
        ("!has(self.provider) || self.provider != 'keda' || has(self.prometheusAddress)",
         "autoscaling.provider keda reads Prometheus: set autoscaling.prometheusAddress"),
        ("!has(self.metric) || self.metric != 'kv' || !has(self.target) || self.target <= 100",
         "autoscaling.target for metric kv is a percentage of the KV cache (1-100)"),
    ))
    enabled: bool = Field(False, description="render an autoscaler targeting this MoEDeployment's scale subresource")
    provider: Literal["hpa", "keda"] = Field("hpa", description=(
        "hpa: autoscaling/v2 HorizontalPodAutoscaler on a Pods metric (needs a custom-metrics adapter, e.g. "
        "prometheus-adapter); keda: a KEDA ScaledObject with a Prometheus trigger (needs KEDA installed)"))
    minReplicas: int = Field(1, ge=0, le=1000, description="lower bound; 0 (scale to zero, keda only) is off by default")
    maxReplicas: int = Field(4, ge=1, le=1000, description="upper bound of the autoscaler")
    metric: Literal[AUTOSCALING_METRICS] = Field("queue", description=(  # type: ignore[valid-type]
        "queue: requests waiting per replica (vllm:num_requests_waiting, sglang:num_queue_reqs); "
        "kv: KV-cache use in percent (vllm:kv_cache_usage_perc, sglang:token_usage)"))
    target: int | None = Field(None, ge=1, le=100000, description=(
        "target per replica: waiting requests (queue, default 4) or KV-cache percent (kv, default 80)"))
    metricName: str | None = Field(None, max_length=128, pattern=r"^[A-Za-z_][A-Za-z0-9_:.-]*$", description=(
        "hpa: the Pods metric's name as the custom-metrics adapter serves it; default the engine's Prometheus "
        "name with ':' as '_' (e.g. vllm_num_requests_waiting)"))
    prometheusAddress: str | None = Field(None, max_length=512, pattern=r"^https?://\S+$",
                                          description="keda: Prometheus the trigger queries, e.g. http://prometheus.monitoring:9090")


class EndpointPickerRef(_Model):
    # a Service name (DNS-1035 label); a deployed picker's Deployment, ServiceAccount, Role and pods'
    # app.kubernetes.io/instance label carry it too (63 at most)
    name: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$",
                             description="Service of the endpoint picker (EPP) in this namespace (a DNS-1035 label, "
                             "at most 63 characters, not metadata.name); default <name>-epp")
    port: int = Field(9002, ge=1, le=65535, description="the EPP Service's gRPC port")
    failureMode: Literal["FailOpen", "FailClose"] = Field(
        "FailClose", description="what the gateway does when the endpoint picker does not answer")
    deploy: bool | None = Field(None, description=(
        "the operator deploys the picker (ServiceAccount, Role, RoleBinding, Deployment and Service named like the "
        "Service, owned by this MoEDeployment; epp.py); default true, false when name names a picker of your own"))
    image: str | None = Field(None, max_length=512, pattern=IMAGE_PATTERN, description=(
        "image of a deployed picker; default registry.k8s.io/gateway-api-inference-extension/epp:v1.0.1"))
    replicas: int = Field(1, ge=1, le=5, description=(
        "replicas of a deployed picker; more than 1 run with leader election (one active, the others ready to take over)"))

    @field_validator("image")
    @classmethod
    def _epp_reference(cls, v: str | None) -> str | None:
        if v is not None:
            image_ref.parse(v)  # ValueError names what is wrong
        return v

    def deploys(self) -> bool:
        return self.deploy if self.deploy is not None else self.name is None


class InferencePoolSpec(_Model):
    enabled: bool = Field(False, description="render an InferencePool (inference.networking.k8s.io/v1) selecting this "
                          "MoEDeployment's serving pods, for InferencePool-aware gateways")
    endpointPicker: EndpointPickerRef | None = Field(None, description="the pool's endpoint picker; default: deployed by "
                                                     "the operator behind the Service <name>-epp, port 9002")
    poolName: str | None = Field(None, min_length=1, max_length=63, pattern=r"^[a-z]([-a-z0-9]*[a-z0-9])?$", description=(
        "one pool for several MoEDeployments of one model (e.g. an H200 and a B200 fleet): each labels its serving "
        "pods moe.serving.dev/inference-pool=<poolName>, and the MoEDeployment named <poolName> renders the pool "
        "selecting that label; default: a pool of this MoEDeployment alone"))


class GatewaySpec(_Model):
    inferencePool: InferencePoolSpec = Field(default_factory=InferencePoolSpec, description=(
        "Gateway API Inference Extension pool of the serving pods"))


# --- spec.podTemplate (issue 32): a strategic-merge overlay of the rendered pods (pod_overlay.py) -----

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
# a core/v1 object kept whole (the API server stores it as given; pod_overlay checks what it must)
K8sObject = Annotated[dict, WithJsonSchema({"type": "object", "x-kubernetes-preserve-unknown-fields": True})]


class LocalObjectReference(_Model):
    name: str = Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN, description="name of an object in this namespace")


class PodSecurityOverlay(_Model):
    fsGroup: int | None = Field(None, ge=0, le=2147483647, description="group that owns the pod's volumes")
    fsGroupChangePolicy: Literal["OnRootMismatch", "Always"] | None = Field(
        None, description="when the kubelet changes volume ownership to fsGroup")
    supplementalGroups: list[Annotated[int, Field(ge=0, le=2147483647)]] = Field(
        default_factory=list, max_length=32, description="extra groups of every container (e.g. to read a shared volume)")


class PodTemplateMetadata(_Model):
    labels: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=64, description=(
        "labels added to the pods (moe.serving.dev/*, leaderworkerset.sigs.k8s.io/* and the operator's selector labels are refused)"))
    annotations: dict[LabelKey, Annotated[str, Field(max_length=32768)]] = Field(
        default_factory=dict, max_length=64, description="annotations added to the pods (moe.serving.dev/* and leaderworkerset.sigs.k8s.io/* are the operator's)")


class PodTemplateSpec(_Model):
    serviceAccountName: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description=(
        "ServiceAccount the pods run as (default: the namespace's default)"))
    automountServiceAccountToken: bool | None = Field(None, description=(
        "mount the ServiceAccount's token (default false: the engine needs no API access)"))
    imagePullSecrets: list[LocalObjectReference] = Field(default_factory=list, max_length=16, description=(
        "Secrets in this namespace for pulling the images, after the operator-wide ones of the chart's imagePullSecrets"))
    priorityClassName: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description="PriorityClass of the pods")
    schedulerName: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN, description="scheduler of the pods")
    runtimeClassName: str | None = Field(None, max_length=253, pattern=DNS_SUBDOMAIN,
                                         description="RuntimeClass of the pods (e.g. nvidia)")
    terminationGracePeriodSeconds: int | None = Field(None, ge=0, le=86400, description="seconds to stop (default 60)")
    dnsPolicy: Literal["ClusterFirst", "ClusterFirstWithHostNet", "Default", "None"] | None = Field(
        None, description="the pods' DNS policy")
    dnsConfig: K8sObject | None = Field(None, description="the pods' DNS config (core/v1 PodDNSConfig)")
    securityContext: PodSecurityOverlay | None = Field(None, description=(
        "pod security settings a volume may need; the rest stays the operator's restricted profile"))
    affinity: K8sObject | None = Field(None, description=(
        "core/v1 Affinity merged into the operator's: podAffinity, podAntiAffinity, preferred node affinity "
        "(required node affinity is the planner's GPU class)"))
    topologySpreadConstraints: list[K8sObject] = Field(default_factory=list, max_length=16, description=(
        "core/v1 TopologySpreadConstraint items (merged by topologyKey)"))
    volumes: list[K8sObject] = Field(default_factory=list, max_length=64, description=(
        "core/v1 Volume items added to the pods (hostPath refused; the operator's volume names reserved)"))
    containers: list[K8sObject] = Field(default_factory=list, max_length=16, description=(
        "core/v1 Container items merged by name: 'engine' (the operator's) takes only volumeMounts and "
        "terminationMessage*; any other name is an extra container (sidecar) under the restricted security context"))
    initContainers: list[K8sObject] = Field(default_factory=list, max_length=16, description=(
        "core/v1 Container items run after the operator's init containers, under the restricted security context"))
    nodeSelector: K8sObject | None = Field(None, description="refused: use spec.nodeSelector (listed so the refusal names it)")
    tolerations: list[K8sObject] | None = Field(None, description="refused: use spec.tolerations")
    nodeName: str | None = Field(None, description="refused: the planner places the pods (spec.gpu)")
    hostNetwork: bool | None = Field(None, description="refused: engine pods never share the node's namespaces")
    hostPID: bool | None = Field(None, description="refused: engine pods never share the node's namespaces")
    hostIPC: bool | None = Field(None, description="refused: engine pods never share the node's namespaces")


class PodTemplate(_Model):
    metadata: PodTemplateMetadata = Field(default_factory=PodTemplateMetadata, description="labels and annotations added to the pods")
    spec: PodTemplateSpec = Field(default_factory=PodTemplateSpec, description=(
        "a core/v1 PodSpec overlay, merged strategically into the rendered pod spec"))

    @model_validator(mode="after")
    def _allowed(self) -> "PodTemplate":
        if (why := pod_overlay.refusals(self.overlay())):
            raise ValueError("; ".join(why))
        return self

    def overlay(self) -> dict:
        """The overlay as pod_overlay merges it (unset fields left out)."""
        return self.model_dump(exclude_none=True, exclude_defaults=True)


class MoEDeploymentSpec(_Model):
    model_config = ConfigDict(extra="forbid", json_schema_extra=_cel(
        ("!has(self.parallelism.tp) || self.parallelism.tp % self.parallelism.ep == 0", "parallelism.ep must divide parallelism.tp"),
        ("!has(self.parallelism.tp) || self.parallelism.tp % self.parallelism.dp == 0", "parallelism.dp must divide parallelism.tp"),
        ("!has(self.gpusPerReplica) || self.gpusPerReplica % self.parallelism.ep == 0", "parallelism.ep must divide gpusPerReplica"),
        ("!has(self.gpusPerReplica) || self.gpusPerReplica % self.parallelism.dp == 0", "parallelism.dp must divide gpusPerReplica"),
        ("!has(self.gpusPerReplica) || self.gpusPerReplica % self.nodesPerReplica == 0",
         "gpusPerReplica must be a multiple of nodesPerReplica (same GPU count on every node of a replica)"),
        ("!has(self.gpusPerReplica) || !has(self.parallelism.tp) || self.gpusPerReplica == self.parallelism.tp",
         "gpusPerReplica must equal parallelism.tp (one rank per GPU)"),
        (f"self.nodesPerReplica <= {BUNDLED.max_nodes} || self.engine.name != 'bundled'",
         f"the bundled engine serves at most {BUNDLED.max_nodes} nodes per replica (a LeaderWorkerSet group); "
         "use engine sglang or vllm for larger replicas"),
        ("self.moe.a2aBackend == 'none' || self.parallelism.ep > 1",
         "moe.a2aBackend needs expert parallelism (parallelism.ep > 1)"),
        ("self.moe.a2aBackend == 'none' || self.engine.name != 'bundled'",
         "the bundled engine has no all-to-all backend; use engine sglang or vllm"),
        ("self.engine.name != 'bundled' || self.moe.runnerBackend in ['auto', "
         + ", ".join(f"'{n}'" for n in registry.names()) + "]",
         "engine bundled supports moe.runnerBackend auto, " + ", ".join(registry.names())),
        ("self.engine.name != 'sglang' || self.moe.runnerBackend in " + _cel_list(_sglang.RUNNERS),
         "not an sglang --moe-runner-backend; valid: " + ", ".join(_sglang.RUNNERS)),
        ("self.engine.name != 'sglang' || self.moe.a2aBackend in " + _cel_list(_sglang.A2A),
         "not an sglang --moe-a2a-backend; valid: " + ", ".join(_sglang.A2A)),
        ("self.engine.name != 'vllm' || self.moe.runnerBackend in " + _cel_list(_vllm.MOE_BACKENDS),
         "not a vLLM --moe-backend; valid: " + ", ".join(_vllm.MOE_BACKENDS)),
        ("self.engine.name != 'vllm' || self.moe.deferredFinalize != 'on'",
         "vLLM has no deferred-finalize switch; use engine sglang or bundled"),
        ("!has(self.model.tokenSecretRef) || !has(self.env) || !self.env.exists(e, e.name == 'HF_TOKEN')",
         "env HF_TOKEN collides with model.tokenSecretRef (the operator sets HF_TOKEN from that Secret)"),
        env_policy.cel_token_rule(),
        (f"!has(self.env) || self.env.map(e, e.name.size() + (has(e.value) ? e.value.size() : 0)).sum() <= {ENV_TOTAL_BYTES}",
         f"env names and values together must stay under {ENV_TOTAL_BYTES} bytes"),
    ))
    model: ModelSource = Field(description="the checkpoint to serve and the name it is served under")
    engine: EngineSpec = Field(default_factory=EngineSpec, description=(
        "inference engine, its version and image, sizing limits and extra arguments"))
    replicas: int = Field(1, ge=0, le=1000, description="serving replicas (kubectl scale; the autoscaler when enabled)")
    gpusPerReplica: int | None = Field(None, ge=1, le=512, description=(
        "GPUs per replica (default parallelism.tp; both unset: sized from the checkpoint and the GPU memory)"))
    nodesPerReplica: int = Field(1, ge=1, le=64, description=(
        "nodes per replica; > 1 renders a LeaderWorkerSet. Left at 1 with no tp/gpusPerReplica, sizing may "
        "span nodes (engines sglang and vllm) when one node's GPUs cannot hold the model"))
    parallelism: Parallelism = Field(default_factory=Parallelism, description=(
        "tensor, expert and data parallel sizes of a replica (unset: sized by the operator)"))
    moe: MoESpec = Field(default_factory=MoESpec, description="MoE kernel and all-to-all backends")
    env: list[EnvVar] = Field(default_factory=list, max_length=256, description="user env; always wins over the plan",
                              json_schema_extra={"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]})
    gpu: GpuSelection = Field(default_factory=GpuSelection, description="which GPU classes the planner may choose")
    nodeSelector: dict[LabelKey, LabelValue] = Field(default_factory=dict, max_length=32, description=(
        "node labels the pods require, on top of the GPU class the planner chose"))
    tolerations: list[Toleration] = Field(default_factory=list, max_length=64, description=(
        "tolerations of the pods (the GPU taint's is added unless given)"))
    resources: Resources = Field(default_factory=Resources, description="engine container requests and limits beyond the GPUs")
    service: ServiceSpec = Field(default_factory=ServiceSpec, description="the Service in front of the serving pods")
    rollout: RolloutSpec = Field(default_factory=RolloutSpec, description="how a plan or spec change rolls, and the disruption budget")
    autoscaling: AutoscalingSpec = Field(default_factory=AutoscalingSpec, description=(
        "an HPA or KEDA ScaledObject on the engine's queue or KV-cache metric"))
    gateway: GatewaySpec = Field(default_factory=GatewaySpec, description="gateway integration (InferencePool)")
    planPolicy: Literal["pin", "follow"] = Field("pin", description=(
        "pin: a plan change the spec did not cause (new rule tables after an operator upgrade, a driver rule) "
        "is held, with the pending diff in status.pendingPlan, until the spec changes; follow: applied at once"))
    podTemplate: PodTemplate | None = Field(None, description=(
        "metadata and pod spec merged into the rendered pods (every pod of a LeaderWorkerSet): volumes, pull "
        "secrets, service account, scheduling, extra and init containers; what the operator decides is refused "
        "by name with the field to use"))

    def layout_given(self) -> bool:
        """Whether the user chose the GPUs per replica (else placement sizes it)."""
        return self.gpusPerReplica is not None or self.parallelism.tp is not None

    def gpus_per_replica(self) -> int:
        return self.gpusPerReplica or self.parallelism.tp or self.nodesPerReplica

    def gpus_per_node(self) -> int:
        return self.gpus_per_replica() // self.nodesPerReplica

    def env_dict(self) -> dict[str, str]:
        return {e.name: e.value for e in self.env}

    @model_validator(mode="after")
    def _template_keeps_the_model_mount(self) -> "MoEDeploymentSpec":
        if self.podTemplate and self.model.uri.startswith("file://"):
            path = self.model.uri[len("file://"):].rstrip("/") or "/"
            main = [c for c in self.podTemplate.spec.containers if c.get("name") == pod_overlay.MAIN]
            why = [w for c in main for w in pod_overlay.mount_refusals(
                "podTemplate.spec.containers engine", c.get("volumeMounts") or [], (path,))]
            if why:
                raise ValueError("; ".join(why))
        return self

    @model_validator(mode="after")
    def _no_token_redirect(self) -> "MoEDeploymentSpec":
        if self.model.tokenSecretRef:
            why = [w for e in self.env if (w := env_policy.token_refusal(e.name))]
            if why:
                raise ValueError("; ".join(why))
        return self


class Condition(_Model):
    type: str = Field(description="condition type, e.g. Planned, Available, Degraded, Ready")
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown")
    reason: str = Field(pattern=r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$", max_length=1024,
                        description="CamelCase reason of the last transition")
    message: str = Field("", max_length=32768, description="human-readable detail")
    lastTransitionTime: str | None = Field(None, description="when status last changed (RFC 3339)")
    observedGeneration: int | None = Field(None, description="metadata.generation the condition was set for")


class WorkloadRef(_Model):
    apiVersion: str = Field(description="API version of the workload (apps/v1 or leaderworkerset.x-k8s.io/v1)")
    kind: str = Field(description="Deployment or LeaderWorkerSet")
    name: str = Field(description="name of the workload (the MoEDeployment's)")


class ModelCacheStatus(_Model):
    claimName: str = Field(description="the model cache PVC the pods mount")
    claimUid: str | None = Field(None, description="UID of the cache PVC the operator made (only a recorded PVC is mounted or deleted)")
    jobUid: str | None = Field(None, description="UID of the operator's fill Job (only its result marks the cache ready)")
    state: Literal["Pending", "Downloading", "Ready", "Failed"] = Field(description="fill state of the cache")
    bytesDone: int | None = Field(None, description="bytes in the cache so far")
    bytesTotal: int | None = Field(None, description="bytes of the model (the hub's or the source claim's)")
    message: str = Field("", max_length=4096, description="the fill Job's last progress or failure")


class PendingPlan(_Model):
    diff: list[str] = Field(default_factory=list, description="what the new plan would change in the pods")
    message: str = Field("", max_length=4096, description="why the change is held and how to accept it")


class MoEDeploymentStatus(_Model):
    observedGeneration: int | None = Field(None, description="metadata.generation the status was written for")
    conditions: list[Condition] = Field(default_factory=list, description=(
        "CheckpointInspected, Planned, ModelCacheReady, Available, Progressing, Degraded, PlanPending, Ready"))
    checkpoint: CheckpointInfo | None = Field(None, description="what inspection read from the checkpoint")
    gpuClass: str | None = Field(None, description="chosen GPU class, e.g. sm90/NVIDIA-H200")
    format: str | None = Field(None, description="checkpoint format the plan serves (e.g. nvfp4, fp8)")
    runnerBackend: str | None = Field(None, description="MoE kernel backend the planner chose")
    deferredFinalize: bool | None = Field(None, description="whether the top-k reduction is fused with the shared expert")
    plan: Plan | None = Field(None, description="the plan the pods run: engine flags, env and the reason for each")
    inputsHash: str | None = Field(None, description="hash of the plan's inputs stamped on the workload")
    inventoryHash: str | None = Field(None, description="fingerprint of the GPU classes the plan was made against")
    workload: WorkloadRef | None = Field(None, description="the Deployment or LeaderWorkerSet the operator renders")
    replicas: int | None = Field(None, description="replicas of the workload (the scale subresource's status)")
    readyReplicas: int | None = Field(None, description="replicas whose pods are ready")
    revision: str | None = Field(None, description="the hub commit the model is pinned to (hf://)")
    revisionUri: str | None = Field(None, description="model.uri the revision was resolved for (a spec change re-resolves)")
    modelCache: ModelCacheStatus | None = Field(None, description="the shared model cache PVC and its fill progress")
    selector: str | None = Field(None, description="label selector of the serving pods (the scale subresource's labelSelectorPath)")
    optionalObjects: list[str] | None = Field(None, description="kinds of the optional objects last rendered "
                                              "(PodDisruptionBudget, autoscaler, InferencePool): pruned when no longer asked for")
    planGeneration: int | None = Field(None, description="metadata.generation of the spec status.plan was made for")
    pendingPlan: PendingPlan | None = Field(None, description="a plan change held by spec.planPolicy pin")
    endpoint: str | None = Field(None, description=(
        "OpenAI-compatible base URL of the Service inside the cluster, http://<name>.<namespace>.svc:<port>/v1"))
    modelName: str | None = Field(None, description="the model id clients send ('model'): spec.model.servedName or the name")
    image: str | None = Field(None, description="the image the engine pods run (spec.engine.image or the default chosen)")


class MoEDeployment(_Model):
    apiVersion: Literal["moe.serving.dev/v1alpha1"] = "moe.serving.dev/v1alpha1"
    kind: Literal["MoEDeployment"] = "MoEDeployment"
    metadata: dict = Field(default_factory=dict)
    spec: MoEDeploymentSpec
    status: MoEDeploymentStatus | None = None
