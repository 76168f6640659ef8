"""Operator at scale: thousands of simulated GPU nodes, thousands of MoEDeployments (issue 34 item 6).

Measures, on the local control plane (real kube-apiserver, scheduler, kwok nodes):
  * time from applying N MoEDeployments until all are Planned, and until all are Available;
  * reconciles per second (the operator's own Prometheus counter);
  * the operator process's CPU time and peak RSS.
The baseline in the same run is the API server itself: the time to create the same N objects
(kubectl apply), so the ratio says how much the operator adds on top of plain API writes.

    python bench/bench_operator.py [--nodes-per-pool 834] [--deployments 2000] [--idle-seconds 60]
                                   [--operator-root PREVIOUS_RELEASE_WORKTREE]

Then, with everything Available and nothing changing, the idle cost over --idle-seconds: the
operator's CPU and the API requests it makes on the objects it owns (the API server's own
apiserver_request_total, by verb, all clients), and how long a deleted owned Service / plan
ConfigMap takes to come back. --operator-root runs the operator of another checkout (a `git
worktree` of the previous release) first, against the same cluster and objects, so the A/B is one
run; each operator runs with its own defaults.
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


_OWNED = ("moedeployments", "deployments", "services", "configmaps", "leaderworkersets", "jobs",
          "persistentvolumeclaims")


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


def moeds(dc) -> list[dict]:
    return json.loads(dc.kubectl("get", "moed", "-n", "default", "-o", "json", timeout=300).stdout)["items"]


def cond(o: dict, t: str) -> bool:
    return any(c["type"] == t and c["status"] == "True" for c in (o.get("status") or {}).get("conditions", []))


def wait_back(dc, kind: str, names: list[str], timeout: float) -> float | None:
    """Seconds until every one of `names` exists again (None: not within timeout)."""
    t0, left = time.monotonic(), set(names)
    while left and time.monotonic() - t0 < timeout:
        out = dc.kubectl("get", kind, "-n", "default", "-o", "name", *sorted(left), check=False, timeout=60).stdout
        left -= {line.split("/", 1)[1] for line in out.split()}
        if left:
            time.sleep(0.2)
    return None if left else time.monotonic() - t0


def run_operator(dc, kubeconfig: str, op_root: Path, docs: list[dict], stream: str, a, state: Path,
                 cleanup: bool = True) -> dict:
    """One operator against the cluster: apply the objects, time Planned/Available, the idle cost,
    drift repair; then delete the objects (while it runs: its finalizers) and stop it."""
    port = free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(op_root / p) for p in ("operator", "runtime", "kernels"))}
    env.pop("MOE_RESYNC_SECONDS", None)  # each release with its own defaults
    log = open(state / f"operator-{op_root.name}.log", "w")
    cmd = [sys.executable, "-m", "moe_operator.cli", "run", "--kubeconfig", kubeconfig,
           "--standalone", "--metrics-port", str(port), "--liveness", "", "--log-level", "warning",
           "--local-models-dir", str(a.samples / "checkpoints")]
    helptext = subprocess.run(cmd[:4] + ["--help"], capture_output=True, text=True, env=env).stdout
    if "--allow-host-path" in helptext:   # older operators had no host-path policy
        cmd += ["--allow-host-path", "/models"]
    op = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=str(op_root))
    r: dict = {"root": str(op_root)}
    # that operator's API: an older operator refuses the defaults a newer CRD fills in
    dc.kubectl("apply", "--server-side", "--force-conflicts", "-f", str(op_root / "crds" / "moedeployments.yaml"))
    try:
        metric(port, "moe_operator_reconciles_total", wait=300)
        time.sleep(3)
        cpu0, _ = proc_stats(op.pid)
        r0 = metric(port, "moe_operator_reconciles_total")
        w0 = api_requests(dc)
        t0 = time.monotonic()
        dc.kubectl("apply", "-f", "-", input=stream, timeout=900)
        r["applied"] = time.monotonic() - t0
        planned_at = available_at = None
        n, poll = len(docs), 2 if len(docs) <= 300 else 5
        while time.monotonic() - t0 < a.timeout:
            items = moeds(dc)
            planned = sum(cond(o, "Planned") for o in items)
            multinode = sum(o["spec"].get("nodesPerReplica", 1) > 1 for o in items)
            available = sum(cond(o, "Available") for o in items)
            if planned_at is None and planned == n:
                planned_at = time.monotonic() - t0
            if available >= n - multinode and planned_at is not None:
                available_at = time.monotonic() - t0
                break
            print(f"[bench] {op_root.name} t={time.monotonic() - t0:5.1f}s planned {planned}/{n} "
                  f"available {available}", flush=True)
            time.sleep(poll)
        elapsed = time.monotonic() - t0
        cpu1, rss = proc_stats(op.pid)
        r.update(planned=planned_at, available=available_at, rollout_cpu=cpu1 - cpu0, elapsed=elapsed,
                 reconciles=metric(port, "moe_operator_reconciles_total") - r0)
        # writes on the MoEDeployments themselves during the rollout (kubectl's creates excluded):
        # kopf's finalizer and annotation patches, and status patches
        w1 = api_requests(dc)
        r["rollout_moed_writes"] = {f"{v} {res}": w1.get((v, res), 0) - w0.get((v, res), 0) for v, res in w1
                                    if res.startswith("moedeployments") and v not in ("GET", "CREATE", "POST")
                                    and w1.get((v, res), 0) - w0.get((v, res), 0)}
        degraded: dict[str, int] = {}
        for o in moeds(dc):
            for c in (o.get("status") or {}).get("conditions", []):
                if c["type"] == "Degraded" and c["status"] == "True":
                    degraded[c["reason"]] = degraded.get(c["reason"], 0) + 1
        r["degraded"] = degraded
        time.sleep(a.settle_seconds)   # let the last roll-outs settle before the idle window
        req0, icpu0 = api_requests(dc), proc_stats(op.pid)[0]
        time.sleep(a.idle_seconds)
        req1, icpu1 = api_requests(dc), proc_stats(op.pid)[0]
        r["idle"] = {k: req1.get(k, 0) - req0.get(k, 0) for k in req1 if req1.get(k, 0) - req0.get(k, 0)}
        r["idle_cpu"] = icpu1 - icpu0
        # drift: owned Services and plan ConfigMaps of a few objects deleted, the time until all are back
        names = [d["metadata"]["name"] for d in docs if d["spec"].get("nodesPerReplica", 1) == 1][:a.drift_objects]
        dc.kubectl("delete", "service", "-n", "default", "--wait=false", *names)
        r["service_back"] = wait_back(dc, "service", names, a.drift_timeout)
        dc.kubectl("delete", "configmap", "-n", "default", "--wait=false", *[x + "-plan" for x in names])
        r["configmap_back"] = wait_back(dc, "configmap", [x + "-plan" for x in names], a.drift_timeout)
        r["rss"] = proc_stats(op.pid)[1]
        if cleanup:
            dc.kubectl("delete", "moed", "--all", "-n", "default", "--wait=true", timeout=1800)
        t = time.monotonic()   # the next operator starts on a namespace the garbage collector has emptied
        while cleanup and time.monotonic() - t < 600 and dc.kubectl(
                "get", "deployments,services,configmaps", "-n", "default", "-l", "app.kubernetes.io/managed-by=moe-operator",
                "-o", "name", timeout=120).stdout.strip():
            time.sleep(5)
    finally:
        op.terminate()
        try:
            op.wait(30)
        except subprocess.TimeoutExpired:
            op.kill()
    errors = Path(log.name).read_text(errors="replace")
    r["tracebacks"], r["apply_errors"] = errors.count("Traceback"), sorted(set(re.findall(r"HTTP (4\d\d|5\d\d)", errors)))
    # what those failures said (issue 34 item 3: 422/500 applies under load), a few distinct lines
    lines = {re.sub(r"\d+", "N", ln.strip())[:300] for ln in errors.splitlines() if re.search(r"HTTP (4\d\d|5\d\d)", ln)}
    r["apply_error_lines"] = sorted(lines)[:8]
    return r


def _s(v: float | None) -> str:
    return "not reached" if v is None else f"{v:.1f} s"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--nodes-per-pool", type=int, default=60)
    ap.add_argument("--deployments", type=int, default=100)
    ap.add_argument("--timeout", type=float, default=900)
    ap.add_argument("--idle-seconds", type=float, default=60)
    ap.add_argument("--settle-seconds", type=float, default=15)
    ap.add_argument("--drift-objects", type=int, default=5)
    ap.add_argument("--drift-timeout", type=float, default=120)
    ap.add_argument("--operator-root", type=Path, default=None,
                    help="the previous release's checkout (a `git worktree`): run first, against the same cluster "
                         "and objects, as the baseline of the same run")
    a = ap.parse_args()
    roots = ([a.operator_root.resolve()] if a.operator_root else []) + [ROOT]
    # the samples (and their checkpoints) of the oldest operator: the newer one reads older specs
    a.samples = roots[0] / "deploy" / "samples"
    samples = [x for x in SAMPLES if (a.samples / x).is_file()]
    if not samples:
        raise SystemExit(f"none of {SAMPLES} in {a.samples}")

    state = Path(tempfile.mkdtemp(prefix="moe-bench-"))
    dc = DevCluster(state)
    pools = {p: a.nodes_per_pool for p in ("h100", "h200", "b200", "gb200", "rtx-pro-6000", "mi300x")}
    t = time.monotonic()
    kubeconfig = str(dc.up(pools=pools, timeout=max(180.0, sum(pools.values()) * 0.2)))
    print(f"[bench] cluster with {sum(pools.values())} nodes up in {time.monotonic() - t:.1f}s", flush=True)
    results = []
    try:
        lws_crd.install(dc.kubectl)
        dc.kubectl("apply", "--server-side", "-f", str(ROOT / "crds" / "moedeployments.yaml"))
        dc.kubectl("wait", "--for", "condition=established", "crd/moedeployments.moe.serving.dev", "--timeout=60s")
        import yaml
        docs = []
        for i in range(a.deployments):
            d = yaml.safe_load((a.samples / samples[i % len(samples)]).read_text())
            d["metadata"] = {"name": f"{d['metadata']['name']}-{i:04d}", "namespace": "default"}
            if d["spec"].get("replicas", 1) > 1:
                d["spec"]["replicas"] = 1
            docs.append(d)
        stream = "\n---\n".join(json.dumps(d) for d in docs)

        # Baseline: the API server alone (create + delete the same objects, no operator running).
        t = time.monotonic()
        dc.kubectl("apply", "-f", "-", input=stream, timeout=900)
        api_create = time.monotonic() - t
        dc.kubectl("delete", "moed", "--all", "-n", "default", "--wait=true", timeout=900)
        for i, root in enumerate(roots):
            results.append(run_operator(dc, kubeconfig, root, docs, stream, a, state, cleanup=i < len(roots) - 1))
            shown = {**results[-1], "idle": {" ".join(k): v for k, v in results[-1]["idle"].items()}}
            print(f"[bench] {json.dumps(shown, default=str)}", flush=True)
    finally:
        dc.down()
    n = len(docs)
    print()
    print(f"{sum(pools.values())} kwok nodes, {n} MoEDeployments; apply with no operator (API only) {api_create:.1f} s")
    print("| operator | all Planned | all Available | rollout CPU | peak RSS | idle CPU | idle requests / object / min "
          "| Service back | ConfigMap back | Degraded | tracebacks | MoEDeployment writes / object (rollout) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in results:
        per_min = {f"{v} {res}": c * 60 / a.idle_seconds / n for (v, res), c in sorted(r["idle"].items())}
        total = sum(per_min.values())
        print(f"| {Path(r['root']).name} | {_s(r['planned'])} | {_s(r['available'])} | "
              f"{r['rollout_cpu']:.1f} s ({100 * r['rollout_cpu'] / r['elapsed']:.0f}% of a core) | {r['rss'] / 2**20:.0f} MiB | "
              f"{r['idle_cpu']:.2f} s in {a.idle_seconds:.0f} s ({100 * r['idle_cpu'] / a.idle_seconds:.1f}%) | "
              f"{total:.2f} (" + ", ".join(f"{k} {v:.2f}" for k, v in per_min.items()) + ") | "
              f"{_s(r['service_back'])} | {_s(r['configmap_back'])} | {r['degraded'] or '-'} | {r['tracebacks']} | "
              + (", ".join(f"{k} {v / n:.2f}" for k, v in sorted(r["rollout_moed_writes"].items())) or "0") + " |")
    if len(results) == 2 and results[0]["planned"] and results[1]["planned"]:
        b, c = results
        print(f"ratios (baseline / this checkout): all Planned {b['planned'] / c['planned']:.2f}x, "
              f"idle CPU {b['idle_cpu'] / max(c['idle_cpu'], 1e-3):.1f}x, "
              f"idle requests {sum(b['idle'].values()) / max(sum(c['idle'].values()), 1):.1f}x")
    return 0 if all(r["planned"] is not None for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
