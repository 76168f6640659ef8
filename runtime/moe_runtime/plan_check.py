"""Re-check the operator's plan against this node and this checkpoint, and resolve the backend.

Pure functions: inputs are the plan (plan.json, validated with moe_core's `Plan` model; unknown
keys are ignored), the probed GPU family/product, the inspected CheckpointInfo, the process
environment and the installed packages; the output is the ordered list of backends to self-test,
the deferred-finalize switch and one reason line per decision. The backend is resolved by
`moe_core.bundled.resolve_bundled`, the very function the planner's bundled rules call.

plan.json is the only channel from the operator to the pod: the operator renders no MOE_* env for
the runtime. Precedence, highest first:
  1. MOE_RUNNER_BACKEND / MOE_DEFERRED_FINALIZE in the process environment: only ever set by the
     user (spec.env, or by hand). A backend named there is an explicit choice (no fallback);
     `auto` resolves here. MOE_DEFERRED_FINALIZE=1 defers when the backend can, 0 never does.
  2. the plan's moe.runnerBackend / moe.deferredFinalize, with their provenance (Plan.provenance:
     whether the user chose the value, from where, and the candidates in self-test order): an explicit
     backend has no fallback; the planner's own pick may fall back to the other candidates when its
     self-test fails. The plan also records the image's kernel packages as the operator assumed them
     (Plan.image): where the installed ones are the same, the plan is verified (it is for this GPU,
     checkpoint and engine) and taken as it is; where they differ, the backend is re-resolved here
     and a warning names the difference;
  3. without a plan, resolve_bundled's defaults for this node (as the planner would).
A plan written without provenance (an operator before it) is re-resolved here as it always was; its
explicit choice is then the decision of rule `user` (the only record such a plan has of it).
The plan's `env` map is not read: it is what the operator put into the pod's environment already.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from moe_core import image_contents
from moe_core.bundled import resolve_bundled
from moe_core.formats import expert_format
from moe_core.plan import Plan
from moe_core.runtime import BUNDLED
from pydantic import ValidationError

from .errors import RuntimeFailure

ENV_BACKEND = "MOE_RUNNER_BACKEND"
ENV_DEFERRED = "MOE_DEFERRED_FINALIZE"


def truthy(v: str | None) -> bool:
    return str(v).strip().lower() in ("1", "true", "yes", "on")


def read_plan(path: str | Path) -> Plan:
    p = Path(path)
    try:
        data = json.loads(p.read_text())
    except OSError as e:
        raise RuntimeFailure(f"cannot read plan {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise RuntimeFailure(f"plan {p} is not valid JSON: line {e.lineno} column {e.colno}: {e.msg}") from None
    if not isinstance(data, dict):
        raise RuntimeFailure(f"plan {p} must be a JSON object")
    return parse_plan(data, p)


def parse_plan(data: Mapping[str, Any], where: str | Path = "plan") -> Plan:
    try:
        return Plan.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "(top level)"
        raise RuntimeFailure(f"{where} is not a plan: {loc}: {first['msg']}") from None


@dataclass
class Resolution:
    family: str
    expert_format: str
    backends: list[str]  # to self-test in order; the first that passes is used
    explicit: bool  # an explicit choice is never replaced by another backend
    deferred: bool
    reasons: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    activation: str = "silu"  # the architecture's expert activation and biases (moe_core.runtime), self-tested
    bias: bool = False


def _norm(product: str) -> str:
    """'NVIDIA-H200' (GPU feature discovery label) == 'NVIDIA H200' (NVML name)."""
    return "".join(ch for ch in product.lower() if ch.isalnum())


def _where(family: str, product: str | None) -> str:
    return f"{family} ({product})" if product and product != family else family


def _check_plan_is_for_here(plan: Plan, family: str, product: str | None, info: Any) -> list[str]:
    """Refuse a plan made for another engine, GPU or checkpoint; a product mismatch is a warning."""
    if plan.errors:
        raise RuntimeFailure("the plan has errors and cannot be served: " + "; ".join(plan.errors))
    if plan.engine.name not in ("bundled", "moe-runtime"):
        raise RuntimeFailure(f"plan is for engine {plan.engine.name!r}, but this is the bundled moe-runtime")
    if plan.gpu.family != family:
        raise RuntimeFailure(f"plan is for {_where(plan.gpu.family, plan.gpu.product)} but this node is "
                             f"{_where(family, product)}")
    if plan.checkpoint.architecture != info.architecture:
        raise RuntimeFailure(f"plan is for a {plan.checkpoint.architecture} checkpoint but the checkpoint is "
                             f"{info.architecture}")
    if plan.checkpoint.format != info.format:
        raise RuntimeFailure(f"plan is for checkpoint format {plan.checkpoint.format} but the checkpoint is "
                             f"{info.format} ({info.formatSource})")
    if plan.gpu.product and product and _norm(plan.gpu.product) != _norm(product) and family != "cpu":
        return [f"plan was made for {plan.gpu.product}, this node has {product} (same family {family})"]
    return []


def resolve(plan: Plan | Mapping[str, Any] | None, family: str, product: str | None, info: Any,
            environ: Mapping[str, str], installed: dict[str, str | None]) -> Resolution:
    if plan is not None and not isinstance(plan, Plan):
        plan = parse_plan(plan)
    warnings = _check_plan_is_for_here(plan, family, product, info) if plan is not None else []
    planned = plan.moe if plan is not None else None
    env_backend = (environ.get(ENV_BACKEND) or "").strip()
    if plan is not None and not env_backend and ENV_DEFERRED not in environ:
        if (as_planned := _as_planned(plan, info, installed, warnings)) is not None:
            as_planned.activation, as_planned.bias = BUNDLED.experts_for(info.architecture)
            return as_planned
    if env_backend:
        backend, explicit, source = env_backend, env_backend != "auto", f"env {ENV_BACKEND}, set by the user"
        if planned and planned.runnerBackend not in ("auto", env_backend):
            warnings.append(f"{ENV_BACKEND}={env_backend} overrides the plan's backend {planned.runnerBackend}")
    elif planned:
        backend, source = planned.runnerBackend, "plan moe.runnerBackend"
        prov = plan.provenance.get("moe.runnerBackend")
        explicit = prov.explicit if prov is not None else \
            any(d.key == "moe.runnerBackend" and d.rule == "user" for d in plan.decisions)  # a plan without provenance
    else:
        backend, explicit, source = "auto", False, "default"
    if ENV_DEFERRED in environ:
        deferred = "on" if truthy(environ[ENV_DEFERRED]) else "off"
        deferred_from, rule = f"env {ENV_DEFERRED}={environ[ENV_DEFERRED]}, set by the user", "user"
    elif planned:
        deferred, deferred_from, rule = ("on" if planned.deferredFinalize else "off"), "from the plan", "plan"
    else:
        deferred, deferred_from, rule = "auto", None, "B4"
    r = resolve_bundled(family=family, where=_where(family, product), architecture=info.architecture,
                        checkpoint_format=info.format, shared_experts=info.numSharedExperts or 0,
                        installed=installed, backend=backend, explicit=explicit, backend_source=source,
                        deferred=deferred, deferred_from=deferred_from, deferred_rule=rule,
                        a2a=planned.a2aBackend if planned else "none")
    if r.errors:  # (with why it was re-resolved, when the image is not the one the plan assumed)
        raise RuntimeFailure("; ".join(r.errors + [w for w in warnings if w.endswith("re-resolved here")]))
    return Resolution(family, r.expert_format, r.backends, r.explicit, r.deferred, r.reasons, warnings + r.warnings,
                      r.activation, r.bias)


def _as_planned(plan: Plan, info: Any, installed: dict[str, str | None], warnings: list[str]) -> Resolution | None:
    """The plan's own backend choice when this image holds the kernel packages the operator assumed
    (nothing here would decide otherwise), else None to re-resolve: then `warnings` names the difference."""
    prov = plan.provenance.get("moe.runnerBackend")
    if plan.image is None or prov is None or not prov.candidates:
        return None  # a plan without provenance: re-resolved as before
    if prov.candidates[0] != plan.moe.runnerBackend or (prov.explicit and len(prov.candidates) > 1) \
            or expert_format(info.format) is None:
        warnings.append(f"the plan's provenance of moe.runnerBackend ({prov.candidates}) does not match its "
                        f"choice {plan.moe.runnerBackend}: the MoE backend is re-resolved here")
        return None
    have = {p: installed.get(p) for p in sorted(set(plan.image.packages) | set(installed))}
    if (diff := image_contents.differences(plan.image.packages, have)):
        warnings.append("this image's kernel packages are not the ones the plan assumed (" + "; ".join(diff)
                        + "): the MoE backend is re-resolved here")
        return None
    backend = prov.candidates[0]
    how = (f"set explicitly by the user ({prov.source}; no fallback)" if prov.explicit else
           f"the planner's choice ({prov.source})" + (f"; self-test fallbacks {', '.join(prov.candidates[1:])}"
                                                    if len(prov.candidates) > 1 else ""))
    deferred = plan.moe.deferredFinalize
    return Resolution(plan.gpu.family, expert_format(info.format), list(prov.candidates), prov.explicit, deferred,
                      [f"[plan] MoE backend {backend} as planned: {how}; the image holds the kernel packages the plan "
                       f"assumed", f"[plan] deferred finalize {'on' if deferred else 'off'} as planned"], warnings)
