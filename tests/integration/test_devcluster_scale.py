"""A large kwok node count stays Ready cheaply (issue 34 item 2): no node Leases, no heartbeat
writes, so an idle cluster of hundreds of nodes makes (almost) no node or Lease writes, and its
nodes stay Ready past the node lifecycle controller's default grace period (50 s), which is what
took 5,004 nodes down when their Leases were renewed every 10 s; nor does the TTL controller
re-annotate every node as the count crosses its boundaries."""

from __future__ import annotations

import json
import os
import re
import time

import pytest

from moe_operator.devcluster import DevCluster, pools as P

pytestmark = pytest.mark.integration

PER_POOL = 100  # 600 nodes: modest on two cores; their Leases alone were 3,600 writes a minute


def _writes(dc) -> dict[str, float]:
    """Writes (every verb but GET/LIST/WATCH) on nodes and leases since the API server started."""
    out: dict[str, float] = {}
    for line in dc.kubectl("get", "--raw", "/metrics", timeout=60).stdout.splitlines():
        if line.startswith("apiserver_request_total{"):
            labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
            if labels.get("resource") in ("nodes", "leases") and labels.get("verb") not in ("GET", "LIST", "WATCH"):
                k = f"{labels['verb']} {labels['resource']}/{labels.get('subresource', '')}"
                out[k] = out.get(k, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


@pytest.mark.slow
@pytest.mark.skipif(bool(os.environ.get("MOE_KUBECONFIG")), reason="needs to start its own cluster")
def test_hundreds_of_nodes_stay_ready_with_no_heartbeat_or_lease_writes(tmp_path):
    dc = DevCluster(tmp_path / "dc")
    try:
        t0 = time.monotonic()
        dc.up(pools=P.parse_pools(f"all={PER_POOL}"))
        n = PER_POOL * len(P.GPU_CLASSES)
        print(f"{n} nodes Ready in {time.monotonic() - t0:.1f}s")
        leases = dc.kubectl("get", "leases", "-n", "kube-node-lease", "-o", "name").stdout.split()
        assert not leases, f"{len(leases)} node Leases: kwok should keep none"
        time.sleep(10)  # registration's last status writes settle
        before = _writes(dc)
        window = 60.0  # past the node lifecycle controller's default 50 s grace period
        time.sleep(window)
        after = _writes(dc)
        moved = {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}
        counts = dc.node_counts()
        assert sum(c["ready"] for c in counts.values()) == n, counts
        # the old way: every node's Lease renewed every 10 s = 6 per node per minute (3,600 here);
        # what is left is the API server's own identity Lease (every 10 s) and such
        if sum(moved.values()) >= 30:
            node = json.loads(dc.kubectl("get", "node", P.node_name("h200", 0), "-o", "json",
                                         "--show-managed-fields").stdout)
            managers = [(m["manager"], m.get("subresource"), m["time"]) for m in node["metadata"]["managedFields"]]
            raise AssertionError(f"{moved} in {window:.0f}s; who wrote a node: {managers}")
        print(f"idle writes on nodes/leases in {window:.0f}s: {moved or 0}")
    finally:
        dc.down()
