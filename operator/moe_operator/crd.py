"""Generate the MoEDeployment CustomResourceDefinition from the pydantic models (one source of truth).

pydantic emits JSON Schema (2020-12 flavour, with $refs and anyOf-null for optionals); Kubernetes
wants a *structural* OpenAPI v3 schema: everything inlined, a type on every node, no null unions.
"""

from __future__ import annotations

import copy
from typing import Any

from . import API_GROUP, API_VERSION, KIND, PLURAL
from .api import NAME_RULES, MoEDeploymentSpec, MoEDeploymentStatus

_DROP = {"title", "$defs", "discriminator", "propertyNames"}  # map keys: checked by the pydantic model


def _structural(node: Any, defs: dict[str, Any]) -> Any:
    if isinstance(node, list):
        return [_structural(n, defs) for n in node]
    if not isinstance(node, dict):
        return node
    if "$ref" in node:
        target = copy.deepcopy(defs[node["$ref"].split("/")[-1]])
        extra = {k: v for k, v in node.items() if k != "$ref"}
        return _structural({**target, **extra}, defs)
    if "allOf" in node and len(node["allOf"]) == 1:
        # pydantic < 2.9 wraps a $ref that has sibling keywords (a description, a default) in a
        # one-element allOf; the same inlining as a bare $ref (the floors test plans with 2.7)
        rest = {k: v for k, v in node.items() if k != "allOf"}
        return _structural({**node["allOf"][0], **rest}, defs)
    if "anyOf" in node:  # Optional[X] -> X (an absent field is how Kubernetes says "unset")
        options = [o for o in node["anyOf"] if o.get("type") != "null"]
        if len(options) != 1:
            raise ValueError(f"cannot express union {node['anyOf']} structurally")
        rest = {k: v for k, v in node.items() if k != "anyOf"}
        if rest.get("default", 0) is None:
            rest.pop("default")
        return _structural({**options[0], **rest}, defs)
    if "patternProperties" in node:  # dict[ConstrainedKey, V]: the key rule stays in pydantic
        (value_schema,) = node["patternProperties"].values()
        node = {**{k: v for k, v in node.items() if k != "patternProperties"}, "additionalProperties": value_schema}
    out: dict[str, Any] = {}
    for k, v in node.items():
        if k in _DROP:
            continue
        if k == "const":
            out["enum"] = [v]
            out.setdefault("type", "string")
            continue
        if k == "default" and v is None:
            continue
        if k == "properties":
            out[k] = {name: _structural(sub, defs) for name, sub in v.items()}
        elif k in ("items", "additionalProperties") and isinstance(v, dict):
            out[k] = _structural(v, defs)
        else:
            out[k] = v
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    if out.get("additionalProperties") is False:
        out.pop("additionalProperties")  # structural schemas prune unknown fields anyway
    return out


def _default_empty_objects(schema: dict[str, Any]) -> dict[str, Any]:
    """Optional nested objects default to {} so the API server fills in their field defaults
    (CEL rules can then read e.g. self.engine.name without has() guards)."""
    required = set(schema.get("required", []))
    for name, sub in schema.get("properties", {}).items():
        if sub.get("type") == "object" and "properties" in sub:
            _default_empty_objects(sub)
            if name not in required and "default" not in sub and not sub.get("required"):
                sub["default"] = {}
    return schema


def model_schema(model: type) -> dict[str, Any]:
    raw = model.model_json_schema(mode="validation")
    return _structural(raw, raw.get("$defs", {}))


def _condition(type_: str, field: str) -> str:
    return f'.status.conditions[?(@.type=="{type_}")].{field}'


# Ready and Reason first: the rolled-up state (conditions.py) and why, as Flux and KServe show it.
PRINTER_COLUMNS = [
    {"name": "Ready", "type": "string", "jsonPath": _condition("Ready", "status")},
    {"name": "Reason", "type": "string", "jsonPath": _condition("Ready", "reason")},
    {"name": "Format", "type": "string", "jsonPath": ".status.format"},
    {"name": "GPU", "type": "string", "jsonPath": ".status.gpuClass"},
    {"name": "Backend", "type": "string", "jsonPath": ".status.runnerBackend"},
    {"name": "Deferred", "type": "boolean", "jsonPath": ".status.deferredFinalize", "priority": 1},
    {"name": "Revision", "type": "string", "jsonPath": ".status.revision", "priority": 1},
    {"name": "Cache", "type": "string", "jsonPath": ".status.modelCache.state"},
    {"name": "Serving", "type": "integer", "jsonPath": ".status.readyReplicas", "description": "ready replicas"},
    {"name": "Replicas", "type": "integer", "jsonPath": ".spec.replicas", "priority": 1},
    {"name": "URL", "type": "string", "jsonPath": ".status.endpoint", "priority": 1},
    {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
]


def crd() -> dict[str, Any]:
    spec_schema = _default_empty_objects(model_schema(MoEDeploymentSpec))
    status_schema = model_schema(MoEDeploymentStatus)
    # Read before the operator first writes status, an object shows observedGeneration 0: kstatus
    # (Flux) then reads InProgress (generation not observed) instead of Current, which it says of
    # a custom resource without status (cli-utils v0.37.2 kstatus/status: checkGeneration, then
    # "Resource is current"). The API server applies it on every read while status is absent.
    status_schema["default"] = {"observedGeneration": 0}
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{PLURAL}.{API_GROUP}"},
        "spec": {
            "group": API_GROUP,
            "scope": "Namespaced",
            "names": {"kind": KIND, "plural": PLURAL, "singular": "moedeployment", "shortNames": ["moed"],
                      "listKind": f"{KIND}List", "categories": ["all", "moe"]},
            "versions": [{
                "name": API_VERSION,
                "served": True,
                "storage": True,
                "subresources": {"status": {}, "scale": {  # kubectl scale, HPA and KEDA
                    "specReplicasPath": ".spec.replicas", "statusReplicasPath": ".status.replicas",
                    "labelSelectorPath": ".status.selector"}},
                "additionalPrinterColumns": PRINTER_COLUMNS,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": "A Mixture-of-Experts model served on correctly tuned kernels.",
                    "required": ["spec"],
                    "x-kubernetes-validations": NAME_RULES,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema,
                        "status": status_schema,
                    },
                }},
            }],
        },
    }


def crd_yaml() -> str:
    import yaml

    header = "# Generated by `moe-operator crd` from moe_operator/api.py. Do not edit by hand.\n"
    return header + yaml.safe_dump(crd(), sort_keys=False, width=120)
