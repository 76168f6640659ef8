"""Simulated GPU node pools: one table of GPU node classes, and the pure function that turns a
pool into Node manifests (labels and capacity as the real device plugins and labellers publish
them), so the operator's inventory code reads exactly what it would read on a real cluster.

NVIDIA labels follow GPU Feature Discovery (k8s-device-plugin >= 0.18, see
shared/docs/landscape.md section 5). AMD labels follow the ROCm k8s-node-labeller
(ROCm/k8s-device-plugin cmd/k8s-node-labeller), whose MI300X values are documented as
cu-count=304, device-id=74a1, family=AI, product-name=AMD_Instinct_MI300X_OAM, simd-count=1216,
vram=192G. No official AMD labeller publishes the gfx target (gfx942) as a label, so it is kept
as data here (`GpuClass.gfx_target`) rather than invented as a label.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

POOL_LABEL = "moe.serving.dev/pool"
# kwok manages only nodes carrying this annotation (kwok --manage-nodes-with-annotation-selector),
# so a real node that ever joins this control plane is left alone.
KWOK_ANNOTATION = ("kwok.x-k8s.io/node", "fake")

DEFAULT_POOL_SIZE = 2

# Realistic driver stack of late 2026 GFD output (driver 580 branch = CUDA 13.0).
_NVIDIA_DRIVER = ("580", "95", "05")
_CUDA_RUNTIME = ("13", "0")
_AMD_DRIVER_VERSION = "6.12.12"


@dataclass(frozen=True)
class GpuClass:
    """One node class: what a node of this pool looks like to the scheduler and the operator."""

    pool: str
    vendor: str  # "nvidia" | "amd"
    product: str  # GFD gpu.product / AMD gpu.product-name
    gpus: int  # GPUs per node (extended resource and gpu.count)
    memory_mib: int  # per GPU
    arch: str  # kubernetes.io/arch of the host CPU
    instance_type: str
    cpu: str
    memory: str
    compute: tuple[int, int] | None = None  # CUDA compute capability (NVIDIA only)
    family: str = ""
    machine: str = ""  # nvidia.com/gpu.machine
    nvlink_domain_size: int = 0  # nodes per NVLink clique (GB200 NVL72: 18 trays of 4 GPUs)
    gfx_target: str = ""  # AMD ISA, for code that needs it; not a published label
    extra_labels: dict[str, str] = field(default_factory=dict)

    @property
    def resource_name(self) -> str:
        return "nvidia.com/gpu" if self.vendor == "nvidia" else "amd.com/gpu"


# The one table of node classes. Product strings, compute capabilities, families and memory
# sizes are the values in landscape.md section 5; instance types are the cloud SKUs carrying
# 8 (GB200: 4) of these GPUs, used only as a realistic node.kubernetes.io/instance-type.
GPU_CLASSES: dict[str, GpuClass] = {
    c.pool: c
    for c in (
        GpuClass("h100", "nvidia", "NVIDIA-H100-80GB-HBM3", 8, 81559, "amd64",
                 "p5.48xlarge", "192", "2048Gi", (9, 0), "hopper"),
        GpuClass("h200", "nvidia", "NVIDIA-H200", 8, 143771, "amd64",
                 "p5e.48xlarge", "192", "2048Gi", (9, 0), "hopper"),
        GpuClass("b200", "nvidia", "NVIDIA-B200", 8, 183359, "amd64",
                 "p6-b200.48xlarge", "192", "2048Gi", (10, 0), "blackwell"),
        # A GB200 NVL72 compute tray is one node with 2 Grace (arm64) CPUs and 4 Blackwell GPUs;
        # 18 trays share one NVLink domain, which GFD publishes as gpu.clique.
        GpuClass("gb200", "nvidia", "NVIDIA-GB200", 4, 189471, "arm64",
                 "p6e-gb200.36xlarge", "144", "960Gi", (10, 0), "blackwell",
                 machine="NVIDIA-GB200-NVL72", nvlink_domain_size=18),
        GpuClass("rtx-pro-6000", "nvidia", "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", 8, 97887,
                 "amd64", "rtx-pro-6000-server.8gpu", "128", "1024Gi", (12, 0), "blackwell"),
        GpuClass("mi300x", "amd", "AMD_Instinct_MI300X_OAM", 8, 196608, "amd64",
                 "Standard_ND_MI300X_v5", "96", "1850Gi", family="AI", gfx_target="gfx942",
                 extra_labels={
                     "amd.com/gpu.device-id": "74a1",
                     "amd.com/gpu.cu-count": "304",
                     "amd.com/gpu.simd-count": "1216",
                     "amd.com/gpu.vram": "192G",
                 }),
    )
}


def parse_pools(spec: str | None, default_size: int = DEFAULT_POOL_SIZE) -> dict[str, int]:
    """`"h200=2,b200=1"` -> {"h200": 2, "b200": 1}; None/"" -> every pool at `default_size`;
    `"all=3"` sets every pool; a bare name means the default size."""
    if not spec:
        return {name: default_size for name in GPU_CLASSES}
    pools: dict[str, int] = {}
    for item in filter(None, (s.strip() for s in spec.split(","))):
        name, _, count = item.partition("=")
        name = name.strip()
        try:
            n = int(count) if count else default_size
        except ValueError:
            raise ValueError(f"pool size must be an integer in {item!r}") from None
        if n < 0:
            raise ValueError(f"pool size must be >= 0 in {item!r}")
        if name == "all":
            pools.update({p: n for p in GPU_CLASSES})
        elif name in GPU_CLASSES:
            pools[name] = n
        else:
            raise ValueError(f"unknown pool {name!r}; known: {', '.join(GPU_CLASSES)}")
    return pools


def node_name(pool: str, index: int) -> str:
    return f"kwok-{pool}-{index:04d}"


def _labels(c: GpuClass, name: str, index: int) -> dict[str, str]:
    labels = {
        "kubernetes.io/arch": c.arch,
        "kubernetes.io/os": "linux",
        "kubernetes.io/hostname": name,
        "beta.kubernetes.io/arch": c.arch,
        "beta.kubernetes.io/os": "linux",
        "node.kubernetes.io/instance-type": c.instance_type,
        "type": "kwok",
        POOL_LABEL: c.pool,
    }
    if c.vendor == "nvidia":
        assert c.compute is not None, c.pool
        labels.update({
            "nvidia.com/gpu.present": "true",
            "nvidia.com/gpu.product": c.product,
            "nvidia.com/gpu.count": str(c.gpus),
            "nvidia.com/gpu.memory": str(c.memory_mib),
            "nvidia.com/gpu.compute.major": str(c.compute[0]),
            "nvidia.com/gpu.compute.minor": str(c.compute[1]),
            "nvidia.com/gpu.family": c.family,
            "nvidia.com/gpu.mode": "compute",
            "nvidia.com/gpu.replicas": "1",
            "nvidia.com/gpu.sharing-strategy": "none",
            "nvidia.com/mig.capable": "true",
            "nvidia.com/mps.capable": "false",
            "nvidia.com/cuda.driver-version.major": _NVIDIA_DRIVER[0],
            "nvidia.com/cuda.driver-version.minor": _NVIDIA_DRIVER[1],
            "nvidia.com/cuda.driver-version.revision": _NVIDIA_DRIVER[2],
            "nvidia.com/cuda.driver-version.full": ".".join(_NVIDIA_DRIVER),
            "nvidia.com/cuda.runtime-version.major": _CUDA_RUNTIME[0],
            "nvidia.com/cuda.runtime-version.minor": _CUDA_RUNTIME[1],
            "nvidia.com/cuda.runtime-version.full": ".".join(_CUDA_RUNTIME),
            # Deprecated aliases GFD still publishes; older tooling reads these.
            "nvidia.com/cuda.driver.major": _NVIDIA_DRIVER[0],
            "nvidia.com/cuda.driver.minor": _NVIDIA_DRIVER[1],
            "nvidia.com/cuda.driver.rev": _NVIDIA_DRIVER[2],
            "nvidia.com/cuda.runtime.major": _CUDA_RUNTIME[0],
            "nvidia.com/cuda.runtime.minor": _CUDA_RUNTIME[1],
        })
        if c.machine:
            labels["nvidia.com/gpu.machine"] = c.machine
        if c.nvlink_domain_size:
            # GFD: <ClusterUUID>.<CliqueID>; consecutive trays share one NVLink domain.
            domain = index // c.nvlink_domain_size
            labels["nvidia.com/gpu.clique"] = f"00000000-0000-4000-8000-{domain:012x}.1"
    else:
        labels.update({
            "feature.node.kubernetes.io/amd-gpu": "true",
            "amd.com/gpu.product-name": c.product,
            "amd.com/gpu.family": c.family,
            "amd.com/gpu.driver-version": _AMD_DRIVER_VERSION,
        })
    labels.update(c.extra_labels)
    return labels


def node_manifest(pool: str, index: int) -> dict[str, Any]:
    """The Node object for node `index` of `pool`, status included: the API server keeps the
    status of a created Node (as for a kubelet's registration), and kwok's node-initialize stage
    keeps capacity/allocatable and nodeInfo as given, so the scheduler sees the GPUs at once."""
    c = GPU_CLASSES[pool]
    name = node_name(pool, index)
    resources = {"cpu": c.cpu, "memory": c.memory, "pods": "110", c.resource_name: str(c.gpus),
                 "ephemeral-storage": "3500Gi"}
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": name,
            "labels": _labels(c, name, index),
            "annotations": {
                KWOK_ANNOTATION[0]: KWOK_ANNOTATION[1],
                "node.alpha.kubernetes.io/ttl": "0",
            },
        },
        # No kwok taint: every node here is simulated, so workloads need no toleration.
        "spec": {},
        "status": {
            "capacity": dict(resources),
            "allocatable": dict(resources),
            # kwok fills the rest of nodeInfo (kubelet/runtime version "kwok-<version>").
            "nodeInfo": {"architecture": c.arch, "operatingSystem": "linux"},
        },
    }


def pool_manifests(pools: dict[str, int], start: dict[str, int] | None = None) -> list[dict[str, Any]]:
    """Manifests for `pools` (name -> node count). `start` gives the first index per pool, so
    growing a pool only creates the new nodes."""
    start = start or {}
    out = []
    for pool, count in pools.items():
        if pool not in GPU_CLASSES:
            raise ValueError(f"unknown pool {pool!r}; known: {', '.join(GPU_CLASSES)}")
        out.extend(node_manifest(pool, i) for i in range(start.get(pool, 0), count))
    return out


_NAME_RE = re.compile(r"^kwok-(?P<pool>[a-z0-9-]+)-(?P<index>\d{4,})$")


def parse_node_name(name: str) -> tuple[str, int] | None:
    m = _NAME_RE.match(name)
    return (m["pool"], int(m["index"])) if m else None
