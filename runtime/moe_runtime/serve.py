"""`moe-runtime serve`: probe -> inspect/validate -> plan check -> listen (not ready) -> load ->
self-test (with fallback) -> ready -> serve; SIGTERM drains in-flight requests, then exit 0.

Everything that can be refused is refused before the port opens (exit 2, one `error:` line):
unknown/unsupported checkpoint, corrupt headers, missing tensors, plan for another GPU or
checkpoint, impossible backend. Weight loading and the backend self-test run after the port opens
so that /health answers and /ready says 503 meanwhile; a failure there also exits 2.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

from .errors import RuntimeFailure
from .log import log


def _dtype(name: str, device: str):
    """auto = bf16 on every device, so the planned backend is what runs (the kernels are bf16 by
    contract); float32 is the exact mode (fp32 reference experts) for checks and debugging."""
    import torch

    return {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def prepare(args) -> dict[str, Any]:
    """Fail-fast checks (headers only, no weight data). Returns what loading needs."""
    from . import kcompat
    from .loader import validate_checkpoint
    from .plan_check import read_plan, resolve
    from .probe import probe_device

    device, probe = probe_device(args.device)
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    family = probe.family if probe else "cpu"
    product = probe.product if probe else "cpu"
    log("probe", f"device {device}: {family} ({product})", family=family, product=product,
        gpus=probe.count if probe else 0)
    v = validate_checkpoint(args.model)
    log("checkpoint", f"{v.info.architecture} {v.info.format} ({v.info.formatSource})", tensors=v.info.numTensors,
        bytes=v.nbytes, expert_format=v.expert_format)
    plan = read_plan(args.plan) if args.plan else None
    if plan is None:
        log("plan", "no --plan: resolving the backend on this node as the planner would")
    installed = kcompat.installed_packages()
    res = resolve(plan, family, product, v.info, os.environ, installed)
    for r in res.reasons:
        log("decision", r)
    for w in res.warnings:
        log("warning", w)
    return {"device": device, "family": family, "product": product, "validated": v, "resolution": res,
            "dtype": _dtype(args.dtype, device)}


def select_backend(res, device: str, metrics, skip: bool = False) -> tuple[str, bool]:
    """Self-test the candidates in order on this device; the first that passes wins."""
    from moe_core.bundled import deferred_for

    from . import kcompat

    failures = []
    for i, name in enumerate(res.backends):
        if skip:
            log("selftest", f"{name}: skipped (--skip-selftest)", backend=name)
            ok = True
        else:
            t0 = time.time()
            r = kcompat.selftest(name, res.expert_format, device)
            ok = bool(r.ok)
            log("selftest", f"{name} {res.expert_format} on {device}: {'pass' if ok else 'FAIL'} - {r.message}",
                backend=name, ok=ok, max_rel_err=r.max_rel_err, seconds=round(time.time() - t0, 2))
            if not ok:
                failures.append(f"{name}: {r.message}")
        if ok:
            if i > 0:  # (the fallback metric was counted when the failing one was left)
                log("decision", f"MoE backend fallback: {res.backends[0]} failed its self-test, using {name}",
                    backend=name)
            deferred, why = deferred_for(name, res.deferred)
            if why:
                log("decision", why)
            return name, deferred
        if res.explicit:
            break
        if i + 1 < len(res.backends):
            metrics.fallbacks.labels(name, res.backends[i + 1]).inc()
    raise RuntimeFailure("no MoE backend passed its self-test on this device: " + "; ".join(failures)
                         + (" (explicit backend choice: no fallback)" if res.explicit else ""))


def load_model(prep: dict[str, Any], backend: str, deferred: bool, max_len: int):
    import torch

    from . import kcompat
    from .loader import build_model, load_checkpoint

    dtype = prep["dtype"]
    ck = load_checkpoint(prep["validated"].root, prep["device"], dtype, validated=prep["validated"])
    if dtype == torch.float32:
        # the kernels' backends are bf16 by contract; fp32 (exact mode) uses the runtime's fp32 reference
        log("decision", f"fp32 activations: experts run on the fp32 reference instead of {backend} "
            "(bf16-only kernels); use --dtype bfloat16 to run the planned backend")
        factory = kcompat.Fp32ReferenceExperts
    else:
        cls = kcompat.load_backend(backend)
        factory = cls
    model = build_model(ck, factory, deferred)
    ck.dense.clear()
    return model, ck


def serve(args) -> int:
    import uvicorn

    from .engine import Engine
    from .metrics import Metrics
    from .server import ServerState, create_app
    from .tokenizer import Tokenizer

    prep = prepare(args)  # raises RuntimeFailure before the port opens
    try:  # `kill -USR1 PID` dumps every thread's stack (stuck-server diagnosis)
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (ValueError, OSError, AttributeError):  # no real stderr (embedded use)
        pass
    metrics = Metrics()
    v = prep["validated"]
    name = args.served_model_name or v.root.name
    state = ServerState(model_name=name, metrics=metrics)
    try:
        state.tokenizer = Tokenizer(v.root)
    except Exception as e:  # missing/corrupt tokenizer files: refuse before the port opens
        raise RuntimeFailure(f"{v.root / 'tokenizer.json'}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    max_len = args.max_model_len or min(int(v.config.get("max_position_embeddings", 2048)), 2048)
    app = create_app(state)
    failure: list[RuntimeFailure] = []

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):  # SIGTERM/SIGINT: drain first, then let uvicorn stop
            if state.draining:
                return super().handle_exit(sig, frame)
            state.draining = True
            log("shutdown", f"signal {sig}: draining in-flight requests")

            def drain():
                if state.engine is not None:
                    state.engine.drain()
                log("shutdown", "drained; exiting")
                # not super().handle_exit: uvicorn would re-raise the signal at exit (status 143);
                # a completed drain is a clean exit (0)
                self.should_exit = True

            threading.Thread(target=drain, daemon=True).start()

    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=30)
    server = Server(config)

    def startup():
        try:
            backend, deferred = select_backend(prep["resolution"], prep["device"], metrics, args.skip_selftest)
            log("decision", f"MoE backend {backend}, deferred finalize {'on' if deferred else 'off'}",
                backend=backend, deferred_finalize=deferred)
            model, ck = load_model(prep, backend, deferred, max_len)
            metrics.load_seconds.set(ck.seconds)
            metrics.load_bytes.set(ck.nbytes)
            engine = Engine(model, prep["device"], args.max_batch, args.max_queue, max_len,
                            state.tokenizer.stop_ids, metrics, cuda_graphs=args.cuda_graphs)
            engine.start()
            state.engine = engine
            metrics.backend.labels(backend, prep["resolution"].expert_format, prep["family"], str(deferred).lower()).set(1)
            state.info = {"backend": backend, "deferredFinalize": deferred, "family": prep["family"],
                          "format": v.info.format}
            state.ready = True
            metrics.ready.set(1)
            log("ready", f"serving {name} on {args.host}:{args.port}", backend=backend)
        except RuntimeFailure as e:
            failure.append(e)
            server.should_exit = True
        except Exception as e:  # unexpected: still exit non-zero with the cause
            failure.append(RuntimeFailure(f"startup failed: {type(e).__name__}: {e}"))
            server.should_exit = True

    threading.Thread(target=startup, name="moe-startup", daemon=True).start()
    server.run()
    if state.engine is not None:
        state.engine.stop()
    if failure:
        raise failure[0]
    return 0
