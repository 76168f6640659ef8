"""Runtime image variants: the image follows the node (CPU arch, CUDA major, flashinfer on Blackwell).

The renderer reads the tags here; what each variant holds is moe_core.image_contents (the planner reads it too).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from moe_core import image_contents
from moe_core.gpu import GpuClass, from_name

from .engines.sglang import image as _sglang_image, vocab as _sglang_vocab
from .engines.vllm import image as _vllm_image, vocab as _vllm_vocab

RUNTIME_REPOSITORY = "ghcr.io/moe-operator/moe-runtime"
RUNTIME_VERSION = "0.1.0"
# flashinfer-python of the Blackwell variants, and which families get them: the image-contents table's
BUNDLED_FLASHINFER = image_contents.FLASHINFER
FLASHINFER_FAMILIES = image_contents.FLASHINFER_FAMILIES


def bundled_image_flashinfer(gpu: GpuClass) -> str | None:
    return image_contents.bundled_packages(gpu.family, gpu.is_rocm)["flashinfer-python"]


def bundled_image_packages(gpu: GpuClass) -> dict[str, str | None]:
    """The kernel packages of the runtime image variant this GPU class gets (moe_core.image_contents)."""
    return image_contents.bundled_packages(gpu.family, gpu.is_rocm)


def cuda_major(gpu: GpuClass) -> int:
    """CUDA major of the image: what the node's driver supports (CUDA 13 needs driver >= 580)."""
    if gpu.cudaMajor:
        return min(gpu.cudaMajor, 13)
    if gpu.driverMajor:
        return 13 if gpu.driverMajor >= 580 else 12
    return 12 if gpu.family in ("sm80", "sm89") else 13


def runtime_image(gpu: GpuClass, repository: str | None = None, version: str | None = None) -> str:
    """e.g. ghcr.io/moe-operator/moe-runtime:0.1.0-cu13-flashinfer-arm64 for a GB200 node.
    Unset repository/version: the operator's configured registries (chart runtimeImage)."""
    repository = repository or REGISTRIES.runtime_repository
    version = version or REGISTRIES.runtime_tag
    if gpu.is_rocm:
        return f"{repository}:{version}-rocm"
    parts = [version, f"cu{cuda_major(gpu)}"]
    if gpu.family in FLASHINFER_FAMILIES:
        parts.append("flashinfer")
    if gpu.arch == "arm64":
        parts.append("arm64")
    return f"{repository}:{'-'.join(parts)}"


def tool_image(repository: str | None = None) -> str:
    """The runtime image of the operator's own Jobs (checkpoint inspection, model cache fill): they
    need no GPU and are pinned to amd64 nodes, so the amd64 CUDA variant whatever GPU the workload gets."""
    return runtime_image(from_name("sm90"), repository)


# --- engine images (sglang, vLLM) per CPU architecture -------------------------------------------
# What the projects publish, read from their release pipelines:
# - vLLM (.buildkite/scripts, the release-image publishing script): vllm/vllm-openai:v<ver> is a
#   multi-arch manifest of v<ver>-x86_64 and v<ver>-aarch64 (CUDA 12.9), and v<ver>-cu130 one of
#   v<ver>-x86_64-cu130 and v<ver>-aarch64-cu130. The per-arch tags are pushed too, so an arm64
#   node gets the aarch64 tag by name (what runs is what the pod spec says).
# - sglang (.github/workflows/release-docker.yml, _docker-build-and-publish.yml): lmsysorg/sglang:
#   v<ver> is a multi-arch manifest of an amd64 image and an arm64 one built with GRACE_BLACKWELL=1
#   (GB200/GB300). Newer releases push the per-arch images by digest only (no per-arch tag), so
#   the manifest tag is the only arm64 reference that exists for every release.
# ROCm keeps the references it had (amd64 only). A custom spec.engine.image always wins.
# Each engine's repository and arm64 tag suffix are in engines/<engine>/image.py.
ENGINE_REPOSITORIES = {_sglang_vocab.NAME: _sglang_image.REPOSITORY, _vllm_vocab.NAME: _vllm_image.REPOSITORY}
ARM64_TAG_SUFFIX = {_sglang_vocab.NAME: _sglang_image.ARM64_TAG_SUFFIX, _vllm_vocab.NAME: _vllm_image.ARM64_TAG_SUFFIX}
DEFAULT_TAG = "v{version}"


@dataclass(frozen=True)
class Registries:
    """Where the default images come from (private registries, air-gapped mirrors): the chart's
    runtimeImage and engineImages values, as `moe-operator run` flags. A tag template's {version}
    is the engine release the plan is for; the arm64/ROCm suffixes above are appended as for the
    public tags, so a mirror keeps the same tag scheme."""

    runtime_repository: str = RUNTIME_REPOSITORY
    runtime_tag: str = RUNTIME_VERSION  # the version part; -cu<N>[-flashinfer][-arm64] is appended
    engine_repositories: dict[str, str] = field(default_factory=lambda: dict(ENGINE_REPOSITORIES))
    engine_tags: dict[str, str] = field(default_factory=lambda: {e: DEFAULT_TAG for e in ENGINE_REPOSITORIES})
    pull_secrets: tuple[str, ...] = ()  # Secrets every rendered pod names (they must exist in its namespace)


REGISTRIES = Registries()


def configure(registries: Registries) -> None:
    """Set at start-up by `moe-operator run` (before any reconcile); read by runtime_image/engine_image."""
    global REGISTRIES
    REGISTRIES = registries


def engine_image(engine: str, version: str, gpu: GpuClass, registries: Registries | None = None) -> str:
    """Default image of engine sglang or vllm for a GPU class (its CPU arch, ROCm or CUDA)."""
    r = registries or REGISTRIES
    tag = r.engine_tags.get(engine, DEFAULT_TAG).replace("{version}", version)
    base = f"{r.engine_repositories[engine]}:{tag}"
    if gpu.is_rocm:
        return base + "-rocm"
    if gpu.arch == "arm64":
        return base + ARM64_TAG_SUFFIX[engine]
    return base


def default_image(engine: str, version: str, gpu: GpuClass, registries: Registries | None = None) -> str:
    """The image a plan for `engine` on `gpu` runs when spec.engine.image is unset (render and `moe-operator plan`)."""
    if engine in ENGINE_REPOSITORIES:
        return engine_image(engine, version, gpu, registries)
    r = registries or REGISTRIES
    return runtime_image(gpu, r.runtime_repository, r.runtime_tag)
