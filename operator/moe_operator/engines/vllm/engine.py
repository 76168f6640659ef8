"""The vLLM Engine (engines/base.py): its rows are engines/vllm/plan.py's."""

from __future__ import annotations

from moe_core.gpu import GpuClass
from moe_core.plan import Plan, PlanMoE

from ...selection import Builder, Choices, Facts
from ..command import Launch
from . import command, plan, startup, vocab


class Vllm:
    name = vocab.NAME
    default_version = vocab.DEFAULT_VERSION
    max_len_flag = command.MAX_LEN_FLAG
    serves_local_dir = False
    runs_runtime_image = False
    rendezvous = False
    ready_path = "/health"
    startup = startup
    deferred_env = plan.DEFERRED_ENV
    a2a_needs_ep = True
    fallbacks: dict = {}

    def choices(self, choices: Choices) -> Choices:
        return choices

    def default_flashinfer(self, version: str, gpu: GpuClass) -> str | None:
        return plan.default_flashinfer(version, gpu)

    def plan_moe(self, b: Builder) -> PlanMoE:
        return plan.plan_moe(b)

    def moe_split_refusal(self, f: Facts, runner: str = "auto") -> str | None:
        return plan.moe_split_refusal(f, runner)

    def split_refusal(self, f: Facts) -> str | None:
        # the runner plan() would give vLLM: the user's, W7's translation or the select table's
        return plan.moe_split_refusal(f, plan.pick_runner(Builder(f))) or plan.attention_split_refusal(f)

    def auto_fallbacks(self, p: Plan) -> list[str]:
        return []

    def command(self, launch: Launch) -> tuple[list[str], list[str]]:
        return command.command(launch)

    def env_runner(self, env: dict[str, str], family: str) -> list[tuple[str, str]]:
        return plan.env_runner(env, family)


ENGINE = Vllm()
