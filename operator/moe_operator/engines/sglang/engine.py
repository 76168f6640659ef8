"""The sglang Engine (engines/base.py ImageEngine): its rows are engines/sglang/plan.py's."""

from __future__ import annotations

from ..base import ImageEngine
from . import command, plan, startup, vocab

# sglang's own Prometheus names (sglang/srt/metrics/collector.py); no LoRA request metric
METRICS = {"queue": "sglang:num_queue_reqs", "kv": "sglang:token_usage"}

ENGINE = ImageEngine(vocab, command, plan, startup, fallbacks=plan.FALLBACKS, metrics=METRICS, lora_metric=False)
