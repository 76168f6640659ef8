"""Launch: one process per local device (from `moe-runtime serve --tp N --ep M`). Multi-node:
LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX (LeaderWorkerSet) give the rendezvous. The
launcher takes the node's group down (non-zero exit, with the rank and its exit status) when one
process dies."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from typing import Callable

import torch

from ..errors import RuntimeFailure
from ..log import log
from .layout import Layout


@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int
    nodes: int
    node_index: int
    local_world: int


def rendezvous(world: int, port: int, env=os.environ) -> Rendezvous:
    """This node's place in the group: the LeaderWorkerSet environment when present, else one node.
    LWS_GROUP_SIZE nodes of world / nodes ranks each; this node's ranks are LWS_WORKER_INDEX x (world /
    nodes) + local rank; the group's rank 0 (TCPStore, HTTP) is on the leader, LWS_LEADER_ADDRESS
    (MASTER_ADDR when that is unset, as torchrun names it)."""
    try:
        nodes = int(env.get("LWS_GROUP_SIZE") or 1)
        index = int(env.get("LWS_WORKER_INDEX") or 0)
    except ValueError:
        raise RuntimeFailure(f"LeaderWorkerSet env: LWS_GROUP_SIZE={env.get('LWS_GROUP_SIZE')!r} and LWS_WORKER_INDEX="
                             f"{env.get('LWS_WORKER_INDEX')!r} must be integers") from None
    addr = env.get("LWS_LEADER_ADDRESS") or env.get("MASTER_ADDR") or ""
    if nodes < 1 or not 0 <= index < nodes:
        raise RuntimeFailure(f"LeaderWorkerSet env: LWS_WORKER_INDEX={index} outside 0..{nodes - 1} (LWS_GROUP_SIZE={nodes})")
    if world % nodes:
        raise RuntimeFailure(f"world of {world} ranks (max(--tp, --ep)) does not split over LWS_GROUP_SIZE={nodes} nodes")
    if nodes > 1 and not addr:
        raise RuntimeFailure(f"LeaderWorkerSet env: LWS_GROUP_SIZE={nodes} but no LWS_LEADER_ADDRESS (or MASTER_ADDR) "
                             "to meet the group's rank 0 at")
    addr = addr or "127.0.0.1"
    if port == 0:
        if nodes > 1:
            raise RuntimeFailure("--dist-port 0 (any free port) works on one node only; multi-node needs a fixed port")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return Rendezvous(addr, port, nodes, index, world // nodes)


def _child(local_rank: int, args, rdv: Rendezvous, device: str, entry: Callable[..., int]) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    rank = rdv.node_index * rdv.local_world + local_rank
    lay = Layout(args.tp, args.ep, rank)
    dev = f"cuda:{local_rank}" if device.startswith("cuda") else "cpu"
    code = 1
    try:
        code = entry(args, lay, local_rank, dev, rdv)
    except RuntimeFailure as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    except Exception as e:  # noqa: BLE001
        print(f"error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(args, device: str, entry: Callable[..., int], env=os.environ) -> int:
    """Spawn this node's ranks; supervise them: the first to exit non-zero takes the others down (exit 1
    with the rank and its status); rank 0 exiting 0 (a drained SIGTERM) stops the rest and exits 0."""
    lay = Layout(args.tp, args.ep)
    if (p := lay.problem()):
        raise RuntimeFailure(p)
    rdv = rendezvous(lay.world, args.dist_port, env)
    if device.startswith("cuda"):
        n = torch.cuda.device_count()
        if rdv.local_world > n:
            raise RuntimeFailure(f"--tp {args.tp} --ep {args.ep} over {rdv.nodes} node(s) needs {rdv.local_world} GPUs "
                                 f"on this node; {n} visible")
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    ctx = mp.get_context("spawn")
    procs = []
    for i in range(rdv.local_world):
        p = ctx.Process(target=_child, args=(i, args, rdv, device, entry), name=f"moe-rank-{i}", daemon=False)
        p.start()
        procs.append(p)
        log("launch", f"rank {rdv.node_index * rdv.local_world + i} pid {p.pid}", rank=rdv.node_index * rdv.local_world + i,
            pid=p.pid, node=rdv.node_index, master=f"{rdv.addr}:{rdv.port}")

    def forward_signal(sig, frame):
        first = procs[0]
        if first.is_alive():
            os.kill(first.pid, sig)  # rank 0 of this node drains (leader) or exits (worker)

    old = {s: signal.signal(s, forward_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            for i, p in enumerate(procs):
                if p.exitcode is None:
                    continue
                rank = rdv.node_index * rdv.local_world + i
                if p.exitcode != 0 or i == 0:
                    if p.exitcode != 0:
                        how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"status {p.exitcode}"
                        print(f"error: rank {rank} (pid {p.pid}) exited with {how}; stopping the other "
                              f"{len(procs) - 1} rank(s) of this node", file=sys.stderr, flush=True)
                    _stop(procs)
                    return 0 if p.exitcode == 0 else 1
            if all(p.exitcode == 0 for p in procs):
                return 0
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(procs, grace: float = 5.0) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    t0 = time.time()
    for p in procs:
        p.join(timeout=max(grace - (time.time() - t0), 0.1))
        if p.exitcode is None:
            p.kill()
            p.join(timeout=2)
