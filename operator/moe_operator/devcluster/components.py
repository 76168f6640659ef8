"""Command lines of the five components, as pure functions of the state-dir layout and ports.

Flag choices, and why:
- everything binds 127.0.0.1 only; ports are chosen free at start (see procs.free_port);
- etcd runs with --unsafe-no-fsync: the data is thrown away with the cluster, and fsync on a
  2-core CI disk otherwise dominates the latency of every write (hundreds of nodes);
- the API server authenticates static bearer tokens (admin in system:masters, one user per
  component) and authorizes with RBAC; service accounts are signed with our own key pair;
  --endpoint-reconciler-type=none because the only address it could advertise is loopback, which
  Endpoints validation rejects; no simulated pod ever dials the `kubernetes` Service;
- the controller manager runs all default controllers (garbage collector, service account and
  root-CA publisher, node lifecycle, ...) with per-controller service-account credentials, and
  signs CSRs with the cluster CA;
- leader election is off: there is exactly one replica of each and it saves startup time;
- kwok manages only nodes annotated kwok.x-k8s.io/node=fake, with kwokctl's default stages
  (node-fast, pod-fast) less the node heartbeat, and no node Leases: a simulated node is made Ready
  once and stays Ready at no cost. With kwokctl's heartbeat-with-lease defaults each node's Lease
  is renewed every 10 s (lease 40 s / 4) by 4 workers (kwok's nodeLeaseParallelism): 500 writes/s
  at 5,000 nodes, more than two loaded cores sustain, so Leases expired, the node lifecycle
  controller marked nodes Unknown (and tainted them), kwok re-initialised them, and 5,004 nodes
  never all stayed Ready (issue 34). The node lifecycle controller stays on (taints of a node made
  NotReady by hand, eviction) with grace periods long enough that a node without heartbeats is
  never taken for dead;
- kwok's stage workers (4 by default) are raised to KWOK_PARALLELISM, so thousands of nodes
  registering at once, and thousands of pods, go through their stages in seconds; the scheduler
  gets the controller manager's client QPS (its default 50 binds 2,000 pods in 40 s at best).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path

from .binaries import Binaries

import os as _os

SERVICE_CIDR = "10.96.0.0/16"
# Simulated pods get loopback IPs: nothing here is meant to dial a pod, but if some code does (an
# operator health-probing its runtime pods, say) the packets stay on this machine instead of
# leaving it for a private range. The price: EndpointSlice validation rejects loopback
# addresses, so Services get no endpoints. MOE_DEV_POD_CIDR overrides (e.g. 10.244.0.0/16 for
# tests that need endpoints and never dial them). kwok's own default, 10.0.0.0/24, would also
# run out after 254 pods.
POD_CIDR = _os.environ.get("MOE_DEV_POD_CIDR", "127.1.0.0/16")
SERVICE_IP = "10.96.0.1"  # first address of SERVICE_CIDR: the `kubernetes` Service
SA_ISSUER = "https://kubernetes.default.svc.cluster.local"
NODE_GRACE = "8760h"
KWOK_PARALLELISM = 16
KWOK_DEFAULT_OPTIONS = {"cidr": "10.0.0.0/24", "manageAllNodes": False, "enableDebuggingHandlers": True,
                        "enableContentionProfiling": False, "enableProfilingHandler": True,
                        "podPlayStageParallelism": 4, "nodePlayStageParallelism": 4, "nodeLeaseParallelism": 4,
                        "podsOnNodeSyncParallelism": 1, "enablePodsOnNodeSyncListPager": True,
                        "enablePodsOnNodeSyncStreamWatch": False}
# Stages left out of kwokctl's defaults: periodic node status writes (every 10-20 min per node, on
# top of the Leases), which nothing here needs.
DROPPED_STAGES = ("node-heartbeat-with-lease", "node-heartbeat")


def kwok_config(stages: str) -> str:
    """kwok's --config: the Stage documents of `stages` (kwok-stages.yaml of the binaries) except
    DROPPED_STAGES, and a KwokConfiguration with the stage workers raised (pure)."""
    import re

    docs = [d for d in re.split(r"(?m)^---[ \t]*$", stages) if d.strip()]
    kept = [d for d in docs
            if not any(re.search(rf"(?m)^  name: {re.escape(n)}[ \t]*$", d) for n in DROPPED_STAGES)]
    # every option kwok defaults (zz_generated.defaults.go of kwok v0.8.0): a KwokConfiguration read
    # from --config is not defaulted, and podsOnNodeSyncParallelism 0 would sync no pod at all
    options = {**KWOK_DEFAULT_OPTIONS, "nodePlayStageParallelism": KWOK_PARALLELISM,
               "podPlayStageParallelism": KWOK_PARALLELISM}
    conf = ("apiVersion: config.kwok.x-k8s.io/v1alpha1\nkind: KwokConfiguration\noptions:\n"
            + "".join(f"  {k}: {str(v).lower() if isinstance(v, bool) else v}\n" for k, v in options.items()))
    return "".join("---\n" + d.strip("\n") + "\n" for d in kept + [conf])


@dataclass
class Ports:
    etcd_client: int
    etcd_peer: int
    apiserver: int
    controller_manager: int
    scheduler: int
    kwok: int

    def to_json(self) -> dict[str, int]:
        return asdict(self)


@dataclass(frozen=True)
class Layout:
    """Where everything lives inside the state dir."""

    root: Path

    state_file = property(lambda s: s.root / "state.json")
    kubeconfig = property(lambda s: s.root / "kubeconfig")
    pki_dir = property(lambda s: s.root / "pki")
    etcd_data = property(lambda s: s.root / "etcd-data")
    logs = property(lambda s: s.root / "logs")
    kwok_config = property(lambda s: s.root / "kwok.yaml")

    def component_kubeconfig(self, name: str) -> Path:
        return self.root / f"{name}.kubeconfig"

    def cert_dir(self, name: str) -> Path:
        return self.root / "certs" / name

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"


def etcd(b: Binaries, lay: Layout, p: Ports) -> list[str]:
    client = f"http://127.0.0.1:{p.etcd_client}"
    peer = f"http://127.0.0.1:{p.etcd_peer}"
    return [
        str(b.etcd), "--name=dev", f"--data-dir={lay.etcd_data}",
        f"--listen-client-urls={client}", f"--advertise-client-urls={client}",
        f"--listen-peer-urls={peer}", f"--initial-advertise-peer-urls={peer}",
        f"--initial-cluster=dev={peer}", "--initial-cluster-state=new",
        "--unsafe-no-fsync", "--quota-backend-bytes=4294967296",
        "--log-level=warn",
    ]


def kube_apiserver(b: Binaries, lay: Layout, p: Ports) -> list[str]:
    pki = lay.pki_dir
    return [
        str(b.kube_apiserver),
        f"--etcd-servers=http://127.0.0.1:{p.etcd_client}",
        "--bind-address=127.0.0.1", f"--secure-port={p.apiserver}", "--advertise-address=127.0.0.1",
        "--endpoint-reconciler-type=none",
        f"--cert-dir={lay.cert_dir('kube-apiserver')}",
        f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--client-ca-file={pki / 'ca.crt'}",
        f"--token-auth-file={pki / 'tokens.csv'}",
        "--authorization-mode=RBAC",
        f"--service-account-issuer={SA_ISSUER}",
        f"--service-account-key-file={pki / 'sa.pub'}",
        f"--service-account-signing-key-file={pki / 'sa.key'}",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--allow-privileged=true",
        # kubectl logs/exec go to the node's InternalIP, which is kwok's loopback server; never
        # resolve node names (that would ask a DNS server about kwok-h200-0000).
        "--kubelet-preferred-address-types=InternalIP",
        # Room for scale tests that register hundreds of nodes and pods at once.
        "--max-requests-inflight=1000", "--max-mutating-requests-inflight=500",
        "--profiling=false",
    ]


def kube_controller_manager(b: Binaries, lay: Layout, p: Ports) -> list[str]:
    pki = lay.pki_dir
    kc = lay.component_kubeconfig("kube-controller-manager")
    return [
        str(b.kube_controller_manager),
        f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1", f"--secure-port={p.controller_manager}",
        f"--cert-dir={lay.cert_dir('kube-controller-manager')}",
        f"--service-account-private-key-file={pki / 'sa.key'}",
        f"--root-ca-file={pki / 'ca.crt'}",
        f"--cluster-signing-cert-file={pki / 'ca.crt'}", f"--cluster-signing-key-file={pki / 'ca.key'}",
        "--use-service-account-credentials=true",
        # all but the TTL controller: it re-annotates every node (node.alpha.kubernetes.io/ttl) each
        # time the node count crosses one of its boundaries (100, 500, 1,000, 2,000: some 8,600
        # node PATCHes while 5,000 register), for a kubelet cache no kwok node has
        "--controllers=*,-ttl-controller",
        f"--service-cluster-ip-range={SERVICE_CIDR}",
        "--leader-elect=false",
        "--kube-api-qps=200", "--kube-api-burst=400",
        # no heartbeats and no Leases from kwok's nodes (see the module docstring): never
        # "Kubelet stopped posting node status"; a year is forever for a dev cluster
        f"--node-monitor-grace-period={NODE_GRACE}", f"--node-startup-grace-period={NODE_GRACE}",
    ]


def kube_scheduler(b: Binaries, lay: Layout, p: Ports) -> list[str]:
    kc = lay.component_kubeconfig("kube-scheduler")
    return [
        str(b.kube_scheduler),
        f"--kubeconfig={kc}", f"--authentication-kubeconfig={kc}", f"--authorization-kubeconfig={kc}",
        "--bind-address=127.0.0.1", f"--secure-port={p.scheduler}",
        f"--cert-dir={lay.cert_dir('kube-scheduler')}",
        "--leader-elect=false",
        "--kube-api-qps=200", "--kube-api-burst=400",
    ]


def kwok(b: Binaries, lay: Layout, p: Ports) -> list[str]:
    pki = lay.pki_dir
    return [
        str(b.kwok),
        f"--kubeconfig={lay.component_kubeconfig('kwok')}",
        f"--config={lay.kwok_config}",
        "--manage-all-nodes=false",
        "--manage-nodes-with-annotation-selector=kwok.x-k8s.io/node=fake",
        "--node-lease-duration-seconds=0",  # no node Leases (see the module docstring)
        # Every node's InternalIP and kubelet endpoint is kwok's own server (it answers the
        # kubelet API for logs/exec), served with the API server's certificate (SAN 127.0.0.1).
        "--node-ip=127.0.0.1", f"--node-port={p.kwok}",
        f"--server-address=127.0.0.1:{p.kwok}",
        f"--tls-cert-file={pki / 'apiserver.crt'}", f"--tls-private-key-file={pki / 'apiserver.key'}",
        f"--cidr={POD_CIDR}",
    ]


# Start order; stop is the reverse.
ORDER = ("etcd", "kube-apiserver", "kube-controller-manager", "kube-scheduler", "kwok")
ARGV = {
    "etcd": etcd,
    "kube-apiserver": kube_apiserver,
    "kube-controller-manager": kube_controller_manager,
    "kube-scheduler": kube_scheduler,
    "kwok": kwok,
}


def health_url(name: str, p: Ports) -> str:
    return {
        "etcd": f"http://127.0.0.1:{p.etcd_client}/health",
        "kube-apiserver": f"https://127.0.0.1:{p.apiserver}/readyz",
        "kube-controller-manager": f"https://127.0.0.1:{p.controller_manager}/healthz",
        "kube-scheduler": f"https://127.0.0.1:{p.scheduler}/healthz",
        "kwok": f"https://127.0.0.1:{p.kwok}/healthz",
    }[name]
