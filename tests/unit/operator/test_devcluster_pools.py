"""The pool table -> Node manifests (pure; no cluster, no binaries)."""

from __future__ import annotations

import pytest

from moe_operator.devcluster import pools as P


def test_every_pool_has_a_class_and_the_default_size():
    assert set(P.parse_pools(None)) == {"h100", "h200", "b200", "gb200", "rtx-pro-6000", "mi300x"}
    assert set(P.parse_pools(None).values()) == {P.DEFAULT_POOL_SIZE}


@pytest.mark.parametrize("spec,expected", [
    ("h200=2,b200=1", {"h200": 2, "b200": 1}),
    (" h200 = 3 , mi300x", {"h200": 3, "mi300x": P.DEFAULT_POOL_SIZE}),
    ("all=0,b200=5", {**{p: 0 for p in P.GPU_CLASSES}, "b200": 5}),
])
def test_parse_pools(spec, expected):
    assert P.parse_pools(spec) == expected


@pytest.mark.parametrize("spec", ["a100=2", "h200=two", "h200=-1"])
def test_parse_pools_rejects(spec):
    with pytest.raises(ValueError):
        P.parse_pools(spec)


@pytest.mark.parametrize("pool,product,major,minor,family,mem,arch", [
    ("h100", "NVIDIA-H100-80GB-HBM3", "9", "0", "hopper", "81559", "amd64"),
    ("h200", "NVIDIA-H200", "9", "0", "hopper", "143771", "amd64"),
    ("b200", "NVIDIA-B200", "10", "0", "blackwell", "183359", "amd64"),
    ("gb200", "NVIDIA-GB200", "10", "0", "blackwell", "189471", "arm64"),
    ("rtx-pro-6000", "NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition", "12", "0", "blackwell", "97887", "amd64"),
])
def test_nvidia_nodes_carry_gfd_labels(pool, product, major, minor, family, mem, arch):
    node = P.node_manifest(pool, 0)
    labels = node["metadata"]["labels"]
    assert labels["nvidia.com/gpu.present"] == "true"
    assert labels["nvidia.com/gpu.product"] == product
    assert labels["nvidia.com/gpu.compute.major"] == major
    assert labels["nvidia.com/gpu.compute.minor"] == minor
    assert labels["nvidia.com/gpu.family"] == family
    assert labels["nvidia.com/gpu.memory"] == mem
    assert labels["kubernetes.io/arch"] == arch == node["status"]["nodeInfo"]["architecture"]
    assert labels["kubernetes.io/os"] == "linux"
    assert labels["nvidia.com/cuda.driver.major"] == "580"
    assert labels["nvidia.com/cuda.driver-version.full"] == "580.95.05"
    assert labels["nvidia.com/cuda.runtime.major"] == "13"
    assert labels[P.POOL_LABEL] == pool
    assert labels["node.kubernetes.io/instance-type"]
    gpus = labels["nvidia.com/gpu.count"]
    assert node["status"]["capacity"]["nvidia.com/gpu"] == gpus
    assert node["status"]["allocatable"]["nvidia.com/gpu"] == gpus
    assert not any(k.startswith("amd.com/") for k in labels)
    # every label value must be a valid Kubernetes label value
    assert all(len(v) <= 63 and all(ch.isalnum() or ch in "-_." for ch in v) for v in labels.values())


def test_gpu_counts_and_gb200_machine():
    assert P.node_manifest("h200", 0)["status"]["capacity"]["nvidia.com/gpu"] == "8"
    gb = P.node_manifest("gb200", 0)["metadata"]["labels"]
    # A GB200 NVL72 compute tray has 4 GPUs; 18 trays form one NVLink clique.
    assert gb["nvidia.com/gpu.count"] == "4"
    assert gb["nvidia.com/gpu.machine"] == "NVIDIA-GB200-NVL72"
    cliques = {P.node_manifest("gb200", i)["metadata"]["labels"]["nvidia.com/gpu.clique"] for i in range(36)}
    assert len(cliques) == 2


def test_amd_node_uses_rocm_labeller_labels():
    node = P.node_manifest("mi300x", 1)
    labels = node["metadata"]["labels"]
    assert labels["amd.com/gpu.product-name"] == "AMD_Instinct_MI300X_OAM"
    assert labels["amd.com/gpu.device-id"] == "74a1"
    assert labels["amd.com/gpu.family"] == "AI"
    assert labels["amd.com/gpu.vram"] == "192G"
    assert node["status"]["capacity"]["amd.com/gpu"] == "8"
    assert "nvidia.com/gpu" not in node["status"]["capacity"]
    assert not any(k.startswith("nvidia.com/") for k in labels)
    assert P.GPU_CLASSES["mi300x"].gfx_target == "gfx942"


def test_nodes_are_kwok_managed_and_named_by_pool():
    node = P.node_manifest("b200", 7)
    assert node["metadata"]["name"] == "kwok-b200-0007"
    assert node["metadata"]["annotations"][P.KWOK_ANNOTATION[0]] == P.KWOK_ANNOTATION[1]
    assert P.parse_node_name("kwok-rtx-pro-6000-0012") == ("rtx-pro-6000", 12)
    assert P.parse_node_name("some-node") is None


def test_pool_manifests_grow_only_missing_indices():
    ms = P.pool_manifests({"h200": 3, "b200": 1}, start={"h200": 2})
    assert [m["metadata"]["name"] for m in ms] == ["kwok-h200-0002", "kwok-b200-0000"]
    assert len(P.pool_manifests({p: 100 for p in P.GPU_CLASSES})) == 600
    with pytest.raises(ValueError):
        P.pool_manifests({"tpu": 1})


def test_labels_are_read_back_by_the_operators_gpu_inventory():
    """The simulated nodes must classify as the operator's inventory expects."""
    gpu = pytest.importorskip("moe_core.gpu")
    for pool, fam in [("h100", "sm90"), ("h200", "sm90"), ("b200", "sm100"), ("gb200", "sm100"),
                      ("rtx-pro-6000", "sm120"), ("mi300x", "gfx942")]:
        node = P.node_manifest(pool, 0)
        facts = gpu.from_node_labels(node["metadata"]["labels"], node["status"]["capacity"])
        assert facts.gpu_class is not None and facts.gpu_class.family == fam, (pool, facts)
