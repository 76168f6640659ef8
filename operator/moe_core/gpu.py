"""GPU classes from node labels (NVIDIA GPU Feature Discovery, AMD device plugin) or a CLI name.

The architecture key is derived from the compute capability, never from the product name or
`nvidia.com/gpu.family` (GFD says `blackwell` for both SM100 and SM120, which need different
kernels). Missing or contradictory labels give a reason, not a guess.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from pydantic import BaseModel, Field

NVIDIA_FAMILIES = ("sm80", "sm89", "sm90", "sm100", "sm110", "sm120", "sm121")
AMD_FAMILIES = ("gfx942", "gfx950")
FAMILIES = NVIDIA_FAMILIES + AMD_FAMILIES

FP4_TENSOR_CORES = frozenset({"sm100", "sm110", "sm120", "sm121", "gfx950"})
BLACKWELL = frozenset({"sm100", "sm110", "sm120", "sm121"})

GFD = "nvidia.com/gpu."
CUDA = "nvidia.com/cuda."  # GFD's driver / CUDA runtime labels
# family key -> GFD's `nvidia.com/gpu.family` value (the node probe writes the same names)
GFD_FAMILY_NAME = {"sm80": "ampere", "sm89": "ada-lovelace", "sm90": "hopper", "sm100": "blackwell",
                   "sm120": "blackwell", "sm121": "blackwell"}


class GpuClass(BaseModel):
    """One kind of GPU node: what the planner needs to know about it."""

    family: str = Field(description="architecture key: sm80 sm89 sm90 sm100 sm110 sm120 sm121 gfx942 gfx950")
    vendor: str = "nvidia"
    product: str = ""
    computeCapability: str | None = None  # "9.0"
    count: int | None = None  # GPUs per node
    memoryMiB: int | None = None
    arch: str = "amd64"  # node CPU architecture (kubernetes.io/arch)
    driverMajor: int | None = None
    driverVersion: str | None = Field(None, description="NVIDIA driver version, e.g. 595.58.03 (GFD cuda.driver-version labels)")
    cudaMajor: int | None = None

    @property
    def is_rocm(self) -> bool:
        return self.vendor == "amd"

    def key(self) -> str:
        """Stable identifier of the class, e.g. `sm90/NVIDIA-H200`."""
        return f"{self.family}/{self.product}" if self.product else self.family


class GpuClassError(ValueError):
    pass


def family_from_compute(major: int, minor: int) -> str:
    """Family key from a CUDA compute capability (tuning-rules.md 6.4; SGLang keys on the major)."""
    if major == 8:
        return "sm89" if minor >= 9 else "sm80"
    if major == 9:
        return "sm90"
    if major == 10:
        return "sm100"  # 10.0 B200/GB200, 10.3 B300/GB300
    if major == 11:
        return "sm110"
    if major == 12:
        return "sm121" if minor >= 1 else "sm120"
    raise GpuClassError(f"compute capability {major}.{minor} is not a supported GPU architecture "
                        f"(supported: 8.x, 9.0, 10.x, 11.0, 12.0, 12.1)")


# Product names (GFD-sanitised NVML names or common short names) -> (family, compute, memory MiB).
# Used for the CLI (`--gpu H200`) and to cross-check labels; never to guess a missing capability.
PRODUCTS: dict[str, tuple[str, str, str, int | None]] = {
    # canonical GFD product       short names (lowercase, comma sep)      family   cc     MiB
    "NVIDIA-A100-SXM4-80GB": ("a100", "sm80", "8.0", 81920),
    "NVIDIA-L40S": ("l40s", "sm89", "8.9", 46068),
    "NVIDIA-H100-80GB-HBM3": ("h100,h100-sxm", "sm90", "9.0", 81559),
    "NVIDIA-H200": ("h200", "sm90", "9.0", 143771),
    "NVIDIA-H20": ("h20", "sm90", "9.0", 97871),
    "NVIDIA-GH200-480GB": ("gh200", "sm90", "9.0", 97871),
    "NVIDIA-B200": ("b200", "sm100", "10.0", 183359),
    "NVIDIA-GB200": ("gb200", "sm100", "10.0", 189471),
    "NVIDIA-B300": ("b300", "sm100", "10.3", 288000),
    "NVIDIA-GB300": ("gb300", "sm100", "10.3", 288000),
    "NVIDIA-Thor": ("thor,jetson-thor", "sm110", "11.0", None),
    "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition": ("rtx-pro-6000,rtxpro6000,rtx-pro-6000-blackwell", "sm120", "12.0", 97887),
    "NVIDIA-GeForce-RTX-5090": ("rtx5090,rtx-5090", "sm120", "12.0", 32607),
    "NVIDIA-GB10": ("gb10,dgx-spark", "sm121", "12.1", None),
    "AMD-Instinct-MI300X": ("mi300x", "gfx942", "gfx942", 196608),
    "AMD-Instinct-MI325X": ("mi325x", "gfx942", "gfx942", 262144),
    "AMD-Instinct-MI355X": ("mi355x,mi350x", "gfx950", "gfx950", 294912),
}


def _norm(s: str) -> str:
    return re.sub(r"[^a-z0-9]", "", s.lower())


def from_name(name: str) -> GpuClass:
    """A GPU class from a CLI value: a family key (`sm90`), a product (`H200`, `NVIDIA-B200`)."""
    n = name.strip()
    if n.lower() in FAMILIES:
        fam = n.lower()
        vendor = "amd" if fam.startswith("gfx") else "nvidia"
        product = next((p for p, (_, f, _, _) in PRODUCTS.items() if f == fam), "")
        return GpuClass(family=fam, vendor=vendor, product=product)
    key = _norm(n)
    for product, (shorts, fam, cc, mem) in PRODUCTS.items():
        if key == _norm(product) or key in {_norm(s) for s in shorts.split(",")}:
            vendor = "amd" if fam.startswith("gfx") else "nvidia"
            return GpuClass(family=fam, vendor=vendor, product=product,
                            computeCapability=None if vendor == "amd" else cc, memoryMiB=mem,
                            arch="arm64" if product in ("NVIDIA-GB200", "NVIDIA-GB300", "NVIDIA-GH200-480GB", "NVIDIA-GB10") else "amd64")
    known = ", ".join(sorted({s.split(",")[0] for s, *_ in PRODUCTS.values()} | set(FAMILIES)))
    raise GpuClassError(f"unknown GPU {name!r}; use a family key or a product name, e.g. {known}")


def _int_label(labels: dict[str, str], key: str) -> int | None:
    v = labels.get(key)
    if v is None or v == "":
        return None
    try:
        return int(v)
    except ValueError:
        raise GpuClassError(f"label {key}={v!r} is not an integer") from None


_DRIVER = re.compile(r"^\d{2,4}(\.\d{1,3}){0,2}$")


def parse_driver_version(value: str) -> str:
    """A driver version as given on the CLI or in a label ('595', '595.0', '570.124.06')."""
    v = value.strip()
    if not _DRIVER.match(v):
        raise GpuClassError(f"NVIDIA driver version {value!r} is not of the form MAJOR[.MINOR[.REV]] (e.g. 595.0 or 570.124.06)")
    return v


def vtuple_major(version: str | None) -> int | None:
    return int(version.split(".")[0]) if version else None


def driver_from_labels(nv: dict[str, str]) -> str | None:
    """The node's NVIDIA driver version from GFD labels: `nvidia.com/cuda.driver-version.full`
    (or its .major/.minor/.revision parts), else the older `nvidia.com/cuda.driver.major/.minor/.rev`.
    Labels that contradict each other are an error, not a guess."""
    full = nv.get(CUDA + "driver-version.full", "").strip()
    found = []
    for prefix, parts in ((CUDA + "driver-version.", ("major", "minor", "revision")),
                          (CUDA + "driver.", ("major", "minor", "rev"))):
        vals = [nv.get(prefix + p, "").strip() for p in parts]
        if vals[0]:
            found.append((prefix, ".".join(v for v in vals if v)))
    for prefix, v in found:
        if not _DRIVER.match(v):
            raise GpuClassError(f"labels {prefix}* give driver version {v!r}, not MAJOR[.MINOR[.REV]]")
    if full:
        full = parse_driver_version(full)
        for prefix, v in found:
            if v.split(".")[0] != full.split(".")[0]:
                raise GpuClassError(f"contradictory labels: {CUDA}driver-version.full={full} but {prefix}major="
                                    f"{v.split('.')[0]}")
        return full
    if len(found) == 2 and found[0][1].split(".")[0] != found[1][1].split(".")[0]:
        raise GpuClassError(f"contradictory labels: {found[0][0]}major={found[0][1].split('.')[0]} but "
                            f"{found[1][0]}major={found[1][1].split('.')[0]}")
    return found[0][1] if found else None


def with_driver(gpu: GpuClass, version: str | None) -> GpuClass:
    """The class with a driver version (the `plan --driver` flag)."""
    if version is None:
        return gpu
    v = parse_driver_version(version)
    return gpu.model_copy(update={"driverVersion": v, "driverMajor": vtuple_major(v)})


@dataclass(frozen=True)
class NodeGpuFacts:
    """Result of reading one node: a class, or the reason there is none."""

    gpu_class: GpuClass | None
    reason: str  # why this node has (or has no) GPU class


def from_node_labels(labels: dict[str, str], capacity: dict[str, str] | None = None,
                     annotations: dict[str, str] | None = None) -> NodeGpuFacts:
    """Read a node's GPU class from GFD labels, AMD labels, or the node-probe annotations."""
    capacity = capacity or {}
    annotations = annotations or {}
    arch = labels.get("kubernetes.io/arch", "amd64")
    # Node-probe annotations (written by `moe-runtime probe` DaemonSet) stand in for GFD labels.
    probe = {k.replace("moe.serving.dev/gpu.", GFD): v for k, v in annotations.items()
             if k.startswith("moe.serving.dev/gpu.")}
    probe_driver = {k.replace("moe.serving.dev/cuda.", CUDA): v for k, v in annotations.items()
                    if k.startswith("moe.serving.dev/cuda.")}
    gfd_driver = any(k.startswith(CUDA) for k in labels)  # GFD's own driver labels win as a whole set
    nv = {**probe, **({} if gfd_driver else probe_driver),
          **{k: v for k, v in labels.items() if k.startswith((GFD, CUDA))}}
    amd = {k: v for k, v in labels.items() if k.startswith("amd.com/gpu.")}
    try:
        if nv.get(GFD + "product") or nv.get(GFD + "compute.major"):
            return _from_nvidia(nv, capacity, arch, from_probe=bool(probe) and not any(k.startswith(GFD) for k in labels))
        if amd or "amd.com/gpu" in capacity:
            return _from_amd(amd, capacity, arch)
    except GpuClassError as e:
        return NodeGpuFacts(None, str(e))
    if "nvidia.com/gpu" in capacity:
        return NodeGpuFacts(None, "node has nvidia.com/gpu capacity but no GPU Feature Discovery labels "
                                  "(nvidia.com/gpu.product, nvidia.com/gpu.compute.major); install GFD or enable the node probe")
    return NodeGpuFacts(None, "no GPU labels or GPU capacity")


def _from_nvidia(nv: dict[str, str], capacity: dict[str, str], arch: str, from_probe: bool) -> NodeGpuFacts:
    product = nv.get(GFD + "product", "")
    major, minor = _int_label(nv, GFD + "compute.major"), _int_label(nv, GFD + "compute.minor")
    if major is None:
        raise GpuClassError(f"GPU product {product!r} has no nvidia.com/gpu.compute.major label "
                            "(GFD publishes it; refusing to guess the architecture from the product name)")
    family = family_from_compute(major, minor or 0)
    # Cross-check against the product table: contradictory labels are an error, not a guess.
    base = product.removesuffix("-SHARED").split("-MIG-")[0]
    if base in PRODUCTS and PRODUCTS[base][1] != family:
        raise GpuClassError(f"contradictory labels: product {product} is {PRODUCTS[base][1]} but "
                            f"compute capability {major}.{minor or 0} means {family}")
    gfd_family = nv.get(GFD + "family")
    expected = GFD_FAMILY_NAME.get(family)
    if gfd_family and expected and gfd_family != expected:
        raise GpuClassError(f"contradictory labels: nvidia.com/gpu.family={gfd_family} but compute "
                            f"capability {major}.{minor or 0} is {expected}")
    driver = driver_from_labels(nv)
    count = _int_label(nv, GFD + "count")
    cap = capacity.get("nvidia.com/gpu")
    if count is None and cap is not None:
        count = int(cap)
    cls = GpuClass(family=family, vendor="nvidia", product=product or family,
                   computeCapability=f"{major}.{minor or 0}", count=count,
                   memoryMiB=_int_label(nv, GFD + "memory"), arch=arch,
                   driverMajor=vtuple_major(driver), driverVersion=driver,
                   cudaMajor=_int_label(nv, CUDA + "runtime-version.major") or _int_label(nv, CUDA + "runtime.major"))
    if product.endswith("-SHARED") or (nv.get(GFD + "replicas") not in (None, "", "1")):
        return NodeGpuFacts(None, f"{product}: GPUs are shared (time-slicing/MPS); MoE serving needs whole GPUs")
    src = "node-probe annotations" if from_probe else "GFD labels"
    return NodeGpuFacts(cls, f"{src}: {product} compute {major}.{minor or 0} -> {family}")


# AMD GPU device-plugin node labeller: product names and device ids -> gfx target.
_AMD_DEVICE_IDS = {"74a1": "gfx942", "74a5": "gfx942", "74b5": "gfx942", "75a0": "gfx950", "75a3": "gfx950"}


def _from_amd(amd: dict[str, str], capacity: dict[str, str], arch: str) -> NodeGpuFacts:
    family = None
    for key in ("amd.com/gpu.family-target", "amd.com/gpu.arch", "amd.com/gpu.gfx"):
        v = amd.get(key, "").lower()
        if v.startswith("gfx"):
            family = v
    dev = amd.get("amd.com/gpu.device-id", "").lower()
    if family is None and dev in _AMD_DEVICE_IDS:
        family = _AMD_DEVICE_IDS[dev]
    product = amd.get("amd.com/gpu.product-name", "")
    if family is None:
        base = next((p for p in PRODUCTS if _norm(product) and _norm(p).endswith(_norm(product))), None)
        if base:
            family = PRODUCTS[base][1]
    if family not in AMD_FAMILIES:
        raise GpuClassError(f"AMD GPU node without a recognisable gfx target (labels: {sorted(amd)}); "
                            "supported: gfx942 (MI300X/MI325X), gfx950 (MI350X/MI355X)")
    count = capacity.get("amd.com/gpu")
    vram = amd.get("amd.com/gpu.vram", "")
    mem = None
    m = re.match(r"(\d+)\s*G", vram)
    if m:
        mem = int(m.group(1)) * 1024
    cls = GpuClass(family=family, vendor="amd", product=product or family,
                   count=int(count) if count else None, memoryMiB=mem, arch=arch)
    return NodeGpuFacts(cls, f"AMD labels: {product or dev} -> {family}")
