"""`moe-operator run`: the operator process (kopf) against the configured cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re

from .policy import ON_VIOLATION, TOKEN_SECRET_LABEL, Policy


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", "-n", action="append", default=[], help="watch only these namespaces (repeatable); default: all")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--peering", default=None, help="kopf peering name: leader election between operator replicas")
    g.add_argument("--standalone", action="store_true", help="no peering (single replica)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 = off)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint ('' = off)")
    p.add_argument("--log-level", default=os.environ.get("MOE_LOG_LEVEL", "info"), choices=["debug", "info", "warning"])
    p.add_argument("--runtime-image", default=None, help="runtime image repository (default ghcr.io/moe-operator/moe-runtime)")
    p.add_argument("--runtime-image-tag", default=None, metavar="VERSION",
                   help="version part of the runtime image tag; -cu<N>[-flashinfer][-arm64] is appended per node "
                        "(default the operator's release)")
    from .images import ENGINE_REPOSITORIES  # the engines served from their own image (engines/<engine>/image.py)

    for engine, repo in ENGINE_REPOSITORIES.items():
        p.add_argument(f"--{engine}-image", default=None, metavar="REPOSITORY",
                       help=f"repository of the default {engine} image, e.g. a mirror (default {repo})")
        p.add_argument(f"--{engine}-image-tag", default=None, metavar="TEMPLATE",
                       help=f"tag of the default {engine} image; {{version}} is the engine release (default v{{version}}; "
                            "-rocm / the arm64 suffix appended as for the public tags)")
    p.add_argument("--image-pull-secret", action="append", default=[], metavar="NAME",
                   help="Secret every inference pod and operator Job names in imagePullSecrets (repeatable; it must "
                        "exist in each MoEDeployment's namespace)")
    p.add_argument("--local-models-dir", default=os.environ.get("MOE_LOCAL_MODELS_DIR"),
                   help="dev/demo: resolve file:///models/NAME to DIR/NAME when the operator can read it")
    p.add_argument("--no-inspection-jobs", action="store_true", help="never start inspection Jobs (pvc:// will fail)")
    p.add_argument("--admission", default=None, metavar="HOST:PORT",
                   help="serve the validating webhook here (HOST is what the API server dials)")
    p.add_argument("--admission-listen", default=None, metavar="ADDR",
                   help="address the webhook binds (default: HOST of --admission; 0.0.0.0 in a pod)")
    p.add_argument("--admission-configuration", default=None, metavar="NAME",
                   help="ValidatingWebhookConfiguration the chart installed (the operator writes its CA there unless "
                        "--admission-cert-dir); default: kopf creates validate.moe.serving.dev pointing at --admission")
    p.add_argument("--admission-cert-dir", default=None, metavar="DIR",
                   help="tls.crt, tls.key and ca.crt for the webhook (cert-manager's Secret); default: a CA the operator makes")
    p.add_argument("--allow-host-path", action="append", default=[], metavar="DIR",
                   help="file:// models may be read from under DIR (repeatable); default: no host path")
    p.add_argument("--allow-image-registry", action="append", default=[], metavar="PREFIX",
                   help="spec.engine.image must start with PREFIX, e.g. docker.io/lmsysorg (repeatable); default: any")
    p.add_argument("--allow-service-type", action="append", default=[], choices=["ClusterIP", "NodePort", "LoadBalancer"],
                   help="spec.service.type may be this (repeatable); default: ClusterIP only")
    p.add_argument("--on-policy-violation", choices=list(ON_VIOLATION), default="keep",
                   help="a running workload whose spec a tightened policy no longer allows: keep it running "
                        "(refuse only changes) or scaleToZero (PolicyEnforced Event); default keep")
    p.add_argument("--no-token-secret-label", action="store_true",
                   help=f"do not require the label {TOKEN_SECRET_LABEL}=true on Secrets named by model.tokenSecretRef")
    p.add_argument("--engine-cache-host-path", default=None, metavar="DIR",
                   help="keep engine autotune caches on the node under DIR/<namespace>/ (default: per pod, emptyDir)")
    p.add_argument("--model-cache-grace", type=float, default=3600.0, metavar="SECONDS",
                   help="delete a model cache PVC this long after its last MoEDeployment went (default 3600)")
    p.add_argument("--model-cache-default", choices=["on", "off"], default="off",
                   help="spec.model.cache.enabled for MoEDeployments that leave it unset (default off)")
    p.add_argument("--model-cache-storage-class", default=None, metavar="CLASS",
                   help="StorageClass of model cache PVCs whose spec names none (default: the cluster's default)")
    p.add_argument("--model-cache-copy-groups", type=_gids, default=(), metavar="GID[,GID...]",
                   help="supplementalGroups of the pvc:// copy Jobs (still uid 65532, non-root): groups that may read "
                        "source volumes whose model files are group-readable only (default none)")
    p.add_argument("--kubeconfig", default=None)


def registries_from(args: argparse.Namespace):
    """images.Registries from the flags (the chart's runtimeImage and engineImages values); a bad
    repository or tag stops the start with the flag named, not every pod with ErrImagePull."""
    from . import image_ref
    from .images import DEFAULT_TAG, ENGINE_REPOSITORIES, RUNTIME_REPOSITORY, RUNTIME_VERSION, Registries

    repos = {e: getattr(args, f"{e}_image") or ENGINE_REPOSITORIES[e] for e in ENGINE_REPOSITORIES}
    tags = {e: getattr(args, f"{e}_image_tag") or DEFAULT_TAG for e in ENGINE_REPOSITORIES}
    reg = Registries(runtime_repository=args.runtime_image or RUNTIME_REPOSITORY,
                     runtime_tag=args.runtime_image_tag or RUNTIME_VERSION, engine_repositories=repos,
                     engine_tags=tags, pull_secrets=tuple(args.image_pull_secret))
    checks = [("--runtime-image/--runtime-image-tag", f"{reg.runtime_repository}:{reg.runtime_tag}-cu13")]
    checks += [(f"--{e}-image/--{e}-image-tag", f"{repos[e]}:{tags[e].replace('{version}', '0.1.0')}") for e in repos]
    for flag, ref in checks:
        try:
            image_ref.parse(ref)
        except ValueError as e:
            raise SystemExit(f"moe-operator run: {flag}: {e}") from None
    for name in reg.pull_secrets:
        if not re.fullmatch(r"[a-z0-9]([-a-z0-9.]*[a-z0-9])?", name) or len(name) > 253:
            raise SystemExit(f"moe-operator run: --image-pull-secret {name!r} is not a Secret name")
    return reg


def _gids(text: str) -> tuple[int, ...]:
    try:
        gids = tuple(int(g) for g in text.split(",") if g.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected group ids like 1000,2000") from None
    if any(g <= 0 or g >= 2 ** 31 for g in gids):
        raise argparse.ArgumentTypeError(f"{text!r}: group ids are 1..2147483647 (0, root's group, is not allowed)")
    return gids


def _configure_logging(level: str) -> None:
    # One line per event, key=value, so decisions can be grepped and shipped as structured logs.
    logging.basicConfig(level=getattr(logging, level.upper()),
                        format="ts=%(asctime)s level=%(levelname)s logger=%(name)s msg=%(message)s")


def run(args: argparse.Namespace) -> int:
    if args.kubeconfig:
        # Before importing the kubernetes client: it reads KUBECONFIG into a default at import time.
        os.environ["KUBECONFIG"] = os.path.abspath(args.kubeconfig)
    import kopf
    from kubernetes import config as kconfig
    from prometheus_client import start_http_server

    from . import handlers, images

    _configure_logging(args.log_level)
    log = logging.getLogger("moe_operator")
    if args.kubeconfig:
        kconfig.load_kube_config(config_file=args.kubeconfig)
    else:
        try:
            kconfig.load_incluster_config()
        except kconfig.ConfigException:
            kconfig.load_kube_config()
    registries = registries_from(args)
    images.configure(registries)
    handlers.CONFIG.runtime_repository = registries.runtime_repository
    handlers.CONFIG.local_models_dir = args.local_models_dir
    handlers.CONFIG.inspect_in_cluster = not args.no_inspection_jobs
    handlers.CONFIG.admission = args.admission
    handlers.CONFIG.namespaces = list(args.namespace)
    handlers.CONFIG.admission_listen = args.admission_listen
    handlers.CONFIG.admission_cert_dir = args.admission_cert_dir
    handlers.CONFIG.admission_configuration = args.admission_configuration
    handlers.CONFIG.policy = Policy(allowed_host_paths=tuple(args.allow_host_path),
                                    allowed_registries=tuple(args.allow_image_registry),
                                    require_token_label=not args.no_token_secret_label,
                                    allowed_service_types=tuple(args.allow_service_type or ["ClusterIP"]),
                                    on_violation=args.on_policy_violation)
    handlers.CONFIG.engine_cache_root = args.engine_cache_host_path
    handlers.CONFIG.model_cache_grace_seconds = args.model_cache_grace
    handlers.CONFIG.model_cache_enabled = args.model_cache_default == "on"
    handlers.CONFIG.model_cache_storage_class = args.model_cache_storage_class or None
    handlers.CONFIG.model_cache_copy_groups = tuple(args.model_cache_copy_groups)
    if args.admission:
        handlers.enable_admission()
    if args.metrics_port:
        start_http_server(args.metrics_port)
    log.info("images: runtime=%s:%s %s pull_secrets=%s", registries.runtime_repository, registries.runtime_tag,
             " ".join(f"{e}={repo}:{registries.engine_tags[e]}" for e, repo in registries.engine_repositories.items()),
             ",".join(registries.pull_secrets) or "none")
    log.info("starting: namespaces=%s peering=%s runtime_image=%s local_models_dir=%s "
             "allowed_host_paths=%s allowed_image_registries=%s token_secret_label=%s engine_cache=%s",
             args.namespace or "all", args.peering or "standalone",
             handlers.CONFIG.runtime_repository, args.local_models_dir, args.allow_host_path or "none",
             args.allow_image_registry or "any", not args.no_token_secret_label,
             args.engine_cache_host_path or "emptyDir")

    @kopf.on.login()
    def login(**kw):  # use the kubernetes client's configuration (kubeconfig or in-cluster)
        return kopf.login_via_client(**kw)

    asyncio.run(kopf.operator(
        clusterwide=not args.namespace, namespaces=args.namespace,
        standalone=args.peering is None, peering_name=args.peering,
        liveness_endpoint=args.liveness or None,
    ))
    return 0
