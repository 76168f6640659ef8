"""`moe-operator plan`: run the planner on a checkpoint directory and a GPU, print the decisions.

Exit status: 0 planned, 2 the plan has errors (an impossible explicit choice, an unsupported
combination), 1 bad input (unreadable checkpoint, unknown GPU, bad --set).
"""

from __future__ import annotations

import argparse
import json
import sys

SETTABLE = {
    "moe.runnerBackend": "runner_backend",
    "moe.a2aBackend": "a2a_backend",
    "moe.deferredFinalize": "deferred_finalize",
    "parallelism.tp": "tp",
    "parallelism.ep": "ep",
    "parallelism.dp": "dp",
    "engine.flashinferVersion": "flashinfer_version",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--checkpoint", required=True, help="checkpoint directory (config.json, safetensors)")
    p.add_argument("--gpu", required=True, help="GPU product (H200, B200, NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition, MI300X) or family (sm90)")
    p.add_argument("--engine", default="bundled", choices=["bundled", "sglang", "vllm"])
    p.add_argument("--engine-version", default=None)
    p.add_argument("--format", default=None, help="skip inspection and use this checkpoint format")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"explicit spec value; keys: {', '.join(SETTABLE)}")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="user environment variable (always wins)")
    p.add_argument("-o", "--output", default="table", choices=["table", "json", "yaml"])


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"{what} {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        out[k.strip()] = v
    return out


def run(args: argparse.Namespace) -> int:
    from moe_core.checkpoint import InspectionError, inspect_dir
    from moe_core.gpu import GpuClassError, from_name
    from .planner import Choices, plan

    try:
        gpu = from_name(args.gpu)
        sets = _pairs(args.set, "--set")
        env = _pairs(args.env, "--env")
        unknown = set(sets) - set(SETTABLE)
        if unknown:
            raise ValueError(f"unknown --set key(s) {', '.join(sorted(unknown))}; known: {', '.join(SETTABLE)}")
        kw: dict = {SETTABLE[k]: (int(v) if k.startswith("parallelism.") else v) for k, v in sets.items()}
        ckpt = inspect_dir(args.checkpoint)
        if args.format:
            ckpt = ckpt.model_copy(update={"format": args.format, "formatSource": "--format on the command line"})
    except (InspectionError, GpuClassError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    result = plan(ckpt, gpu, Choices(env=env, **kw), engine=args.engine, engine_version=args.engine_version)
    data = result.model_dump(exclude={"decisions"})
    if args.output == "json":
        print(json.dumps(data, indent=2))
    elif args.output == "yaml":
        import yaml
        print(yaml.safe_dump(data, sort_keys=False, width=120), end="")
    else:
        print(render_table(result, ckpt))
    return 2 if result.errors else 0


def render_table(result, ckpt) -> str:
    lines = [
        f"checkpoint  {ckpt.architecture}  format={ckpt.format}  ({ckpt.formatSource})",
        f"gpu         {result.gpu.family}  {result.gpu.product}",
        f"engine      {result.engine.name} {result.engine.version or ''}",
        "",
        f"{'DECISION':<44} {'VALUE':<26} {'RULE':<6} WHY",
    ]
    for d in result.decisions:
        lines.append(f"{d.key:<44} {d.value:<26} {d.rule:<6} {d.reason}")
    if not result.decisions:
        lines.append("(no decisions)")
    if result.env:
        lines += ["", "env:"] + [f"  {k}={v}" for k, v in result.env.items()]
    if result.args:
        lines += ["", "args: " + " ".join(result.args)]
    for w in result.warnings:
        lines.append(f"WARNING {w}")
    for e in result.errors:
        lines.append(f"ERROR   {e}")
    return "\n".join(lines)
