"""Operator at scale: a few hundred simulated GPU nodes, a hundred MoEDeployments.

Measures, on the local control plane (real kube-apiserver, scheduler, kwok nodes):
  * time from applying N MoEDeployments until all are Planned, and until all are Available;
  * reconciles per second (the operator's own Prometheus counter);
  * the operator process's CPU time and peak RSS.
The baseline in the same run is the API server itself: the time to create the same N objects
(kubectl apply), so the ratio says how much the operator adds on top of plain API writes.

    python bench/bench_operator.py [--nodes-per-pool 60] [--deployments 100] [--idle-seconds 30]
                                   [--operator-root OTHER_CHECKOUT]

Then, with everything Available and nothing changing, the idle cost over --idle-seconds: the
operator's CPU and the API requests it makes on the objects it owns (the API server's own
apiserver_request_total, by verb). --operator-root runs the operator of another checkout (e.g. a
`git worktree` of an older commit) against the same cluster and objects, for an A/B.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT / p) for p in ("operator", "runtime", "kernels")]

from moe_operator.devcluster import DevCluster  # noqa: E402
from moe_operator import lws_crd  # noqa: E402

SAMPLES = ["deepseek-v4-fp4-h200.yaml", "deepseek-v4-fp4-b200.yaml", "deepseek-v3-nvfp4-b200.yaml",
           "gpt-oss-mxfp4-h100.yaml", "qwen3-moe-fp8.yaml", "explicit-backend-override.yaml"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def proc_stats(pid: int) -> tuple[float, int]:
    """(CPU seconds, peak RSS bytes) of a process, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    cpu = (int(fields[11]) + int(fields[12])) / tick
    hwm = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
    return cpu, int(hwm.group(1)) * 1024 if hwm else 0


def metric(port: int, name: str, wait: float = 60) -> float:
    deadline = time.monotonic() + wait
    while True:   # the operator may take a while to open its metrics port on a loaded machine
        try:
            text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
            break
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(1)
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


_OWNED = ("moedeployments", "deployments", "services", "configmaps", "leaderworkersets", "jobs")


def api_requests(dc) -> dict[tuple[str, str], float]:
    """apiserver_request_total summed by (verb, resource) over the kinds the operator owns."""
    out: dict[tuple[str, str], float] = {}
    for line in dc.kubectl("get", "--raw", "/metrics", timeout=60).stdout.splitlines():
        if not line.startswith("apiserver_request_total{"):
            continue
        labels = dict(re.findall(r'(\w+)="([^"]*)"', line.split("}", 1)[0]))
        if labels.get("resource") in _OWNED and labels.get("verb") not in ("WATCH", "LIST"):
            key = (labels["verb"], labels["resource"] + ("/" + labels["subresource"] if labels.get("subresource") else ""))
            out[key] = out.get(key, 0) + float(line.rsplit(" ", 1)[1])
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes-per-pool", type=int, default=60)
    ap.add_argument("--deployments", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--idle-seconds", type=float, default=30)
    ap.add_argument("--operator-root", type=Path, default=ROOT, help="checkout whose operator runs (default: this one)")
    a = ap.parse_args()
    op_root = a.operator_root.resolve()

    state = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    dc = DevCluster(state)
    pools = {p: a.nodes_per_pool for p in ("h100", "h200", "b200", "gb200", "rtx-pro-6000", "mi300x")}
    t = time.monotonic()
    kubeconfig = str(dc.up(pools=pools))
    print(f"[bench] cluster with {sum(pools.values())} nodes up in {time.monotonic() - t:.1f}s", flush=True)
    try:
        lws_crd.install(dc.kubectl)
        dc.kubectl("apply", "--server-side", "-f", str(op_root / "crds" / "moedeployments.yaml"))  # that operator's API
        dc.kubectl("wait", "--for", "condition=established", "crd/moedeployments.moe.serving.dev", "--timeout=60s")
        docs = []
        for i in range(a.deployments):
            import yaml
            d = yaml.safe_load((ROOT / "deploy" / "samples" / SAMPLES[i % len(SAMPLES)]).read_text())
            d["metadata"] = {"name": f"{d['metadata']['name']}-{i:03d}", "namespace": "default"}
            if d["spec"].get("replicas", 1) > 1:
                d["spec"]["replicas"] = 1
            docs.append(d)
        stream = "\n---\n".join(json.dumps(d) for d in docs)

        # Baseline: the API server alone (create + delete the same objects, no operator running).
        t = time.monotonic()
        dc.kubectl("apply", "-f", "-", input=stream, timeout=600)
        api_create = time.monotonic() - t
        dc.kubectl("delete", "moed", "--all", "-n", "default", "--wait=true", timeout=600)

        port = free_port()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(op_root / p) for p in ("operator", "runtime", "kernels")),
               "MOE_RESYNC_SECONDS": "10"}
        log = open(state / "operator.log", "w")
        cmd = [sys.executable, "-m", "moe_operator.cli", "run", "--kubeconfig", kubeconfig,
               "--standalone", "--metrics-port", str(port), "--liveness", "", "--log-level", "warning",
               "--local-models-dir", str(ROOT / "deploy" / "samples" / "checkpoints")]
        helptext = subprocess.run(cmd[:4] + ["--help"], capture_output=True, text=True, env=env).stdout
        if "--allow-host-path" in helptext:   # older operators had no host-path policy
            cmd += ["--allow-host-path", "/models"]
        op = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        time.sleep(3)
        cpu0, _ = proc_stats(op.pid)
        r0 = metric(port, "moe_operator_reconciles_total")
        t0 = time.monotonic()
        dc.kubectl("apply", "-f", "-", input=stream, timeout=600)
        applied = time.monotonic() - t0
        planned_at = available_at = None
        while time.monotonic() - t0 < a.timeout:
            items = json.loads(dc.kubectl("get", "moed", "-n", "default", "-o", "json", timeout=120).stdout)["items"]

            def cond(o, t):
                return any(c["type"] == t and c["status"] == "True" for c in (o.get("status") or {}).get("conditions", []))
            planned = sum(cond(o, "Planned") for o in items)
            multinode = sum(o["spec"].get("nodesPerReplica", 1) > 1 for o in items)
            available = sum(cond(o, "Available") for o in items)
            if planned_at is None and planned == len(docs):
                planned_at = time.monotonic() - t0
            if available >= len(docs) - multinode:
                available_at = time.monotonic() - t0
                break
            print(f"[bench] t={time.monotonic() - t0:5.1f}s planned {planned}/{len(docs)} available {available}", flush=True)
            time.sleep(2)
        elapsed = time.monotonic() - t0
        cpu1, rss = proc_stats(op.pid)
        reconciles = metric(port, "moe_operator_reconciles_total") - r0
        time.sleep(15)   # let the last roll-outs settle before the idle window
        req0, icpu0 = api_requests(dc), proc_stats(op.pid)[0]
        time.sleep(a.idle_seconds)
        req1, icpu1 = api_requests(dc), proc_stats(op.pid)[0]
        idle = {k: req1.get(k, 0) - req0.get(k, 0) for k in req1 if req1.get(k, 0) - req0.get(k, 0)}
        op.terminate()
        op.wait(30)
    finally:
        dc.down()
    n = len(docs)
    print()
    print(f"| nodes | MoEDeployments | apply (API only) | all Planned | all Available | reconciles/s | operator CPU | peak RSS |")
    print(f"|---|---|---|---|---|---|---|---|")
    print(f"| {sum(pools.values())} | {n} | {api_create:.1f} s | "
          f"{planned_at if planned_at is None else f'{planned_at:.1f} s'} ({(planned_at or 0) / api_create:.1f}x API) | "
          f"{available_at if available_at is None else f'{available_at:.1f} s'} | {reconciles / elapsed:.1f} | "
          f"{cpu1 - cpu0:.1f} s ({100 * (cpu1 - cpu0) / elapsed:.0f}% of a core) | {rss / 2**20:.0f} MiB |")
    print(f"(apply with the operator running took {applied:.1f}s; multi-node LWS replicas have no local controller "
          "and are counted as Planned only)")
    print(f"idle {a.idle_seconds:.0f} s, operator {op_root}: CPU {icpu1 - icpu0:.2f} s; API requests on owned kinds "
          f"per object per minute: " + ", ".join(f"{v} {r} {c * 60 / a.idle_seconds / n:.2f}"
                                                 for (v, r), c in sorted(idle.items())))
    return 0 if available_at is not None else 1


if __name__ == "__main__":
    sys.exit(main())
