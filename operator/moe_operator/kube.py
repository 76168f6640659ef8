"""Kubernetes I/O for the operator: server-side apply, status patches, workload readiness, inspection Jobs."""

from __future__ import annotations

import json
import logging
from functools import cached_property
from typing import Any

from kubernetes import client
from kubernetes.client.rest import ApiException

from . import API_GROUP, API_VERSION, PLURAL
from .render import FIELD_MANAGER

log = logging.getLogger("moe_operator.kube")

_API_VERSIONS = {"Deployment": "apps/v1", "Service": "v1", "ConfigMap": "v1",
                 "LeaderWorkerSet": "leaderworkerset.x-k8s.io/v1", "Job": "batch/v1"}


class ApplyError(Exception):
    def __init__(self, reason: str, message: str):
        self.reason, self.message = reason, message
        super().__init__(message)


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None):
        self.api_client = api_client or client.ApiClient()

    @cached_property
    def custom(self) -> client.CustomObjectsApi:
        return client.CustomObjectsApi(self.api_client)

    @cached_property
    def core(self) -> client.CoreV1Api:
        return client.CoreV1Api(self.api_client)

    @cached_property
    def batch(self) -> client.BatchV1Api:
        return client.BatchV1Api(self.api_client)

    @cached_property
    def dynamic(self):
        from kubernetes.dynamic import DynamicClient

        return DynamicClient(self.api_client)

    def _resource(self, kind: str):
        from kubernetes.dynamic.exceptions import ResourceNotFoundError

        try:
            return self.dynamic.resources.get(api_version=_API_VERSIONS[kind], kind=kind)
        except ResourceNotFoundError:
            if kind == "LeaderWorkerSet":
                raise ApplyError("LeaderWorkerSetMissing", "multi-node replicas need the LeaderWorkerSet CRD "
                                 "(leaderworkerset.x-k8s.io/v1); install LWS (kubernetes-sigs/lws) first") from None
            raise

    def apply(self, obj: dict[str, Any]) -> dict[str, Any]:
        """Server-side apply with our field manager (force: we own these fields)."""
        res = self._resource(obj["kind"])
        try:
            out = res.server_side_apply(body=obj, namespace=obj["metadata"]["namespace"],
                                        field_manager=FIELD_MANAGER, force_conflicts=True)
        except ApiException as e:
            raise ApplyError("ApplyFailed", f"apply {obj['kind']}/{obj['metadata']['name']}: {_api_message(e)}") from None
        return out.to_dict()

    def get(self, kind: str, namespace: str, name: str) -> dict[str, Any] | None:
        from kubernetes.dynamic.exceptions import NotFoundError

        try:
            return self._resource(kind).get(name=name, namespace=namespace).to_dict()
        except NotFoundError:
            return None

    def delete(self, kind: str, namespace: str, name: str) -> None:
        from kubernetes.dynamic.exceptions import NotFoundError

        try:
            self._resource(kind).delete(name=name, namespace=namespace, propagation_policy="Background")
        except NotFoundError:
            pass

    def get_moed(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            return self.custom.get_namespaced_custom_object(API_GROUP, API_VERSION, namespace, PLURAL, name)
        except ApiException as e:
            if e.status == 404:
                return None
            raise

    def list_moeds(self, namespaces: list[str] | None = None) -> list[dict[str, Any]]:
        if namespaces:
            return [o for ns in namespaces for o in
                    self.custom.list_namespaced_custom_object(API_GROUP, API_VERSION, ns, PLURAL)["items"]]
        return self.custom.list_cluster_custom_object(API_GROUP, API_VERSION, PLURAL)["items"]

    def patch_status(self, namespace: str, name: str, status: dict[str, Any]) -> None:
        try:
            self.custom.patch_namespaced_custom_object_status(API_GROUP, API_VERSION, namespace, PLURAL, name,
                                                              {"status": status})
        except ApiException as e:
            if e.status != 404:
                raise

    def read_secret_key(self, namespace: str, name: str, key: str) -> str | None:
        import base64
        try:
            s = self.core.read_namespaced_secret(name, namespace)
        except ApiException as e:
            if e.status == 404:
                return None
            raise
        raw = (s.data or {}).get(key)
        return base64.b64decode(raw).decode() if raw else None

    # --- inspection Job (pvc://, and file:// paths only nodes can see) -----------------------

    def inspection_job(self, namespace: str, owner: dict[str, Any], uri: str, image: str) -> dict[str, Any] | None:
        """Run (or look at) the inspection Job for `uri`. None while running, else the parsed result."""
        import hashlib

        name = "moe-inspect-" + hashlib.sha256(uri.encode()).hexdigest()[:10]
        if uri.startswith("pvc://"):
            claim = uri[len("pvc://"):].split("/", 1)[0]
            try:
                self.core.read_namespaced_persistent_volume_claim(claim, namespace)
            except ApiException as e:
                if e.status == 404:
                    return {"error": f"PersistentVolumeClaim {claim!r} not found in namespace {namespace}"}
                raise
        job = self.get("Job", namespace, name)
        if job is None:
            self.apply(render_inspection_job(namespace, name, uri, image, owner))
            return None
        st = job.get("status") or {}
        pods = self.core.list_namespaced_pod(namespace, label_selector=f"job-name={name}").items
        if not st.get("succeeded") and not st.get("failed"):
            for pod in pods:  # a pod that cannot be scheduled will not finish: say why now
                for c in pod.status.conditions or []:
                    if c.type == "PodScheduled" and c.status == "False" and c.reason == "Unschedulable":
                        return {"error": f"inspection pod cannot be scheduled: {c.message}"}
            return None
        for pod in pods:
            for cs in (pod.status.container_statuses or []):
                term = cs.state.terminated if cs.state else None
                if term and term.message:
                    self.delete("Job", namespace, name)  # results are cached; the next change re-runs it
                    try:
                        return json.loads(term.message)
                    except json.JSONDecodeError:
                        return {"error": term.message.strip()[-2000:]}
        return {"error": f"inspection Job {name} finished without a termination message"}


def render_inspection_job(namespace: str, name: str, uri: str, image: str, owner: dict[str, Any]) -> dict[str, Any]:
    if uri.startswith("pvc://"):
        claim, _, sub = uri[len("pvc://"):].partition("/")
        volume = {"name": "model", "persistentVolumeClaim": {"claimName": claim, "readOnly": True}}
        mount, path = f"/models/{claim}", f"/models/{claim}/{sub}".rstrip("/")
    else:
        path = uri[len("file://"):]
        volume = {"name": "model", "hostPath": {"path": path, "type": "Directory"}}
        mount = path
    return {
        "apiVersion": "batch/v1", "kind": "Job",
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"app.kubernetes.io/managed-by": "moe-operator", "moe.serving.dev/role": "inspect"},
                     "ownerReferences": [{"apiVersion": f"{API_GROUP}/{API_VERSION}", "kind": "MoEDeployment",
                                          "name": owner["name"], "uid": owner["uid"]}]},
        "spec": {"backoffLimit": 0, "ttlSecondsAfterFinished": 600, "template": {"spec": {
            "restartPolicy": "Never",
            "containers": [{"name": "inspect", "image": image, "command": ["moe-runtime", "inspect", path,
                                                                           "--termination-log", "/dev/termination-log"],
                            "terminationMessagePolicy": "FallbackToLogsOnError",
                            "resources": {"requests": {"cpu": "100m", "memory": "128Mi"}},
                            "volumeMounts": [{"name": "model", "mountPath": mount, "readOnly": True}]}],
            "volumes": [volume]}}},
    }


def _api_message(e: ApiException) -> str:
    try:
        return json.loads(e.body).get("message", str(e))
    except Exception:
        return f"HTTP {e.status}: {e.reason}"
