"""Prometheus metrics of the operator (served by `moe-operator run --metrics-port`)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("moe_operator_reconciles_total", "Reconciles of MoEDeployments", ["result"])
DECISIONS = Counter("moe_operator_decisions_total", "Plans made, by engine, GPU family and MoE backend",
                    ["engine", "gpu_family", "backend"])
ERRORS = Counter("moe_operator_errors_total", "Reconcile errors by reason", ["reason"])
INSPECTION_SECONDS = Histogram("moe_operator_checkpoint_inspection_seconds", "Checkpoint inspection latency",
                               ["scheme"], buckets=(0.01, 0.05, 0.1, 0.5, 1, 2, 5, 10, 30, 60, 120))
GPU_CLASSES = Gauge("moe_operator_gpu_class_free_gpus", "Free GPUs per GPU class", ["gpu_class"])
# The operator's own admission endpoint (webhook_tls.Health): 0 while it is Degraded (not listening,
# certificate expired or past its renewal, or the self-check handshake failing); /healthz says why.
ADMISSION_SERVING = Gauge("moe_operator_admission_serving",
                          "1 while the validating webhook is served with a valid certificate, 0 while Degraded")
ADMISSION_CERT_EXPIRY = Gauge("moe_operator_admission_certificate_expiry_timestamp_seconds",
                              "notAfter of the webhook's serving certificate (Unix time)")
ADMISSION_RENEWALS = Counter("moe_operator_admission_certificate_renewals_total",
                             "Renewals of the webhook's own serving certificate, by result", ["result"])
