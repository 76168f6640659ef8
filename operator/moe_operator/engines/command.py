"""What every engine's command builder gets from render.py: where the model is, the operator's flags, the
plan's flags, and the pod's place in a multi-node replica."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Launch:
    model: str  # the model argument (a local path or a hub repo)
    extra: list[str]  # the operator's flags (revision, served name, max length)
    plan_args: list[str]  # the plan's flags
    nodes: int  # nodes per replica (a LeaderWorkerSet group when > 1)
    role: str  # single | leader | worker
    port: int
    plan_file: str  # where plan.json is mounted
    dist_port: int  # the bundled runtime's torch.distributed rendezvous port

    @property
    def rank(self) -> str:
        return "0" if self.role == "leader" else "$(LWS_WORKER_INDEX)"
