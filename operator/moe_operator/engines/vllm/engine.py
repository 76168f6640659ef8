"""The vLLM Engine (engines/base.py ImageEngine): its rows are engines/vllm/plan.py's."""

from __future__ import annotations

from ...selection import Builder, Facts
from ..base import ImageEngine
from . import command, plan, startup, vocab


class Vllm(ImageEngine):
    def split_runner(self, f: Facts) -> str:
        # the runner plan() would give vLLM: the user's, W7's translation or the select table's
        return plan.pick_runner(Builder(f))


# vLLM's Prometheus names; it exports vllm:lora_requests_info too (the endpoint picker's LoRA scrape)
METRICS = {"queue": "vllm:num_requests_waiting", "kv": "vllm:kv_cache_usage_perc"}

ENGINE = Vllm(vocab, command, plan, startup, fallbacks={}, metrics=METRICS, lora_metric=True)
