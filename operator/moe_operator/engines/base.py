"""What the planner (and placement, admission) asks an engine, instead of branching on its name."""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol

from moe_core.gpu import GpuClass
from moe_core.plan import Plan, PlanMoE
from moe_core.runtime import RuntimeCapabilities

from ..selection import Builder, Choices, Facts
from .command import Launch


class Engine(Protocol):
    name: str
    default_version: str
    # A1: an a2a backend other than none needs expert parallelism (the bundled runtime judges its own a2a)
    a2a_needs_ep: bool
    # decision rule id -> (does this value fall back, what is given up) (admission warnings, issue 16 item 3)
    fallbacks: Mapping[str, tuple[Callable[[str], bool], str]]
    # the pods (render.py)
    max_len_flag: str  # the flag that caps the context length (spec.engine.maxModelLen)
    serves_local_dir: bool  # True: a hub model is fetched into a directory first (an init container)
    runs_runtime_image: bool  # True: the image is the project's runtime image (images.runtime_image)
    rendezvous: bool  # True: multi-node pods get the LWS rendezvous env and the leader the dist port
    ready_path: str  # the readiness probe's HTTP path
    # the runtime's own caps on one replica (placement: GPUs per node, tp, nodes), or None: the engine shards as far
    # as the layout asks, and its split rules (split_refusal) judge each size
    replica_limits: RuntimeCapabilities | None
    # the Prometheus names an autoscaler or the gateway's endpoint picker reads (day2.py): {"queue": ..., "kv": ...},
    # kv a fraction (0-1); lora_metric: the engine exports vllm:lora_requests_info (the picker scrapes it)
    metrics: Mapping[str, str]
    lora_metric: bool
    # the start-up rows (engines/<engine>/startup.py: RULES, choices(version), A2A_FLAG, quant(case)), or None
    startup: Any

    deferred_env: str | None  # the env variable that switches deferred finalize in this engine, if any

    def env_runner(self, env: dict[str, str], family: str) -> list[tuple[str, str]]:
        """(env description, runner value it selects) for the user's env that already picks a runner."""

    def command(self, launch: Launch) -> tuple[list[str], list[str]]:
        """The container's command and the operator's + plan's arguments (the user's spec.engine.args follow)."""

    def choices(self, choices: Choices) -> Choices:
        """The user's choices as this engine reads them (an engine env switch that is an explicit choice)."""

    def default_flashinfer(self, version: str, gpu: GpuClass) -> str | None:
        """flashinfer-python in the engine's image when the user did not say."""

    def plan_moe(self, b: Builder) -> PlanMoE:
        """Fill the builder (decisions, env, args, warnings, errors) and return the MoE part of the plan."""

    def split_refusal(self, f: Facts) -> str | None:
        """The MoE, then the attention split check, for a layout not planned yet (placement sizes tp with it)."""

    def moe_split_refusal(self, f: Facts, runner: str = "auto") -> str | None:
        """The engine release's refusal of this MoE tensor-parallel split (any runner), or None."""

    def auto_fallbacks(self, plan: Plan) -> list[str]:
        """Engine-specific fallbacks beyond the rule-id table (`fallbacks`)."""


class ImageEngine:
    """An engine served from its own image (sglang, vLLM): the Engine protocol over its folder's modules
    (vocab, command, plan, startup). The two differ only in their fallback table, their metric names and in the
    runner the split check assumes (`split_runner`)."""

    serves_local_dir = False
    runs_runtime_image = False
    rendezvous = False
    ready_path = "/health"
    a2a_needs_ep = True
    replica_limits = None

    def __init__(self, vocab: Any, command: Any, plan: Any, startup: Any,
                 fallbacks: Mapping[str, tuple[Callable[[str], bool], str]],
                 metrics: Mapping[str, str], lora_metric: bool):
        self.name = vocab.NAME
        self.default_version = vocab.DEFAULT_VERSION
        self.max_len_flag = command.MAX_LEN_FLAG
        self.startup = startup
        self.deferred_env = plan.DEFERRED_ENV
        self.fallbacks = fallbacks
        self.metrics, self.lora_metric = metrics, lora_metric
        self._plan, self._command = plan, command

    def choices(self, choices: Choices) -> Choices:
        return choices

    def default_flashinfer(self, version: str, gpu: GpuClass) -> str | None:
        return self._plan.default_flashinfer(version, gpu)

    def plan_moe(self, b: Builder) -> PlanMoE:
        return self._plan.plan_moe(b)

    def moe_split_refusal(self, f: Facts, runner: str = "auto") -> str | None:
        return self._plan.moe_split_refusal(f, runner)

    def split_runner(self, f: Facts) -> str:
        """The runner the split check of a layout not planned yet assumes."""
        return "auto"

    def split_refusal(self, f: Facts) -> str | None:
        return self._plan.moe_split_refusal(f, self.split_runner(f)) or self._plan.attention_split_refusal(f)

    def auto_fallbacks(self, p: Plan) -> list[str]:
        return []

    def command(self, launch: Launch) -> tuple[list[str], list[str]]:
        return self._command.command(launch)

    def env_runner(self, env: dict[str, str], family: str) -> list[tuple[str, str]]:
        return self._plan.env_runner(env, family)
