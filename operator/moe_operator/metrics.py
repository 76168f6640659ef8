"""Prometheus metrics of the operator (served by `moe-operator run --metrics-port`)."""

from __future__ import annotations

from typing import Iterable

from prometheus_client import Counter, Gauge, Histogram

from moe_core.gpu import GpuClass


# Distinct gpu_class label values, at most: past it a new class counts as `<family>/other`. A
# cluster has a handful of GPU classes; product names come from node labels, so without a bound
# every odd name a node reports would add series for ever (counters keep their label sets).
MAX_CLASS_LABELS = 32
_class_labels: set[str] = set()


def class_label(gpu: GpuClass) -> str:
    """The gpu_class label of a GPU class: its key (`sm90/NVIDIA-H200`, as status.gpuClass and the
    inventory name it) for the first MAX_CLASS_LABELS classes seen, then `<family>/other`."""
    key = gpu.key()
    if key in _class_labels or len(_class_labels) < MAX_CLASS_LABELS:
        _class_labels.add(key)
        return key
    return f"{gpu.family}/other"


RECONCILES = Counter("moe_operator_reconciles_total", "Reconciles of MoEDeployments", ["result"])
DECISIONS = Counter("moe_operator_decisions_total",
                     "Plans made, by engine, GPU family, GPU class (class_label) and MoE backend",
                     ["engine", "gpu_family", "gpu_class", "backend"])
ERRORS = Counter("moe_operator_errors_total", "Reconcile errors by reason", ["reason"])
INSPECTION_SECONDS = Histogram("moe_operator_checkpoint_inspection_seconds", "Checkpoint inspection latency",
                               ["scheme"], buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120))
GPU_CLASSES = Gauge("moe_operator_gpu_class_free_gpus", "Free GPUs per GPU class (class_label)", ["gpu_class"])
# The operator's own admission endpoint (webhook_tls.Health): 0 while it is Degraded (not listening,
# certificate expired or past its renewal, or the self-check handshake failing); /healthz says why.
ADMISSION_SERVING = Gauge("moe_operator_admission_serving",
                          "1 while the validating webhook is served with a valid certificate, 0 while Degraded")
ADMISSION_CERT_EXPIRY = Gauge("moe_operator_admission_certificate_expiry_timestamp_seconds",
                              "notAfter of the webhook's serving certificate (Unix time)")
ADMISSION_RENEWALS = Counter("moe_operator_admission_certificate_renewals_total",
                             "Renewals of the webhook's own serving certificate, by result", ["result"])


def decided(engine: str, gpu: GpuClass, backend: str) -> None:
    """One new plan (reconcile: the inputs hash changed) on this GPU class."""
    DECISIONS.labels(engine, gpu.family, class_label(gpu), backend).inc()


_free_labels: set[str] = set()


def set_free_gpus(classes: Iterable[tuple[GpuClass, int]]) -> None:
    """moe_operator_gpu_class_free_gpus from the inventory's (class, free GPUs): summed per
    class_label, and a label no class has any more is removed (it would show its last value)."""
    free: dict[str, int] = {}
    for gpu, n in classes:
        free[class_label(gpu)] = free.get(class_label(gpu), 0) + n
    for gone in _free_labels - set(free):
        GPU_CLASSES.remove(gone)
    for label, n in free.items():
        GPU_CLASSES.labels(label).set(n)
    _free_labels.clear()
    _free_labels.update(free)
