"""`moe-operator plan`: run the planner on a checkpoint and a GPU, print the decisions.

The checkpoint is a directory (`--checkpoint DIR`) or a hub model (`--model hf://org/name[@rev]`):
config.json, hf_quant_config.json and the safetensors headers only, never the weights, read by the
operator's own inspection code (inspection.inspect_hf) at the commit the revision resolves to
(inspection.resolve_revision); HF_TOKEN in the environment is sent for gated models, and
HF_ENDPOINT names another hub, as for huggingface_hub itself.

Exit status: 0 planned, 2 the plan has errors (an impossible explicit choice, an unsupported
combination), 1 bad input (unreadable checkpoint, unknown GPU, bad --set / --env), 3 usage.

`--set` values are parsed as the MoEDeployment spec would take them: moe.deferredFinalize is
on/off/auto (true/false/yes/no/1/0 accepted for on/off), parallelism.* an integer in 1..64. A
`--set` choice that an `--env` value overrides (the user's env always wins in the pod) is a warning
in the plan. `-o json|yaml` prints the whole plan, `decisions` (key, value, rule id, reason) included.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

from .engines.vocabulary import DEFAULT_ENGINE, ENGINES

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
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", help="checkpoint directory (config.json, safetensors)")
    src.add_argument("--model", metavar="URI", help="hf://org/name[@revision]: read the headers and configs from the hub "
                     "(HF_TOKEN for gated models); file:///path as --checkpoint")
    p.add_argument("--gpu", required=True, help="GPU product (H200, B200, NVIDIA-RTX-PRO-6000-Blackwell-Server-Edition, MI300X) or family (sm90)")
    p.add_argument("--engine", default=DEFAULT_ENGINE, choices=list(ENGINES))
    p.add_argument("--engine-version", default=None)
    p.add_argument("--driver", default=None, metavar="VERSION",
                   help="the nodes' NVIDIA driver version (e.g. 595.0), as GFD's nvidia.com/cuda.driver-version labels give it")
    p.add_argument("--format", default=None, help="skip inspection and use this checkpoint format")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help=f"explicit spec value; keys: {', '.join(SETTABLE)}")
    p.add_argument("--env", action="append", default=[], metavar="K=V", help="user environment variable (always wins)")
    p.add_argument("--gpus-per-node", type=int, default=None, metavar="N",
                   help="GPUs per node of the class, for sizing (default: 8)")
    p.add_argument("--nodes", type=int, default=1, metavar="N", help="nodes of the class, for sizing (default 1)")
    p.add_argument("--max-model-len", type=int, default=None, metavar="TOKENS",
                   help="engine.maxModelLen the KV cache is sized for (default config.json max_position_embeddings)")
    p.add_argument("--max-concurrency", type=int, default=None, metavar="N", help="engine.maxConcurrency (default 1)")
    p.add_argument("-o", "--output", default="table", choices=["table", "json", "yaml"])


def _pairs(items: list[str], what: str) -> dict[str, str]:
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"{what} {item!r} is not KEY=VALUE")
        k, v = item.split("=", 1)
        if not k.strip():
            raise ValueError(f"{what} {item!r} has an empty key")
        out[k.strip()] = v
    return out


_ON, _OFF = ("on", "true", "yes", "1"), ("off", "false", "no", "0")
PARALLEL_MAX = 64  # as the API's Parallelism fields


def parse_set(key: str, value: str):
    """One --set value, typed as the spec field it stands for (ValueError names key and value)."""
    v = value.strip()
    if key == "moe.deferredFinalize":
        low = v.lower()
        if low in _ON:
            return "on"
        if low in _OFF:
            return "off"
        if low == "auto":
            return "auto"
        raise ValueError(f"--set {key}={value!r}: must be on, off or auto (true/false accepted)")
    if key.startswith("parallelism."):
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"--set {key}={value!r}: must be an integer in 1..{PARALLEL_MAX}") from None
        if not 1 <= n <= PARALLEL_MAX:
            raise ValueError(f"--set {key}={value!r}: must be an integer in 1..{PARALLEL_MAX}")
        return n
    if not v:
        raise ValueError(f"--set {key}=: empty value")
    return v


def _truthy(v: str | None) -> bool | None:
    if v is None:
        return None
    return v.strip().lower() in ("1", "true", "yes", "on")


def env_conflicts(engine: str, sets: dict, env: dict[str, str], family: str) -> list[str]:
    """Warnings for --set choices that an --env value contradicts (the env reaches the pod and wins)."""
    from .engines import registry as engines

    out = []
    runner = sets.get("moe.runnerBackend")
    if runner and runner != "auto":
        implied = engines.get(engine).env_runner(env, family)  # (env description, backend it selects)
        for what, backend in implied:
            if backend != runner:
                out.append(f"[ENV1] --set moe.runnerBackend={runner} conflicts with --env {what} (selects {backend}); "
                           "the env is passed to the engine unchanged and wins there: drop one of them")
    df = sets.get("moe.deferredFinalize")
    if df in ("on", "off"):
        key = engines.get(engine).deferred_env
        if key and key in env and _truthy(env[key]) != (df == "on"):
            out.append(f"[ENV2] --set moe.deferredFinalize={df} conflicts with --env {key}={env[key]}; the env wins "
                       f"(deferred finalize {'on' if _truthy(env[key]) else 'off'})")
    return out


def run(args: argparse.Namespace) -> int:
    from moe_core.checkpoint import InspectionError
    from moe_core.gpu import GpuClassError, from_name, with_driver
    from .inspection import InspectionFailed
    from .planner import Choices, plan

    try:
        gpu = with_driver(from_name(args.gpu), args.driver)
        sets = _pairs(args.set, "--set")
        env = _pairs(args.env, "--env")
        unknown = set(sets) - set(SETTABLE)
        if unknown:
            raise ValueError(f"unknown --set key(s) {', '.join(sorted(unknown))}; known: {', '.join(SETTABLE)}")
        typed = {k: parse_set(k, v) for k, v in sets.items()}
        kw: dict = {SETTABLE[k]: v for k, v in typed.items()}
        ckpt, where = read_checkpoint(args.checkpoint, args.model)
        if args.format:
            ckpt = ckpt.model_copy(update={"format": args.format, "formatSource": "--format on the command line"})
    except (InspectionError, GpuClassError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    except InspectionFailed as e:
        one_line = " ".join(e.message.split())  # huggingface_hub's messages span lines
        print(f"error: {one_line}{_HINTS.get(e.reason, '')}", file=sys.stderr)
        return 1
    # the layout: parallelism.tp as given (checked against the GPU memory), else the smallest that fits
    from .placement import sized_for_cli
    layout, record = sized_for_cli(ckpt, gpu, args.engine, kw, args.gpus_per_node or gpu.count or 8, args.nodes,
                                   args.max_model_len, args.max_concurrency, args.engine_version, env)
    if isinstance(layout, int):
        kw["tp"] = layout
    try:
        result = plan(ckpt, gpu, Choices(env=env, **kw), engine=args.engine, engine_version=args.engine_version)
    except ValueError as e:  # e.g. an unparsable --engine-version
        print(f"error: {e}", file=sys.stderr)
        return 1
    record(result)
    result.warnings.extend(env_conflicts(args.engine, typed, env, gpu.family))
    data = result.model_dump()
    if args.output == "json":
        print(json.dumps(data, indent=2))
    elif args.output == "yaml":
        import yaml
        print(yaml.safe_dump(data, sort_keys=False, width=120), end="")
    else:
        print(render_table(result, ckpt, where))
    return 2 if result.errors else 0


_HINTS = {"Unauthorized": " (a gated or private model: set HF_TOKEN to a token that may read it)",
          "Forbidden": " (HF_TOKEN may not read this model: accept its terms on the hub, or use another token)",
          "NotFound": " (check the repo id and the revision)"}


def read_checkpoint(checkpoint: str | None, model: str | None):
    """(CheckpointInfo, where it was read) from a directory or a model uri (hf://, file://).
    An hf:// revision is resolved to its commit first, so the plan names what a pod would serve."""
    from moe_core.checkpoint import inspect_dir

    from .api import MODEL_URI_PATTERN
    from .inspection import inspect_hf, resolve_revision
    from .model_uri import ModelURI

    if checkpoint is not None:
        if checkpoint.startswith(("hf://", "file://", "pvc://")):
            raise ValueError(f"--checkpoint {checkpoint!r} is a model uri: use --model {checkpoint}")
        return inspect_dir(checkpoint), None
    if not re.match(MODEL_URI_PATTERN, model or ""):
        raise ValueError(f"--model {model!r}: not hf://org/name[@revision] or file:///path")
    uri = ModelURI.parse(model)
    if uri.scheme == "pvc":
        raise ValueError(f"--model {model!r}: a pvc:// claim is read inside the cluster; copy it out and use --checkpoint")
    if uri.scheme == "file":
        return inspect_dir(uri.path), uri.path
    token = os.environ.get("HF_TOKEN") or None
    sha = resolve_revision(model, token)
    pinned = f"hf://{uri.repo}@{sha}"
    return inspect_hf(pinned, token), pinned if uri.revision == sha else f"{model} = {pinned}"


def render_table(result, ckpt, where: str | None = None) -> str:
    lines = [
        *([f"model       {where}"] if where else []),
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
