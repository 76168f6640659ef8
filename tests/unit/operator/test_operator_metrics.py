"""moe_operator_decisions_total by GPU class (issue 32 item 1) and the free-GPUs gauge: the class
key as status.gpuClass names it, a bounded number of label values, stale classes removed."""

from __future__ import annotations

import pytest
from prometheus_client import REGISTRY

from moe_core.gpu import GpuClass
from moe_operator import metrics

H200 = GpuClass(family="sm90", product="NVIDIA-H200")


@pytest.fixture(autouse=True)
def fresh_labels(monkeypatch):
    monkeypatch.setattr(metrics, "_class_labels", set())
    monkeypatch.setattr(metrics, "_free_labels", set())


def decisions(**labels) -> float | None:
    return REGISTRY.get_sample_value("moe_operator_decisions_total", labels)


def test_a_decision_counts_under_its_class_key():
    before = decisions(engine="sglang", gpu_family="sm90", gpu_class="sm90/NVIDIA-H200", backend="deep_gemm") or 0
    metrics.decided("sglang", H200, "deep_gemm")
    assert decisions(engine="sglang", gpu_family="sm90", gpu_class="sm90/NVIDIA-H200", backend="deep_gemm") == before + 1
    assert metrics.class_label(GpuClass(family="gfx942")) == "gfx942"  # a class without a product


def test_label_values_are_bounded(monkeypatch):
    monkeypatch.setattr(metrics, "MAX_CLASS_LABELS", 3)
    odd = [GpuClass(family="sm80", product=f"NVIDIA-A100-SXM4-40GB-MIG-{i}g.5gb") for i in range(6)]
    got = [metrics.class_label(g) for g in odd]
    assert got[:3] == [g.key() for g in odd[:3]] and got[3:] == ["sm80/other"] * 3
    assert metrics.class_label(odd[1]) == odd[1].key()  # a class seen before keeps its label
    metrics.decided("vllm", odd[5], "triton")
    assert decisions(engine="vllm", gpu_family="sm80", gpu_class="sm80/other", backend="triton") >= 1


def test_free_gpus_per_class_label_and_a_class_gone_is_removed(monkeypatch):
    def free(label):
        return REGISTRY.get_sample_value("moe_operator_gpu_class_free_gpus", {"gpu_class": label})

    b200 = GpuClass(family="sm100", product="NVIDIA-B200")
    metrics.set_free_gpus([(H200, 8), (b200, 3)])
    assert free("sm90/NVIDIA-H200") == 8 and free("sm100/NVIDIA-B200") == 3
    metrics.set_free_gpus([(H200, 5)])
    assert free("sm90/NVIDIA-H200") == 5 and free("sm100/NVIDIA-B200") is None
    monkeypatch.setattr(metrics, "MAX_CLASS_LABELS", 1)  # H200 holds the one label; two others share sm100/other
    monkeypatch.setattr(metrics, "_class_labels", {"sm90/NVIDIA-H200"})
    metrics.set_free_gpus([(H200, 1), (b200, 2), (GpuClass(family="sm100", product="NVIDIA-GB200"), 4)])
    assert free("sm90/NVIDIA-H200") == 1 and free("sm100/other") == 6
    metrics.set_free_gpus([])
    assert free("sm90/NVIDIA-H200") is None and free("sm100/other") is None
