"""Re-check the operator's plan against this node and this checkpoint, and resolve the backend.

Pure functions: inputs are the plan (a dict; extra keys tolerated), the probed GPU family/product,
the inspected CheckpointInfo, the environment and the installed packages; the output is the ordered
list of backends to self-test, the deferred-finalize switch and one reason line per decision.
An `auto` backend is resolved exactly as the planner does: the first of
`registry.candidates(family, expert_format, installed)`.

Environment read (the operator renders the plan's `env` into the pod; the plan file's own `env`
fills in whatever the pod does not set):
  MOE_RUNNER_BACKEND     backend name or `auto` (overrides plan.moe.runnerBackend; explicit => no fallback)
  MOE_DEFERRED_FINALIZE  1/0 (overrides plan.moe.deferredFinalize)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from moe_core import registry
from moe_core.formats import EXPERT_FORMATS, expert_format

from .errors import RuntimeFailure

ENV_BACKEND = "MOE_RUNNER_BACKEND"
ENV_DEFERRED = "MOE_DEFERRED_FINALIZE"


def truthy(v: str | None) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def read_plan(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise RuntimeFailure(f"cannot read plan {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise RuntimeFailure(f"plan {p} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise RuntimeFailure(f"plan {p} must be a JSON object")
    return data


@dataclass
class Resolution:
    family: str
    expert_format: str
    backends: list[str]  # to self-test in order; the first that passes is used
    explicit: bool  # an explicit choice is never replaced by another backend
    deferred: bool
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def effective_env(plan: Mapping[str, Any] | None, environ: Mapping[str, str]) -> dict[str, str]:
    """The pod's environment wins; the plan's env fills in what the pod did not set."""
    env = {k: str(v) for k, v in ((plan or {}).get("env") or {}).items()}
    env.update({k: v for k, v in environ.items() if k in (ENV_BACKEND, ENV_DEFERRED)})
    return env


def _norm(product: str) -> str:
    """'NVIDIA-H200' (GPU feature discovery label) == 'NVIDIA H200' (NVML name)."""
    return "".join(ch for ch in product.lower() if ch.isalnum())


def _where(family: str, product: str | None) -> str:
    return f"{family} ({product})" if product and product != family else family


def resolve(plan: Mapping[str, Any] | None, family: str, product: str | None, info: Any,
            environ: Mapping[str, str], installed: dict[str, str | None]) -> Resolution:
    reasons: list[str] = []
    warnings: list[str] = []
    plan = plan or {}
    if plan.get("errors"):
        raise RuntimeFailure("the plan has errors and cannot be served: " + "; ".join(map(str, plan["errors"])))
    engine = (plan.get("engine") or {}).get("name")
    if engine not in (None, "bundled", "moe-runtime"):
        raise RuntimeFailure(f"plan is for engine {engine!r}, but this is the bundled moe-runtime")
    pg = plan.get("gpu") or {}
    if pg.get("family") and pg["family"] != family:
        raise RuntimeFailure(f"plan is for {_where(pg['family'], pg.get('product'))} but this node is "
                             f"{_where(family, product)}")
    if pg.get("product") and product and _norm(pg["product"]) != _norm(product) and family != "cpu":
        warnings.append(f"plan was made for {pg['product']}, this node has {product} (same family {family})")
    pc = plan.get("checkpoint") or {}
    if pc.get("architecture") and pc["architecture"] != info.architecture:
        raise RuntimeFailure(f"plan is for a {pc['architecture']} checkpoint but the checkpoint is {info.architecture}")
    if pc.get("format") and pc["format"] != info.format:
        raise RuntimeFailure(f"plan is for checkpoint format {pc['format']} but the checkpoint is {info.format} "
                             f"({info.formatSource})")
    moe = plan.get("moe") or {}
    if moe.get("a2aBackend", "none") not in (None, "none"):
        raise RuntimeFailure(f"plan asks for all-to-all backend {moe['a2aBackend']!r}; the bundled runtime has none")

    wfmt = expert_format(info.format)
    if wfmt is None:
        raise RuntimeFailure(f"the bundled runtime cannot run {info.format} experts "
                             f"(supported: {', '.join(EXPERT_FORMATS)})")
    env = effective_env(plan, environ)
    fits = registry.candidates(family, wfmt, installed)
    requested = env.get(ENV_BACKEND) or moe.get("runnerBackend") or "auto"
    source = f"env {ENV_BACKEND}" if env.get(ENV_BACKEND) else ("plan moe.runnerBackend" if moe.get("runnerBackend") else "default")
    if env.get(ENV_BACKEND) and moe.get("runnerBackend") not in (None, "auto", env[ENV_BACKEND]):
        warnings.append(f"{ENV_BACKEND}={env[ENV_BACKEND]} overrides the plan's backend {moe['runnerBackend']}")
    user_decided = any(d.get("key") == "moe.runnerBackend" and d.get("rule") == "user"
                       for d in plan.get("decisions") or [] if isinstance(d, dict))
    if requested == "auto":
        if not fits:
            raise RuntimeFailure(f"no MoE backend runs {wfmt} experts on {_where(family, product)} with the installed "
                                 f"packages {installed}")
        backends = [b.name for b in fits]
        explicit = False
        reasons.append(f"backend auto -> {backends[0]}: best registry candidate for {wfmt} experts on "
                       f"{_where(family, product)}" + (f"; fallbacks {', '.join(backends[1:])}" if len(backends) > 1 else ""))
    else:
        try:
            spec = registry.get(requested)
        except KeyError as e:
            raise RuntimeFailure(f"{source}: {e.args[0]}") from None
        problems = []
        if family not in spec.families:
            problems.append(f"it runs on {', '.join(sorted(spec.families))}, not {_where(family, product)}")
        if wfmt not in spec.weight_formats:
            problems.append(f"it does not load {wfmt} experts")
        problems += spec.missing_requirements(family, installed)
        if problems:
            alt = ", ".join(b.name for b in fits) or "none"
            raise RuntimeFailure(f"MoE backend {requested} ({source}) cannot run here: {'; '.join(problems)}. "
                                 f"Backends that can: {alt}")
        explicit = user_decided or source.startswith("env") and not moe.get("runnerBackend") == requested
        backends = [requested] if explicit else [requested] + [b.name for b in fits if b.name != requested]
        reasons.append(f"backend {requested} from {source}" + (" (explicit choice: no fallback)" if explicit else
                       (f"; self-test fallbacks {', '.join(backends[1:])}" if len(backends) > 1 else "")))
    if env.get(ENV_DEFERRED) is not None and ENV_DEFERRED in environ:
        deferred = truthy(env[ENV_DEFERRED])
        reasons.append(f"deferred finalize {'on' if deferred else 'off'} from env {ENV_DEFERRED}")
    elif "deferredFinalize" in moe:
        deferred = bool(moe["deferredFinalize"])
        reasons.append(f"deferred finalize {'on' if deferred else 'off'} from the plan")
    elif env.get(ENV_DEFERRED) is not None:
        deferred = truthy(env[ENV_DEFERRED])
        reasons.append(f"deferred finalize {'on' if deferred else 'off'} from the plan env {ENV_DEFERRED}")
    else:
        deferred = bool(info.numSharedExperts) and registry.get(backends[0]).deferred_finalize
        reasons.append(f"deferred finalize {'on' if deferred else 'off'} (default: "
                       f"{'shared expert present' if info.numSharedExperts else 'no shared expert'})")
    return Resolution(family, wfmt, backends, explicit, deferred, reasons, warnings)


def deferred_for(backend: str, want: bool) -> tuple[bool, str | None]:
    """A fallback backend that cannot stop before finalize runs the plain path (and says so)."""
    if want and not registry.get(backend).deferred_finalize:
        return False, f"{backend} cannot defer finalize: shared expert added after the routed sum"
    return want, None
