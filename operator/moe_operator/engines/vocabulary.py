"""Every engine's accepted values, gathered for the CRD (api.py) and the planner: one list per engine
(engines/<engine>/vocab.py), never restated. Imports no planning code."""

from __future__ import annotations

from .bundled import vocab as bundled
from .sglang import vocab as sglang
from .vllm import vocab as vllm

ENGINES = (bundled.NAME, sglang.NAME, vllm.NAME)
DEFAULT_ENGINE = bundled.NAME  # plan() without an engine plans for the bundled runtime
DEFAULT_VERSIONS = {sglang.NAME: sglang.DEFAULT_VERSION, vllm.NAME: vllm.DEFAULT_VERSION,
                    bundled.NAME: bundled.DEFAULT_VERSION}
# Every runner value any engine accepts (the CRD's enum for moe.runnerBackend), and every a2a value.
ALL_RUNNERS = tuple(dict.fromkeys([*sglang.RUNNERS, *vllm.MOE_BACKENDS, *bundled.RUNNERS]))
ALL_A2A = tuple(dict.fromkeys([*sglang.A2A, *vllm.A2A]))
