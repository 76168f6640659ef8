"""Which MoEDeployments the periodic sweep reconciles (pure; issue 34 item 1).

Owned-object drift and readiness come from watch events, spec changes from kopf's handlers, so a
sweep need not reconcile an object whose inputs did not move since its last reconcile: the same
resourceVersion (our own status write included), the same GPU inventory, no retry due. Each object
is still reconciled in full every `full_seconds` (the safety net for anything a watch missed).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Mark:
    """What one object's last finished reconcile saw."""

    resource_version: str | None  # the MoEDeployment's, after our status write
    inventory: str | None  # fingerprint of the GPU classes
    at: float  # when it finished (monotonic seconds)
    retry_at: float | None = None  # the reconcile asked to be run again then


def due(mark: Mark | None, resource_version: str | None, inventory: str | None, now: float,
        full_seconds: float) -> bool:
    if mark is None:
        return True
    if mark.resource_version != resource_version or mark.inventory != inventory:
        return True
    if mark.retry_at is not None and now >= mark.retry_at:
        return True
    return now - mark.at >= full_seconds
