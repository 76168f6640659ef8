"""`moe-runtime probe`: the node's GPUs through NVML (nvidia-ml-py), as JSON.

`gpu_family` maps a compute capability to the registry's family keys; the serve-time plan check and
the operator's node probe use the same mapping.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from moe_core.gpu import GFD_FAMILY_NAME, GpuClassError, family_from_compute

from .errors import RuntimeFailure


def gpu_family(major: int, minor: int) -> str:
    """Compute capability -> registry family key, by moe_core.gpu's mapping (one table)."""
    try:
        return family_from_compute(major, minor)
    except GpuClassError:  # still report the device; the plan check will refuse it by name
        return f"sm{major}{minor}"


ANNOTATION_PREFIX = "moe.serving.dev/gpu."
DRIVER_ANNOTATION_PREFIX = "moe.serving.dev/cuda.driver-version."  # GFD: nvidia.com/cuda.driver-version.*


@dataclass
class GpuInfo:
    index: int
    name: str
    computeCapability: str
    family: str
    memoryTotalBytes: int
    uuid: str | None = None


@dataclass
class ProbeResult:
    count: int
    driverVersion: str | None
    cudaDriverVersion: str | None
    gpus: list[GpuInfo] = field(default_factory=list)

    @property
    def family(self) -> str:
        return self.gpus[0].family if self.gpus else "cpu"

    @property
    def product(self) -> str:
        return self.gpus[0].name if self.gpus else "cpu"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["family"] = self.family
        d["product"] = self.product
        return d


def _s(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def probe_nvml() -> ProbeResult:
    """Raise RuntimeFailure(exit 1) when there is no NVIDIA driver or no GPU."""
    try:
        import pynvml
    except ImportError:
        raise RuntimeFailure("nvidia-ml-py (pynvml) is not installed; cannot probe GPUs", exit_code=1) from None
    try:
        pynvml.nvmlInit()
    except Exception as e:  # NVMLError_LibraryNotFound / DriverNotLoaded
        raise RuntimeFailure(f"no NVIDIA GPU driver found on this machine (NVML: {e})", exit_code=1) from None
    try:
        n = pynvml.nvmlDeviceGetCount()
        if n == 0:
            raise RuntimeFailure("the NVIDIA driver is loaded but reports no GPUs", exit_code=1)
        driver = _s(pynvml.nvmlSystemGetDriverVersion())
        try:
            cv = pynvml.nvmlSystemGetCudaDriverVersion()
            cuda = f"{cv // 1000}.{(cv % 1000) // 10}"
        except Exception:
            cuda = None
        gpus = []
        for i in range(n):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            major, minor = pynvml.nvmlDeviceGetCudaComputeCapability(h)
            try:
                uuid = _s(pynvml.nvmlDeviceGetUUID(h))
            except Exception:
                uuid = None
            gpus.append(GpuInfo(index=i, name=_s(pynvml.nvmlDeviceGetName(h)), computeCapability=f"{major}.{minor}",
                                family=gpu_family(major, minor),
                                memoryTotalBytes=int(pynvml.nvmlDeviceGetMemoryInfo(h).total), uuid=uuid))
        return ProbeResult(count=n, driverVersion=driver, cudaDriverVersion=cuda, gpus=gpus)
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:
            pass


def node_annotations(result: ProbeResult) -> dict[str, str]:
    """The node-probe annotations: GPU Feature Discovery's label names under our prefix
    (`nvidia.com/gpu.product` -> `moe.serving.dev/gpu.product`), read by moe_core.gpu."""
    g = result.gpus[0]
    major, minor = g.computeCapability.split(".")
    ann = {"product": g.name.replace(" ", "-"),  # GFD sanitises the NVML name the same way
           "compute.major": major, "compute.minor": minor, "count": str(result.count),
           "memory": str(g.memoryTotalBytes // (1024 * 1024))}
    if g.family in GFD_FAMILY_NAME:
        ann["family"] = GFD_FAMILY_NAME[g.family]
    if len({x.name for x in result.gpus}) > 1:  # mixed GPUs: the operator must not assume a class
        ann["product"] = "MIXED-" + "-".join(sorted({x.name.replace(" ", "-") for x in result.gpus}))
    out = {ANNOTATION_PREFIX + k: v for k, v in ann.items()}
    # The driver rules (e.g. triton_kernels on driver >= 595) need the version where GFD is absent too.
    if result.driverVersion:
        parts = result.driverVersion.strip().split(".")
        for name, v in zip(("major", "minor", "revision"), parts):
            out[DRIVER_ANNOTATION_PREFIX + name] = v
    return out


def annotate_node(node: str, annotations: dict[str, str]) -> None:
    """Merge-patch the annotations onto the Node (in-cluster ServiceAccount, else kubeconfig)."""
    try:
        from kubernetes import client, config
    except ImportError:
        raise RuntimeFailure("the kubernetes Python client is not installed; cannot annotate the node") from None
    try:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        client.CoreV1Api().patch_node(node, {"metadata": {"annotations": annotations}})
    except Exception as e:
        raise RuntimeFailure(f"cannot annotate node {node}: {type(e).__name__}: {e}") from None


def probe_device(requested: str = "auto") -> tuple[str, ProbeResult | None]:
    """Which torch device to serve on: ('cpu', None) or ('cuda', probe). `requested` is auto|cpu|cuda."""
    if requested == "cpu":
        return "cpu", None
    try:
        result = probe_nvml()
    except RuntimeFailure as e:
        if requested == "cuda":
            raise RuntimeFailure(f"--device cuda but {e}") from None
        return "cpu", None
    import torch

    if not torch.cuda.is_available():
        if requested == "cuda":
            raise RuntimeFailure("--device cuda but torch cannot use the GPU (torch.cuda.is_available() is False)")
        return "cpu", None
    return "cuda", result
