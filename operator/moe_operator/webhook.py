"""The validating admission webhook: the planner's and the cluster policy's refusals at `kubectl apply`.

kopf serves it and manages the ValidatingWebhookConfiguration (its caBundle included). TLS comes
from a certificate directory (cert-manager's Secret layout: tls.crt, tls.key, ca.crt) when the chart
provides one, else from a CA the operator makes and renews while it runs (webhook_tls: a new CA
bundle is published before the new certificate is served). /healthz carries the endpoint's health
(the "admission" probe) and moe_operator_admission_serving is 0 while it is Degraded. The webhook
refuses only what it can judge: a spec it cannot parse, or a checkpoint it cannot read yet, is
admitted and left to the reconcile to report.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Callable

import kopf
from moe_core import sizing
from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import FAMILIES, GpuClass, from_name
from moe_core.plan import Plan

from pydantic import ValidationError

from .api import MoEDeploymentSpec
from . import inspection, webhook_tls
from .inspection import InspectionFailed, InspectionPending, inspect_spec
from . import inventory
from .inventory import NodeInfo
from .placement import choices_from_spec, impossible_everywhere
from .planner import auto_fallbacks, plan

log = logging.getLogger("moe_operator.webhook")
CONFIGURATION_NAME = "validate.moe.serving.dev"
HANDLER_ID = "explicit-backend-possible"  # kopf serves it at /HANDLER_ID (the chart's clientConfig path)


def server(admission: str, listen: str | None = None, cert_dir: str | None = None,
           on_ca: Callable[[bytes], None] | None = None) -> tuple[kopf.WebhookServer, bytes]:
    """`admission` is HOST:PORT the API server dials; the server binds `listen` (default HOST).
    Returns the server and the CA bundle that verifies it (the caller publishes it once). Without
    `cert_dir` the server renews its own certificate and publishes each new bundle with `on_ca`
    (the chart's configuration; kopf's own managed one is patched from the yielded client config)."""
    host, _, port = admission.rpartition(":")
    host = host or "localhost"
    if cert_dir:
        d = Path(cert_dir)
        certfile, pkeyfile, cafile = d / "tls.crt", d / "tls.key", d / "ca.crt"
        if not cafile.exists():
            cafile = certfile
        return (webhook_tls.CheckedWebhookServer(addr=listen or host, port=int(port), host=host, certfile=str(certfile),
                                                 pkeyfile=str(pkeyfile), cafile=str(cafile)), Path(cafile).read_bytes())
    srv = webhook_tls.RenewingWebhookServer(host=host, addr=listen or host, port=int(port), on_ca=on_ca)
    return srv, srv.bundle


operator_ca = webhook_tls.operator_ca  # (cert, key, ca) paths of a new CA and the certificate it signs


@kopf.on.probe(id="admission")
def admission_health(**_: Any) -> dict[str, Any]:
    """/healthz detail of the admission endpoint (webhook_tls.detail). It never fails the probe: a
    restart would not bring back what a Degraded endpoint lacks (the API server's trust, a mounted
    certificate), and the operator's reconciles do not depend on it."""
    return webhook_tls.detail(webhook_tls.HEALTH)


def verdict(spec_dict: dict[str, Any], cfg: Any, status: dict[str, Any] | None = None) -> str | None:
    """Why this spec must be refused, or None. `cfg` is the operator's reconcile Config; `status`
    the object's (an UPDATE: its pinned revision)."""
    try:
        spec = MoEDeploymentSpec.model_validate(spec_dict)
    except ValidationError as e:  # what the schema cannot say (map keys): the model's own words
        return "invalid spec: " + "; ".join(f"{'.'.join(str(p) for p in err['loc'])}: {err['msg']}" for err in e.errors())
    problems = cfg.policy.problems(spec)
    if problems:
        return "refused by the cluster's policy: " + "; ".join(problems)
    explicit = not (spec.moe.runnerBackend == "auto" and spec.moe.a2aBackend == "none"
                    and spec.moe.deferredFinalize != "on")  # auto falls back where it must
    if explicit:
        try:
            ckpt = inspect_spec(spec, local_models_dir=cfg.local_models_dir)
        except (InspectionFailed, InspectionPending):
            ckpt = None  # cannot judge without the checkpoint; the reconcile reports it
        if ckpt is not None:
            families = spec.gpu.allowedArchitectures or list(FAMILIES)
            classes = [from_name(spec.gpu.product) if spec.gpu.product else from_name(f) for f in families]
            msg = impossible_everywhere(spec, ckpt, classes)
            if msg:
                return f"moe.runnerBackend/deferredFinalize is impossible on every allowed GPU class: {msg}"
    return layout_does_not_fit(spec, cfg, status)


def layout_does_not_fit(spec: MoEDeploymentSpec, cfg: Any, status: dict[str, Any] | None = None) -> str | None:
    """A tp/gpusPerReplica the user gave that cannot hold the checkpoint on any GPU the spec allows
    (moe_core.sizing.layout_refusal, with the numbers). Judged when the checkpoint's bytes are known
    at admission: file:// (headers read here), else an inspection this process already ran of the
    revision the object would be served at (inspection.cached). A first hf:// or pvc:// model is
    admitted: its size is known only after inspection (hub calls or a Job, longer than the webhook's
    5 s), and the reconcile then refuses the layout in Planned=False with the same numbers ([Z2])."""
    if not spec.layout_given() or spec.model.format != "auto":
        return None  # sized by the operator, or inspection skipped (no byte count)
    if spec.model.uri.startswith("file://"):
        try:
            where, ckpt = spec.model.uri, inspect_spec(spec, local_models_dir=cfg.local_models_dir)
        except (InspectionFailed, InspectionPending):
            return None
    elif (hit := inspection.cached(spec.model.uri, status)) is not None:
        where, ckpt = hit
    else:
        return None
    msg = sizing.layout_refusal(ckpt, sizing.largest_gpus(spec.gpu.product, spec.gpu.allowedArchitectures or None),
                                spec.gpus_per_replica(), spec.nodesPerReplica, max_len=spec.engine.maxModelLen,
                                concurrency=spec.engine.maxConcurrency)
    return f"{msg} (checkpoint {where})" if msg else None


# The API server keeps at most 4096 characters of warnings per response and, past that, cuts each
# to 256 (k8s.io/apiserver pkg/endpoints/filters/warning.go): warnings stay short and few; the
# full reasons are in the plan (status.plan, `moe-operator plan`).
WARNING_CHARS = 256
MAX_WARNINGS = 10


def auto_warnings(plans: dict[str, Plan]) -> list[str]:
    """Admission warnings for a spec that is admitted (pure: its plan on each GPU class it may be
    placed on -> warnings): where `auto` falls back on a class (planner.auto_fallbacks), and the
    classes the spec cannot run on, which placement skips (or, when it is every class, the object
    will not be placed)."""
    out = []
    refused = [k for k, p in plans.items() if p.errors]
    for key, p in sorted(plans.items()):
        if p.errors:
            tail = "placement skips it" if len(refused) < len(plans) else "no class allowed can run it: it will not be placed"
            out.append(f"cannot run on {key} ({tail}): {p.errors[0]}")
        else:
            out += [f"auto on {key} falls back: {w}" for w in auto_fallbacks(p)]
    out = [w if len(w) <= WARNING_CHARS else w[:WARNING_CHARS - 3] + "..." for w in out]
    if len(out) > MAX_WARNINGS:
        out = out[:MAX_WARNINGS - 1] + [f"{len(out) - MAX_WARNINGS + 1} more: see `moe-operator plan` or status.plan"]
    return out


def _admission_checkpoint(spec: MoEDeploymentSpec, cfg: Any, status: dict[str, Any] | None) -> CheckpointInfo | None:
    """The checkpoint as far as admission may know it without network calls or Jobs: an explicit
    format, file:// headers, or an inspection this process already ran (inspection.cached)."""
    if spec.model.format != "auto" or spec.model.uri.startswith("file://"):
        try:
            return inspect_spec(spec, local_models_dir=cfg.local_models_dir)
        except (InspectionFailed, InspectionPending):
            return None
    hit = inspection.cached(spec.model.uri, status)
    return hit[1] if hit else None


def candidate_classes(spec: MoEDeploymentSpec, nodes: list[NodeInfo]) -> dict[str, GpuClass]:
    """The GPU classes placement may choose for this spec: the cluster's classes (from the node
    index) that the spec allows; with none, the allowed architectures and product themselves; with
    no constraint either, none (a warning for every GPU family there is would be noise)."""
    allowed = set(spec.gpu.allowedArchitectures)
    have = {k: inv.gpu_class for k, inv in inventory.build(nodes, {}).items()
            if (not allowed or inv.gpu_class.family in allowed)
            and (not spec.gpu.product or inv.gpu_class.product == spec.gpu.product)}
    if have:
        return have
    named = [from_name(spec.gpu.product)] if spec.gpu.product else [from_name(f) for f in sorted(allowed)]
    return {g.key(): g for g in named}


def fallback_warnings(spec_dict: dict[str, Any], cfg: Any, status: dict[str, Any] | None = None,
                      nodes: list[NodeInfo] | None = None) -> list[str]:
    """The admission warnings of an admitted spec (see auto_warnings); [] when the checkpoint is
    not known at admission."""
    try:
        spec = MoEDeploymentSpec.model_validate(spec_dict)
    except ValidationError:
        return []
    ckpt = _admission_checkpoint(spec, cfg, status)
    classes = candidate_classes(spec, nodes or [])
    if ckpt is None or not classes:
        return []
    choices = choices_from_spec(spec)
    return auto_warnings({k: plan(ckpt, g, choices, engine=spec.engine.name, engine_version=spec.engine.version)
                          for k, g in classes.items()})


def spec_unchanged(operation: str | None, old: Any, new: Any) -> bool:
    """An UPDATE that leaves spec as it was (kopf's own annotation patches, a user's labels, a
    finalizer): nothing to judge. Refusing it would keep kopf from recording its state on an object
    admitted before a policy tightened; the reconcile reports such an object instead."""
    if operation != "UPDATE" or old is None or new is None:
        return False
    return dict(old.get("spec") or {}) == dict(new.get("spec") or {})


def admission_handler(cfg: Any) -> Callable[..., None]:
    def admission(spec: kopf.Spec, status: Any = None, warnings: list[str] | None = None, gpu_nodes: Any = None,
                  operation: str | None = None, old: Any = None, new: Any = None, **_: Any) -> None:
        if spec_unchanged(operation, old, new):
            return
        try:
            msg = verdict(dict(spec), cfg, dict(status or {}))
        except Exception as e:  # noqa: BLE001 - a bug here must not block every write
            log.warning("admission could not judge a MoEDeployment, admitting it: %s: %s", type(e).__name__, e)
            return
        if msg:
            raise kopf.AdmissionError(msg)
        if warnings is None:
            return
        try:
            nodes = [info for key in (gpu_nodes or {}) for info in gpu_nodes[key]]
            warnings.extend(fallback_warnings(dict(spec), cfg, dict(status or {}), nodes))
        except Exception as e:  # noqa: BLE001 - warnings are advice: a bug here admits without them
            log.warning("admission could not compute warnings for a MoEDeployment: %s: %s", type(e).__name__, e)
    return admission
