"""The rank arithmetic of a tensor/expert-parallel group (pure, no process group): see moe_runtime.dist."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    rank: int = 0

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def attn_group_index(self) -> int:
        return self.rank // self.tp

    @property
    def etp(self) -> int:
        return self.world // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank // self.etp

    @property
    def etp_rank(self) -> int:
        return self.rank % self.etp

    def problem(self) -> str | None:
        if self.tp < 1 or self.ep < 1:
            return f"--tp {self.tp} --ep {self.ep}: both must be >= 1"
        if self.world % self.tp or self.world % self.ep:
            return (f"--tp {self.tp} --ep {self.ep}: one must divide the other (the world is max(tp, ep) ranks: "
                    f"attention over tp ranks, experts over ep groups)")
        return None


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """Part i of n split into `parts` equal parts: [start, stop)."""
    k = n // parts
    return i * k, (i + 1) * k
