"""The bundled runtime's Engine (engines/base.py): its plan is engines/bundled/plan.py's (moe_core.resolve_bundled,
whose own layout rules judge the split)."""

from __future__ import annotations

from moe_core.gpu import GpuClass
from moe_core.plan import Plan, PlanMoE
from moe_core.runtime import BUNDLED

from ...selection import Builder, Choices, Facts
from ..command import Launch
from . import command, plan, vocab


class Bundled:
    name = vocab.NAME
    default_version = vocab.DEFAULT_VERSION
    max_len_flag = command.MAX_LEN_FLAG
    serves_local_dir = True
    runs_runtime_image = True
    rendezvous = True
    ready_path = "/ready"
    replica_limits = BUNDLED  # what the runtime runs in one replica (moe_core.runtime); its own rules judge the split
    # the runtime exports the vLLM names (runtime/moe_runtime/metrics.py), not the LoRA one
    metrics = {"queue": "vllm:num_requests_waiting", "kv": "vllm:kv_cache_usage_perc"}
    lora_metric = False
    startup = None  # no start-up rows: resolve_bundled is the runtime's own check
    deferred_env = plan.DEFERRED_ENV
    a2a_needs_ep = False
    fallbacks: dict = {}

    def choices(self, choices: Choices) -> Choices:
        return plan.choices(choices)

    def default_flashinfer(self, version: str, gpu: GpuClass) -> str | None:
        return plan.default_flashinfer(version, gpu)

    def plan_moe(self, b: Builder) -> PlanMoE:
        return plan.plan_moe(b)

    def moe_split_refusal(self, f: Facts, runner: str = "auto") -> str | None:
        return None

    def split_refusal(self, f: Facts) -> str | None:
        return None

    def auto_fallbacks(self, p: Plan) -> list[str]:
        return plan.auto_fallbacks(p)

    def command(self, launch: Launch) -> tuple[list[str], list[str]]:
        return command.command(launch)

    def env_runner(self, env: dict[str, str], family: str) -> list[tuple[str, str]]:
        return plan.env_runner(env, family)


ENGINE = Bundled()
