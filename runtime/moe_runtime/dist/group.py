"""The process group of one replica: joining it (TCPStore rendezvous, attention groups, the gloo
control group), the readiness barrier, and the fp32 reductions the parallel layers call. The
`Group` is handed to whoever needs it (the models are built with it); nothing keeps it globally.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from ..errors import RuntimeFailure
from ..log import log
from .layout import Layout

DEFAULT_PORT = 29500
DEFAULT_INIT_TIMEOUT = 600.0
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


@dataclass
class Group:
    layout: Layout
    local_rank: int
    backend: str
    device: str
    attn: Any = None  # this rank's attention-group ProcessGroup
    world_pg: Any = None
    ctrl: Any = None  # gloo group for the control channel (object broadcasts)
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    attn_ranks: list[int] = field(default_factory=list)


def attn_replicated(group: Group | None) -> bool:
    """No attention-group reduction: one process, or attention replicated (tp 1 in a larger world)."""
    return group is None or group.layout.tp == 1 and group.layout.world > 1


def _reduce(x: torch.Tensor, pg) -> torch.Tensor:
    y = x.float().contiguous()
    dist.all_reduce(y, group=pg)
    return y.to(x.dtype)


def all_reduce_attn(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    if attn_replicated(group):
        return x
    return _reduce(x, group.attn)


def all_reduce_world(x: torch.Tensor, group: Group | None) -> torch.Tensor:
    if group is None:
        return x
    return _reduce(x, group.world_pg)


def init(layout: Layout, local_rank: int, device: str, master_addr: str, master_port: int,
         init_timeout: float = DEFAULT_INIT_TIMEOUT, collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT) -> Group:
    """Join the group (TCPStore rendezvous at master_addr:master_port within init_timeout), make the
    attention groups and the gloo control group; every collective has collective_timeout."""
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    t0 = time.time()
    try:
        store = dist.TCPStore(master_addr, master_port, layout.world, is_master=layout.rank == 0,
                              timeout=datetime.timedelta(seconds=init_timeout), wait_for_workers=True)
        timeout = datetime.timedelta(seconds=collective_timeout)
        kw = {"device_id": torch.device(device)} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=layout.rank, world_size=layout.world, timeout=timeout, **kw)
    except Exception as e:  # noqa: BLE001 - TCPStore/c10d raise several types; one message
        raise RuntimeFailure(f"rank {layout.rank}: cannot join the torch.distributed group of {layout.world} at "
                             f"{master_addr}:{master_port} within {init_timeout:.0f}s ({type(e).__name__}: {e})") from None
    g = Group(layout, local_rank, backend, device, collective_timeout=collective_timeout)
    g.world_pg = dist.group.WORLD
    for k in range(layout.world // layout.tp):
        ranks = list(range(k * layout.tp, (k + 1) * layout.tp))
        pg = dist.new_group(ranks, timeout=timeout)
        if k == layout.attn_group_index:
            g.attn, g.attn_ranks = pg, ranks
    g.ctrl = dist.new_group(list(range(layout.world)), backend="gloo", timeout=timeout)
    log("distributed", f"rank {layout.rank}/{layout.world} joined ({backend}, tp={layout.tp} ep={layout.ep}) in "
        f"{time.time() - t0:.1f}s", rank=layout.rank, world=layout.world, backend=backend, device=device)
    return g


def group_ready(group: Group, timeout: float = DEFAULT_INIT_TIMEOUT) -> None:
    """Every rank has loaded and built its model: a barrier on the gloo control group (monitored, so a
    rank that never arrives is named). Rank 0 marks the server ready only after it, so /ready means the
    whole group (on every node of a LeaderWorkerSet) is up; loading takes longer than the collective
    timeout on large checkpoints, hence the init timeout here."""
    t0 = time.time()
    try:
        dist.monitored_barrier(group=group.ctrl, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except Exception as e:  # noqa: BLE001 - gloo names the ranks that did not arrive
        raise RuntimeFailure(f"rank {group.layout.rank}: not every rank of the group of {group.layout.world} loaded its "
                             f"model within {timeout:.0f}s ({type(e).__name__}: {e})") from None
    log("group_ready", f"rank {group.layout.rank}: all {group.layout.world} ranks loaded ({time.time() - t0:.1f}s "
        "waiting for the others)", rank=group.layout.rank, world=group.layout.world)


def shutdown() -> None:
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
