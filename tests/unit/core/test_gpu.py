import pytest

from moe_core.gpu import GpuClassError, family_from_compute, from_name, from_node_labels


def gfd(product, major, minor, family=None, **extra):
    labels = {"nvidia.com/gpu.product": product, "nvidia.com/gpu.compute.major": str(major),
              "nvidia.com/gpu.compute.minor": str(minor), "nvidia.com/gpu.count": "8", "nvidia.com/gpu.memory": "143771"}
    if family:
        labels["nvidia.com/gpu.family"] = family
    labels.update(extra)
    return labels


@pytest.mark.parametrize("product,major,minor,fam", [
    ("NVIDIA-H100-80GB-HBM3", 9, 0, "sm90"), ("NVIDIA-H200", 9, 0, "sm90"), ("NVIDIA-B200", 10, 0, "sm100"),
    ("NVIDIA-GB200", 10, 0, "sm100"), ("NVIDIA-B300", 10, 3, "sm100"),
    ("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", 12, 0, "sm120"), ("NVIDIA-GB10", 12, 1, "sm121"),
    ("NVIDIA-L40S", 8, 9, "sm89"), ("NVIDIA-A100-SXM4-80GB", 8, 0, "sm80"),
])
def test_gfd_labels(product, major, minor, fam):
    facts = from_node_labels(gfd(product, major, minor), {"nvidia.com/gpu": "8"})
    assert facts.gpu_class.family == fam and facts.gpu_class.count == 8 and facts.gpu_class.product == product


def test_family_label_does_not_split_blackwell():
    # GFD says "blackwell" for both; the compute capability decides.
    assert from_node_labels(gfd("NVIDIA-B200", 10, 0, "blackwell")).gpu_class.family == "sm100"
    assert from_node_labels(gfd("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", 12, 0, "blackwell")).gpu_class.family == "sm120"


def test_missing_compute_label_is_a_reason_not_a_guess():
    facts = from_node_labels({"nvidia.com/gpu.product": "NVIDIA-H200"})
    assert facts.gpu_class is None and "compute.major" in facts.reason


def test_contradictory_labels():
    facts = from_node_labels(gfd("NVIDIA-H200", 10, 0))
    assert facts.gpu_class is None and "contradictory" in facts.reason
    facts = from_node_labels(gfd("NVIDIA-X", 9, 0, "blackwell"))
    assert facts.gpu_class is None and "contradictory" in facts.reason


def test_capacity_without_labels():
    facts = from_node_labels({}, {"nvidia.com/gpu": "8"})
    assert facts.gpu_class is None and "GPU Feature Discovery" in facts.reason


def test_shared_gpus_refused():
    assert from_node_labels(gfd("NVIDIA-H200-SHARED", 9, 0)).gpu_class is None


def test_node_probe_annotations():
    ann = {"moe.serving.dev/gpu.product": "NVIDIA-H200", "moe.serving.dev/gpu.compute.major": "9",
           "moe.serving.dev/gpu.compute.minor": "0", "moe.serving.dev/gpu.count": "8"}
    facts = from_node_labels({}, {"nvidia.com/gpu": "8"}, ann)
    assert facts.gpu_class.family == "sm90" and "probe" in facts.reason


def test_amd_labels():
    facts = from_node_labels({"amd.com/gpu.device-id": "74a1", "amd.com/gpu.product-name": "AMD-Instinct-MI300X"},
                             {"amd.com/gpu": "8"})
    assert facts.gpu_class.family == "gfx942" and facts.gpu_class.vendor == "amd"
    facts = from_node_labels({"amd.com/gpu.device-id": "ffff"}, {"amd.com/gpu": "8"})
    assert facts.gpu_class is None and "gfx" in facts.reason


def test_cli_names():
    assert from_name("H200").family == "sm90"
    assert from_name("sm120").family == "sm120"
    assert from_name("NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition").family == "sm120"
    assert from_name("gb200").arch == "arm64"
    with pytest.raises(GpuClassError, match="unknown GPU"):
        from_name("voodoo")
    with pytest.raises(GpuClassError):
        family_from_compute(7, 5)
