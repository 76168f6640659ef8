"""`moe-runtime serve`, one stage after the other, never back:

  bind (the listening socket, so a busy port fails in milliseconds) -> probe (the GPU) -> plan
  check (checkpoint headers, config.json typed and consistent, plan.json, resolve_bundled) -> serve
  the socket (not ready) -> load (this rank's weights, with progress) -> self-test (the backend
  candidates in order, with fallback) -> engine (the model on the chosen backend, its KV cache) ->
  forward self-test (a short prompt through the real model: finite logits) -> ready (SIGTERM
  drains, then exit 0).

Everything that can be refused is refused before the server answers (one `error:` line, exit 1,
or 2 for a plan with errors): a busy port, unknown/unsupported checkpoint, corrupt headers, a
config that cannot work, missing tensors, plan for another GPU or checkpoint, impossible backend.
Loading and the self-tests run while /health answers and /ready says 503; a failure there also
exits non-zero with the cause.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, replace
from typing import Any

from .errors import RuntimeFailure
from .log import log


def _dtype(name: str):
    """auto = bf16 on every device, so the planned backend is what runs (the kernels are bf16 by
    contract); float32 is the exact mode (the torch reference experts in fp32) for checks and debugging."""
    import torch

    return {"auto": torch.bfloat16, "bfloat16": torch.bfloat16, "float32": torch.float32}[name]


def probe(args) -> tuple[str, str, str, int]:
    """Stage 1: (torch device, GPU family, product, GPU count) of this node; `cpu` without a GPU."""
    from .probe import probe_device

    device, result = probe_device(args.device)
    if getattr(args, "threads", 0):
        import torch

        torch.set_num_threads(args.threads)
    family, product = (result.family, result.product) if result else ("cpu", "cpu")
    count = result.count if result else 0
    log("probe", f"device {device}: {family} ({product})", family=family, product=product, gpus=count)
    return device, family, product, count


def plan_check(args, family: str, product: str):
    """Stage 2, headers only: the checkpoint is one the runtime serves, the plan is for this node and
    checkpoint, and resolve_bundled gives the backends to self-test (the exact mode decides here that
    the torch reference runs, in fp32)."""
    import torch
    from moe_kernels.backends import installed_packages

    from .loader import validate_checkpoint
    from .plan_check import read_plan, resolve

    v = validate_checkpoint(args.model)
    log("checkpoint", f"{v.info.architecture} {v.info.format} ({v.info.formatSource})", tensors=v.info.numTensors,
        bytes=v.nbytes, expert_format=v.expert_format)
    plan = read_plan(args.plan) if args.plan else None
    if plan is None:
        log("plan", "no --plan: resolving the backend on this node as the planner would")
    elif plan.layout is not None:
        world, nodes = max(getattr(args, "tp", 1), getattr(args, "ep", 1)), int(os.environ.get("LWS_GROUP_SIZE") or 1)
        if plan.layout.tp != world or plan.layout.nodes != nodes:
            raise RuntimeFailure(f"{args.plan}: the plan's layout is tp={plan.layout.tp} on {plan.layout.nodes} node(s), "
                                 f"this server runs {world} rank(s) (--tp {getattr(args, 'tp', 1)} --ep "
                                 f"{getattr(args, 'ep', 1)}) on {nodes} node(s)")
    res = resolve(plan, family, product, v.info, os.environ, installed_packages())
    dtype = _dtype(args.dtype)
    if dtype == torch.float32 and res.backends != ["torch"]:
        res.reasons.append(f"fp32 activations (exact mode): the experts run on the torch reference in fp32 instead of "
                           f"{res.backends[0]} (the kernels are bf16 by contract); --dtype bfloat16 runs the planned backend")
        res.backends, res.explicit = ["torch"], True
    for r in res.reasons:
        log("decision", r)
    for w in res.warnings:
        log("warning", w)
    return v, res, dtype


@dataclass(frozen=True)
class Prepared:
    """What stages 1 and 2 decided: the device, the GPU (family, product), the validated checkpoint,
    the backend resolution and the compute dtype."""

    device: str
    family: str
    product: str
    validated: Any  # loader.ValidatedCheckpoint
    resolution: Any  # plan_check's resolution (resolve_bundled's decision as verified in the pod)
    dtype: Any  # torch.dtype

    def on(self, device: str) -> "Prepared":
        """The same decisions for a rank of a parallel group, on its own device (cuda:<local rank>)."""
        return replace(self, device=device)


@dataclass(frozen=True)
class RankPlace:
    """One process's place in a tensor/expert-parallel group (what dist.launch.launch hands each rank)."""

    layout: Any  # dist.layout.Layout: tp, ep, this rank's global rank
    local_rank: int
    device: str
    rendezvous: Any  # addr, port of rank 0's process group store


def prepare(args) -> Prepared:
    """Stages 1 and 2: everything that can be refused before the port opens."""
    device, family, product, _ = probe(args)
    v, res, dtype = plan_check(args, family, product)
    return Prepared(device, family, product, v, res, dtype)


def load(prep: Prepared, shard=None):
    """Stage 3: the weights (progress in the log), routed experts stacked into ExpertWeights; with
    `shard` (dist.shard.ShardPlan) only this rank's slices."""
    from .loader import load_checkpoint

    return load_checkpoint(prep.validated.root, prep.device, prep.dtype, validated=prep.validated,
                           shard=shard)


def select_backend(res, device: str, metrics, skip: bool = False, experts=None) -> tuple[str, bool]:
    """Stage 4: self-test the candidates in order on this device; the first that passes wins.
    `experts`: one MoE layer's ExpertWeights; a backend that cannot run their dimensions
    (its `shape_problem`) fails before its self-test."""
    from moe_core.bundled import deferred_for
    from moe_kernels import selftest
    from moe_kernels.backends import load_backend

    failures = []
    for i, name in enumerate(res.backends):
        try:
            shape = getattr(load_backend(name), "shape_problem", None)
        except Exception:  # (an import that fails is the self-test's to report)
            shape = None
        why = shape(experts) if shape is not None and experts is not None else None
        if why is not None:
            log("selftest", f"{name} {res.expert_format}: cannot run this model's experts: {why}", backend=name, ok=False)
            failures.append(f"{name}: {why}")
            ok = False
        elif skip:
            log("selftest", f"{name}: skipped (--skip-selftest)", backend=name)
            ok = True
        else:
            t0 = time.time()
            r = selftest.selftest(name, res.expert_format, device, activation=res.activation, bias=res.bias)
            ok = bool(r.ok)
            log("selftest", f"{name} {res.expert_format} on {device}: {'pass' if ok else 'FAIL'} - {r.message}",
                backend=name, ok=ok, max_rel_err=r.max_rel_err, seconds=round(time.time() - t0, 2))
            if not ok:
                failures.append(f"{name}: {r.message}")
        if ok:
            if i > 0:  # (the fallback metric was counted when the failing one was left)
                log("decision", f"MoE backend fallback: {res.backends[0]} failed its self-test or cannot run this "
                    f"model's experts, using {name}",
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


def build(ck, backend: str, deferred: bool, dtype, group=None):
    """Stage 5: the model over the loaded tensors, each MoE layer on the chosen backend; `group` the
    process group its layers reduce over (None: one process)."""
    import functools

    import torch
    from moe_kernels.backends import load_backend
    from moe_kernels.reference import TorchExperts

    from .loader import build_model

    factory = functools.partial(TorchExperts, dtype=dtype) if dtype != torch.bfloat16 else load_backend(backend)
    model = build_model(ck, factory, deferred, group)
    ck.dense.clear()
    return model


def forward_problem(logits, tokens: int, vocab: int) -> str | None:
    """Why the self-test forward's logits ([1, tokens, V] fp32) show a model that cannot answer, or None."""
    import torch

    if tuple(logits.shape) != (1, tokens, vocab):
        return f"logits of shape {list(logits.shape)}, expected {[1, tokens, vocab]} (vocab_size {vocab})"
    bad = int((~torch.isfinite(logits)).sum())
    if bad:
        return (f"{bad} of {logits.numel()} logits are not finite (NaN/Inf): the weights, their scales or the "
                "config (rms_norm_eps, rope) give a model whose every answer would be garbage")
    return None


def forward_selftest(model, device: str, block: int, block_size: int, vocab: int, backend: str) -> None:
    """Stage 6, after the engine allocated the KV cache and before Ready: a short prompt through the
    real loaded model on the chosen backend (what the kernel self-test of stage 4 cannot see:
    these weights, this config, the whole forward). It writes only the engine's scratch block,
    which no sequence owns. A failure exits non-zero naming the problem."""
    import torch

    t0 = time.time()
    n = min(8, block_size)  # one block of the table
    ids = ((torch.arange(n) * 7919 + 3) % vocab)[None].to(device)
    try:
        logits = model(ids, torch.arange(n)[None].to(device), torch.full((1, 1), block, dtype=torch.long).to(device))
    except Exception as e:  # noqa: BLE001 - any failure of the real model is the message
        raise RuntimeFailure(f"self-test forward of the loaded model on the {backend} backend failed: "
                             f"{type(e).__name__}: {e}") from None
    if (problem := forward_problem(logits, n, vocab)):
        raise RuntimeFailure(f"self-test forward of the loaded model on the {backend} backend: {problem}")
    log("selftest", f"model forward on {backend}: {n} tokens, logits finite", backend=backend, tokens=n,
        seconds=round(time.time() - t0, 3))


def _shard_plan(v, layout):
    """The shard plan of validated checkpoint `v` over `layout`, or a RuntimeFailure naming why not."""
    from .dist.shard import ShardPlan

    from moe_core.runtime import BUNDLED

    if v.info.architecture in BUNDLED.single_rank:  # before any rank is spawned (none listed today)
        raise RuntimeFailure(f"{v.root}: {v.info.architecture} is served on one GPU only by the bundled runtime "
                             f"(here --tp {layout.tp} --ep {layout.ep}); use engine sglang or vllm to shard it")
    plan = ShardPlan(v.config, v.expert_format, layout)
    if (problems := plan.problems()):
        raise RuntimeFailure(f"{v.root}: cannot shard {v.arch} over --tp {layout.tp} --ep {layout.ep}: "
                             + "; ".join(problems))
    return plan


def _join(args, place: RankPlace):
    """This process's place in the group (moe_runtime.dist.group), on its device (cuda:<local rank>)."""
    from .dist.group import init

    rdv = place.rendezvous
    return init(place.layout, place.local_rank, place.device, rdv.addr, rdv.port, args.dist_init_timeout,
                         args.dist_timeout)


def serve_parallel(args) -> int:
    """`serve --tp N --ep M` (world max(N, M) > 1): refuse what cannot work here, then one process per
    local rank (dist.launch); global rank 0 serves HTTP, the others follow its engine steps."""
    from .dist.launch import launch
    from .dist.layout import Layout
    from .flags import check_bind

    if os.environ.get("LWS_WORKER_INDEX") in (None, "", "0"):  # the node whose rank 0 serves HTTP
        check_bind(args.host, args.port)  # a busy port before any rank spawns (rank 0 binds it again)
    prep = prepare(args)  # headers and plan only; refused before anything is spawned
    _shard_plan(prep.validated, Layout(args.tp, args.ep))
    log("decision", f"tensor parallel {args.tp}, expert parallel {args.ep}: {max(args.tp, args.ep)} ranks "
        f"({'NCCL' if str(prep.device).startswith('cuda') else 'gloo'})", tp=args.tp, ep=args.ep)
    return launch(args, prep.device, _rank_main)


def _rank_main(args, lay, local_rank, device, rdv) -> int:
    place = RankPlace(lay, local_rank, device, rdv)
    if lay.rank == 0:
        return serve(args, place)
    return follow(args, place)


def follow(args, place: RankPlace) -> int:
    """A rank other than 0: load its shard, self-test, build, then run rank 0's model calls."""
    from .dist.group import group_ready, shutdown
    from .dist.leader import follow as follow_leader
    from .metrics import Metrics

    prep = prepare(args).on(place.device)
    group = _join(args, place)
    ck = load(prep, _shard_plan(prep.validated, place.layout))
    backend, deferred = select_backend(prep.resolution, prep.device, Metrics(), args.skip_selftest,
                                       next(iter(ck.experts.values()), None))
    model = build(ck, backend, deferred, prep.dtype, group)
    group_ready(group, args.dist_init_timeout)
    log("ready", f"rank {place.layout.rank}: following rank 0", rank=place.layout.rank, backend=backend)
    try:
        return follow_leader(model, group)
    finally:
        shutdown()


def serve(args, place: RankPlace | None = None) -> int:
    """`place`: this process is global rank 0 of a tensor/expert-parallel group (None: one process)."""
    from .flags import listen

    sock = listen(args.host, args.port)  # first: a busy port fails in milliseconds, then uvicorn serves it
    try:
        return _serve(args, place, sock)
    finally:
        sock.close()


def _serve(args, place: RankPlace | None, sock) -> int:
    import uvicorn

    from .engine import Engine
    from .flags import engine_options, server_options
    from .metrics import Metrics
    from .http.app import create_app
    from .http.state import ServerState
    from .tokenize_worker import LongEncoder
    from .tokenizer import Tokenizer

    prep = prepare(args)  # raises RuntimeFailure before the server answers
    if place is not None:
        prep = prep.on(place.device)
    try:  # `kill -USR1 PID` dumps every thread's stack (stuck-server diagnosis)
        import faulthandler

        faulthandler.register(signal.SIGUSR1, all_threads=True)
    except (ValueError, OSError, AttributeError):  # no real stderr (embedded use)
        pass
    metrics = Metrics()
    v = prep.validated
    name = args.served_model_name or v.root.name
    state = ServerState(model_name=name, metrics=metrics, options=server_options(args))
    try:
        state.tokenizer = Tokenizer(v.root)
    except RuntimeFailure:  # a side file's bad value, named by the tokenizer
        raise
    except Exception as e:  # missing/corrupt tokenizer files: refuse before the port opens
        raise RuntimeFailure(f"{v.root / 'tokenizer.json'}: cannot load the tokenizer ({type(e).__name__}: {e})") from None
    if state.tokenizer.vocab_size > v.config["vocab_size"]:  # those token ids would index past the embeddings
        raise RuntimeFailure(f"{v.root / 'tokenizer.json'}: {state.tokenizer.vocab_size} tokens, more than config.json "
                             f"vocab_size = {v.config['vocab_size']} (the model has no embedding for the others)")
    # started at the first long text; encodes as the server does (the BOS tokenizer_config.json adds)
    state.long_encoder = LongEncoder(v.root / "tokenizer.json", text=state.tokenizer.to_str())
    max_len = args.max_model_len or min(int(v.config.get("max_position_embeddings", 2048)), 2048)
    app = create_app(state)
    failure: list[RuntimeFailure] = []
    leader: list[Any] = [None]

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

    host, port = sock.getsockname()[:2]  # the bound address (--port 0: the port the kernel chose)
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False,
                            timeout_graceful_shutdown=30)
    server = Server(config)

    def startup():
        try:
            group = _join(args, place) if place is not None else None
            ck = load(prep, _shard_plan(v, place.layout) if place is not None else None)
            backend, deferred = select_backend(prep.resolution, prep.device, metrics, args.skip_selftest,
                                               next(iter(ck.experts.values()), None))
            log("decision", f"MoE backend {backend}, deferred finalize {'on' if deferred else 'off'}",
                backend=backend, deferred_finalize=deferred)
            model = build(ck, backend, deferred, prep.dtype, group)
            if group is not None:
                from .dist.group import group_ready
                from .dist.leader import LeaderModel

                group_ready(group, args.dist_init_timeout)  # /ready only once every rank (every node) is up
                model = leader[0] = LeaderModel(model, group)  # every engine step reaches the other ranks
            metrics.load_seconds.set(ck.seconds)
            metrics.load_bytes.set(ck.nbytes)
            # CUDA graphs would capture the collectives without rank 0's broadcast of each step
            engine = Engine(model, prep.device, args.max_batch, args.max_queue, max_len,
                            state.tokenizer.stop_ids, metrics, **engine_options(args), cuda_graphs=args.cuda_graphs and place is None)
            forward_selftest(model, prep.device, engine.scratch_block, engine.block_size, int(v.config["vocab_size"]),
                             backend)
            engine.start()
            state.engine = engine
            metrics.backend.labels(backend, prep.resolution.expert_format, prep.family, str(deferred).lower()).set(1)
            state.info = {"backend": backend, "deferredFinalize": deferred, "family": prep.family,
                          "format": v.info.format}
            state.ready = True
            metrics.ready.set(1)
            log("ready", f"serving {name} on {args.host}:{port}", backend=backend, port=port)
        except RuntimeFailure as e:
            failure.append(e)
            server.should_exit = True
        except Exception as e:  # unexpected: still exit non-zero with the cause
            failure.append(RuntimeFailure(f"startup failed: {type(e).__name__}: {e}"))
            server.should_exit = True

    threading.Thread(target=startup, name="moe-startup", daemon=True).start()
    server.run(sockets=[sock])
    state.long_encoder.close()
    if state.engine is not None:
        state.engine.stop()
    if leader[0] is not None:
        from .dist.group import shutdown

        leader[0].stop()
        shutdown()
    if failure:
        raise failure[0]
    return 0
