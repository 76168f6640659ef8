"""Inventory: Nodes -> GPU classes with free GPU counts. Pure functions over node/pod dicts.

The kopf handlers keep indexes of nodes and GPU-requesting pods; this module turns them into
`ClassInventory` entries the placement step reads.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any, Iterable

from moe_core.gpu import GpuClass, from_node_labels

GPU_RESOURCES = ("nvidia.com/gpu", "amd.com/gpu")


@dataclass(frozen=True)
class NodeInfo:
    name: str
    gpu_class: GpuClass | None
    reason: str
    allocatable: int  # GPUs
    schedulable: bool


@dataclass
class ClassInventory:
    gpu_class: GpuClass
    nodes: list[str] = field(default_factory=list)
    total_gpus: int = 0
    free_gpus: int = 0
    free_per_node: dict[str, int] = field(default_factory=dict)

    def nodes_with_free(self, gpus: int) -> int:
        return sum(1 for v in self.free_per_node.values() if v >= gpus)

    @property
    def gpus_per_node(self) -> int:
        return max((self.gpu_class.count or 0), 0)


def node_info(node: dict[str, Any]) -> NodeInfo:
    meta, spec, status = node.get("metadata", {}), node.get("spec", {}) or {}, node.get("status", {}) or {}
    alloc = status.get("allocatable") or {}
    gpus = 0
    for r in GPU_RESOURCES:
        if r in alloc:
            try:
                gpus = int(str(alloc[r]))
            except ValueError:
                gpus = 0
    facts = from_node_labels(meta.get("labels") or {}, status.get("capacity") or {}, meta.get("annotations") or {})
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in status.get("conditions") or [])
    schedulable = ready and not spec.get("unschedulable", False)
    return NodeInfo(meta.get("name", ""), facts.gpu_class, facts.reason, gpus, schedulable)


def pod_gpu_requests(pod: dict[str, Any]) -> tuple[str | None, int]:
    """(node name, GPUs requested) of a pod that holds GPUs; terminal pods hold none."""
    spec, status = pod.get("spec", {}) or {}, pod.get("status", {}) or {}
    if status.get("phase") in ("Succeeded", "Failed"):
        return None, 0
    n = 0
    for c in spec.get("containers") or []:
        res = (c.get("resources") or {})
        for part in ("limits", "requests"):
            for r in GPU_RESOURCES:
                v = (res.get(part) or {}).get(r)
                if v is not None:
                    n = max(n, int(str(v)))
    return spec.get("nodeName"), n


def _driver_key(v: str | None) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")) if v else ()


def _merge_driver(cls: GpuClass, node: GpuClass) -> GpuClass:
    """A class's driver version is the newest among its nodes: the driver rules the planner applies
    refuse what a newer driver breaks (triton_kernels SIGSEGV with driver >= 595 on Blackwell,
    sglang model_overrides/gpt_oss.py:108-115), and a replica may land on any node of the class."""
    if _driver_key(node.driverVersion) > _driver_key(cls.driverVersion):
        return cls.model_copy(update={"driverVersion": node.driverVersion, "driverMajor": node.driverMajor})
    return cls


def build(nodes: Iterable[NodeInfo], used: dict[str, int]) -> dict[str, ClassInventory]:
    """GPU classes keyed by `family/product`, with free GPUs = allocatable - requested by pods."""
    classes: dict[str, ClassInventory] = {}
    for n in nodes:
        if n.gpu_class is None or not n.schedulable:
            continue
        key = n.gpu_class.key()
        inv = classes.setdefault(key, ClassInventory(n.gpu_class))
        inv.gpu_class = _merge_driver(inv.gpu_class, n.gpu_class)
        free = max(n.allocatable - used.get(n.name, 0), 0)
        inv.nodes.append(n.name)
        inv.total_gpus += n.allocatable
        inv.free_gpus += free
        inv.free_per_node[n.name] = free
    return classes


def fingerprint(classes: dict[str, ClassInventory]) -> str:
    """Changes when a GPU class appears/disappears or its node count changes (not on free-GPU churn)."""
    data = sorted((k, len(v.nodes)) for k, v in classes.items())
    return hashlib.sha256(json.dumps(data).encode()).hexdigest()[:16]
