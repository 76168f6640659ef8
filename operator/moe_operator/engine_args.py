"""Extra engine arguments (spec.engine.args): which flags the operator owns, per engine, and the
spec field that sets each instead. Pure.

The owned flags (and their aliases, read from the released wheels: sglang 0.5.23
sglang/srt/arg_groups/fields/{model,parallel}.py `aliases=`, vLLM 0.33.0 vllm/engine/arg_utils.py
EngineArgs.add_cli_args) are what render.py and the planner (planner.py, engine_rules/, moe_core.bundled
parallel_args) put on the engine's command line; a user copy would be appended after them and win
(argparse keeps the last value), silently undoing a sized or checked decision. A test scans the
planner's sources for every flag literal it emits and checks it is listed here.

Matching is on the flag's name before any '=', with '_' read as '-' (vLLM's FlexibleArgumentParser
accepts both) and with argparse's prefix abbreviations (allow_abbrev, on in both engines' parsers:
'--moe-runner' is taken as '--moe-runner-backend', '-t' as '-tp' when unambiguous, '-tp4' as '-tp 4'),
so no spelling gets around a refusal.
"""

from __future__ import annotations

MODEL = "spec.model.uri"
SERVER = "the operator (the container port is fixed; spec.service.port is the Service's port)"
SERVED = "spec.model.servedName"
TP, EP, DP = "spec.parallelism.tp", "spec.parallelism.ep", "spec.parallelism.dp"
NODES = "spec.nodesPerReplica"
PLANNER = "the planner (per GPU class and engine release; status.plan.args shows its choice)"
PP = "spec.parallelism (the GPUs of a replica are tp x dp; no pipeline or context parallel groups)"
CONFIG = "spec.engine.args itself (a config file would bypass the owned flags)"

_SGLANG = {
    "--model-path": MODEL, "--model": MODEL, "--revision": "spec.model.uri (hf://org/name@revision)",
    "--host": SERVER, "--port": SERVER, "--served-model-name": SERVED,
    "--context-length": "spec.engine.maxModelLen",
    "--tp-size": TP, "--tp": TP, "--tensor-parallel-size": TP,
    "--ep-size": EP, "--ep": EP, "--expert-parallel-size": EP,
    "--dp-size": DP, "--dp": DP, "--data-parallel-size": DP, "--enable-dp-attention": DP,
    "--attn-dp-size": DP, "--attention-data-parallel-size": DP, "--moe-dp-size": DP, "--moe-data-parallel-size": DP,
    "--pp-size": PP, "--pipeline-parallel-size": PP,
    "--moe-runner-backend": "spec.moe.runnerBackend", "--moe-a2a-backend": "spec.moe.a2aBackend",
    "--deepep-mode": "spec.moe.a2aBackend (the planner picks the DeepEP mode)",
    "--attention-backend": PLANNER, "--quantization": "spec.model.format",
    "--nnodes": NODES, "--node-rank": NODES, "--dist-init-addr": NODES, "--nccl-init-addr": NODES,
    "--config": CONFIG,
}
_VLLM = {
    "--model": MODEL, "--revision": "spec.model.uri (hf://org/name@revision)",
    "--host": SERVER, "--port": SERVER, "--served-model-name": SERVED,
    "--max-model-len": "spec.engine.maxModelLen",
    "--tensor-parallel-size": TP, "-tp": TP,
    "--data-parallel-size": DP, "-dp": DP, "--data-parallel-size-local": DP, "-dpl": DP,
    "--data-parallel-rank": DP, "-dpn": DP, "--data-parallel-start-rank": DP, "-dpr": DP,
    "--data-parallel-address": NODES, "-dpa": NODES, "--data-parallel-rpc-port": NODES, "-dpp": NODES,
    "--enable-expert-parallel": EP, "-ep": EP, "--pipeline-parallel-size": PP, "-pp": PP,
    "--prefill-context-parallel-size": PP, "-pcp": PP,
    "--moe-backend": "spec.moe.runnerBackend", "--all2all-backend": "spec.moe.a2aBackend",
    "--quantization": "spec.model.format", "-q": "spec.model.format",
    "--nnodes": NODES, "-n": NODES, "--node-rank": NODES, "-r": NODES, "--master-addr": NODES,
    "--master-port": NODES, "--headless": NODES,
    "--config": CONFIG,
}
_BUNDLED = {
    "--model": MODEL, "--plan": "the operator (the plan ConfigMap)", "--host": SERVER, "--port": SERVER,
    "--served-model-name": SERVED, "--max-model-len": "spec.engine.maxModelLen",
    "--tp": TP, "--ep": EP, "--dist-port": NODES,
}
OWNED: dict[str, dict[str, str]] = {"sglang": _SGLANG, "vllm": _VLLM, "bundled": _BUNDLED}

MAX_ARGS = 128
MAX_ARG_CHARS = 4096


def _flag(arg: str) -> str | None:
    if not arg.startswith("-") or arg in ("-", "--") or arg[1:2].isdigit():  # a value (e.g. -1), not a flag
        return None
    name = arg.split("=", 1)[0]
    return name[:2] + name[2:].replace("_", "-") if name.startswith("--") else name


def refusal(engine: str, arg: str) -> str | None:
    """Why `arg` may not be in spec.engine.args for `engine`, or None."""
    if "\n" in arg or "\x00" in arg:
        return f"engine argument {arg[:40]!r} contains a newline or NUL"
    flag = _flag(arg)
    if flag is None:
        return None
    owned = OWNED[engine]
    if flag in owned:
        return f"engine argument {flag} is set by the operator for engine {engine}: use {owned[flag]}"
    for full, field in owned.items():
        if full.startswith("--") and flag.startswith("--") and len(flag) > 3 and full.startswith(flag):
            return (f"engine argument {flag} abbreviates {full}, which the operator sets for engine {engine}: "
                    f"use {field}")
        if not full.startswith("--") and not flag.startswith("--") and (full.startswith(flag) or flag.startswith(full)):
            # single-dash: an abbreviation (-t for -tp) or the value glued on (-tp4)
            return f"engine argument {arg[:40]} is read as {full}, which the operator sets for engine {engine}: use {field}"
    return None


def refusals(engine: str, args: list[str]) -> list[str]:
    return [why for a in args if (why := refusal(engine, a))]
