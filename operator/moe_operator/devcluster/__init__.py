"""Local Kubernetes control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler
built from the Kubernetes Go modules) with simulated GPU nodes managed by kwok.

Torch-free; imports nothing heavy. See cluster.DevCluster for the Python API and cli for
`moe-operator dev-cluster up|down|status|kubeconfig|env`.
"""

from .binaries import Binaries, BuildError, ensure_binaries
from .cluster import DevCluster, StartError, default_state_dir
from .pools import GPU_CLASSES, POOL_LABEL, GpuClass, node_manifest, parse_pools, pool_manifests

__all__ = [
    "Binaries", "BuildError", "DevCluster", "GPU_CLASSES", "GpuClass", "POOL_LABEL", "StartError",
    "default_state_dir", "ensure_binaries", "node_manifest", "parse_pools", "pool_manifests",
]
