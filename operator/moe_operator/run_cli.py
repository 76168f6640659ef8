"""`moe-operator run`: the operator process (kopf) against the configured cluster."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--namespace", "-n", action="append", default=[], help="watch only these namespaces (repeatable); default: all")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--peering", default=None, help="kopf peering name: leader election between operator replicas")
    g.add_argument("--standalone", action="store_true", help="no peering (single replica)")
    p.add_argument("--metrics-port", type=int, default=9090, help="Prometheus /metrics port (0 = off)")
    p.add_argument("--liveness", default="http://0.0.0.0:8080/healthz", help="kopf liveness endpoint ('' = off)")
    p.add_argument("--log-level", default=os.environ.get("MOE_LOG_LEVEL", "info"), choices=["debug", "info", "warning"])
    p.add_argument("--default-engine", default="bundled", choices=["bundled", "sglang", "vllm"])
    p.add_argument("--runtime-image", default=None, help="runtime image repository (default ghcr.io/moe-operator/moe-runtime)")
    p.add_argument("--local-models-dir", default=os.environ.get("MOE_LOCAL_MODELS_DIR"),
                   help="dev/demo: resolve file:///models/NAME to DIR/NAME when the operator can read it")
    p.add_argument("--no-inspection-jobs", action="store_true", help="never start inspection Jobs (pvc:// will fail)")
    p.add_argument("--admission", default=None, metavar="HOST:PORT",
                   help="serve the validating webhook here (HOST is what the API server dials)")
    p.add_argument("--kubeconfig", default=None)


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

    from . import handlers
    from .images import RUNTIME_REPOSITORY

    _configure_logging(args.log_level)
    log = logging.getLogger("moe_operator")
    if args.kubeconfig:
        kconfig.load_kube_config(config_file=args.kubeconfig)
    else:
        try:
            kconfig.load_incluster_config()
        except kconfig.ConfigException:
            kconfig.load_kube_config()
    handlers.CONFIG.runtime_repository = args.runtime_image or RUNTIME_REPOSITORY
    handlers.CONFIG.default_engine = args.default_engine
    handlers.CONFIG.local_models_dir = args.local_models_dir
    handlers.CONFIG.inspect_in_cluster = not args.no_inspection_jobs
    handlers.CONFIG.admission = args.admission
    handlers.CONFIG.namespaces = list(args.namespace)
    if args.admission:
        handlers.enable_admission()
    if args.metrics_port:
        start_http_server(args.metrics_port)
    log.info("starting: namespaces=%s peering=%s default_engine=%s runtime_image=%s local_models_dir=%s",
             args.namespace or "all", args.peering or "standalone", args.default_engine,
             handlers.CONFIG.runtime_repository, args.local_models_dir)

    @kopf.on.login()
    def login(**kw):  # use the kubernetes client's configuration (kubeconfig or in-cluster)
        return kopf.login_via_client(**kw)

    asyncio.run(kopf.operator(
        clusterwide=not args.namespace, namespaces=args.namespace,
        standalone=args.peering is None, peering_name=args.peering,
        liveness_endpoint=args.liveness or None,
    ))
    return 0
