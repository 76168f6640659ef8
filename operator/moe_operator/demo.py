"""`moe-operator demo`: the whole product on one machine, every long step showing progress.

1. a cluster: your kubeconfig's if it answers, else the local control plane with simulated GPU pools;
2. the Helm chart (CRDs, RBAC; the operator Deployment scaled to 0 because the GPU nodes are
   simulated, so the operator process runs here, against the same API server);
3. the file:// samples from deploy/samples/demo, and a table of what was decided for each and where pods landed;
3b. a model cache filling (local control plane only): a local server speaking the hub's file API
   serves a tiny checkpoint as an hf:// model; the operator pins its revision and creates the cache
   PVC and its download Job; the Job's container (kwok runs none) runs here as rendered, into the
   PV's directory, with progress;
4. one bundled runtime started locally on a tiny generated checkpoint with the env and args the
   operator rendered for it, and a completion request.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NAMESPACE = "moe-demo"


def say(msg: str) -> None:
    print(f"[demo] {msg}", flush=True)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--kubeconfig", default=None, help="use this cluster (default: $KUBECONFIG or ~/.kube/config if reachable, else a local one)")
    p.add_argument("--local", action="store_true", help="always use the local control plane")
    p.add_argument("--down", action="store_true", help="stop the local control plane at the end")
    p.add_argument("--skip-runtime", action="store_true", help="do not start the bundled runtime")
    p.add_argument("--skip-cache", action="store_true", help="do not show the model cache filling")


def _reachable(kubeconfig: str, kubectl: Path) -> bool:
    r = subprocess.run([str(kubectl), "--kubeconfig", kubeconfig, "get", "--raw", "/readyz", "--request-timeout=5s"],
                       capture_output=True, text=True)
    return r.returncode == 0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    from .devcluster import DevCluster
    from .devcluster.binaries import ensure_binaries

    t0 = time.monotonic()
    say("building or reusing the Kubernetes binaries (kubectl, helm, ...)")
    bins = ensure_binaries(build=True)
    kubectl, helm = bins.path("kubectl"), bins.path("helm")
    candidate = args.kubeconfig or os.environ.get("KUBECONFIG") or str(Path.home() / ".kube" / "config")
    cluster = None
    if not args.local and Path(candidate).is_file() and _reachable(candidate, kubectl):
        kubeconfig = candidate
        say(f"using the cluster of {kubeconfig}")
    else:
        say("no reachable cluster configured: starting the local control plane with simulated GPU pools")
        cluster = DevCluster()
        # Enough whole 8-GPU nodes for every sample to get its pods.
        kubeconfig = str(cluster.up())
        cluster.ensure_pools({"h100": 3, "h200": 4, "b200": 4})
    env = {**os.environ, "KUBECONFIG": kubeconfig}

    def k(*a: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess:
        return subprocess.run([str(kubectl), *a], env=env, capture_output=True, text=True, check=check, input=input)

    say("installing the Helm chart (CRDs, RBAC; operator replicas=0: it runs on this machine)")
    r = subprocess.run([str(helm), "upgrade", "--install", "moe-operator", str(ROOT / "charts" / "moe-operator"),
                        "-n", "moe-system", "--create-namespace", "--set", "replicas=0", "--wait", "--timeout", "120s",
                        # the CRD may exist already (an earlier demo, a kubectl apply): adopt it
                        "--take-ownership"],
                       env=env, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stderr, file=sys.stderr)
        return 1
    k("wait", "--for", "condition=established", "crd/moedeployments.moe.serving.dev", "--timeout=60s")
    if k("get", "crd", "leaderworkersets.leaderworkerset.x-k8s.io", check=False).returncode != 0:
        from .lws_crd import LWS_VERSION, install
        say(f"installing the LeaderWorkerSet CRD (lws {LWS_VERSION}, from the Go module proxy) for multi-node replicas")
        install(k)
    k("create", "namespace", NAMESPACE, check=False)

    # The cache step runs on the local control plane only: there the operator's hub is the local
    # server (HF_ENDPOINT), which would be wrong for the hf:// models of a real cluster.
    hub = _start_hub() if cluster is not None and not args.skip_cache else None
    hf_home = tempfile.mkdtemp(prefix="moe-demo-hf-")
    hub_env = {"HF_ENDPOINT": hub.url, "HF_HUB_DISABLE_XET": "1", "HF_HOME": hf_home} if hub else {}
    log_path = Path(tempfile.gettempdir()) / "moe-operator-demo.log"
    say(f"starting the operator (log: {log_path}" + (f"; HF_ENDPOINT={hub.url}, the local hub server)" if hub else ")"))
    op = subprocess.Popen([sys.executable, "-m", "moe_operator.cli", "run", "--kubeconfig", kubeconfig,
                           "--standalone", "--metrics-port", "0", "--liveness", "",
                           "--local-models-dir", str(ROOT / "deploy" / "samples" / "checkpoints"),
                           # the samples' file:///models/... and the tiny checkpoint the demo writes
                           "--allow-host-path", "/models", "--allow-host-path", str(demo_cache())],
                          stdout=open(log_path, "w"), stderr=subprocess.STDOUT,
                          env={**env, "MOE_RESYNC_SECONDS": "3", "PYTHONUNBUFFERED": "1", **hub_env},
                          start_new_session=True)
    try:
        return _demo(args, k, op, kubeconfig, t0, cluster, hub)
    finally:
        _stop(op, 20)
        if hub is not None:
            hub.stop()
        shutil.rmtree(hf_home, ignore_errors=True)
        if cluster is not None:
            if args.down:
                cluster.down()
            else:
                say(f"the local control plane keeps running: export KUBECONFIG={kubeconfig}; "
                    "kubectl get moed -n moe-demo; stop it with `moe-operator dev-cluster down`")


def _demo(args, k, op, kubeconfig: str, t0: float, cluster, hub) -> int:
    samples = sorted((ROOT / "deploy" / "samples" / "demo").glob("*.yaml"))
    names = []
    for f in samples:
        k("apply", "-n", NAMESPACE, "-f", str(f))
        names.append(json.loads(k("create", "--dry-run=client", "-f", str(f), "-o", "json").stdout)["metadata"]["name"])
    say(f"applied {len(names)} samples; waiting for the operator to plan them")
    objs = _wait_planned(k, names, op)
    time.sleep(4)  # let kwok start the pods and the operator see them ready
    objs = {n: json.loads(k("get", "moed", n, "-n", NAMESPACE, "-o", "json").stdout) for n in names}
    pods = json.loads(k("get", "pods", "-n", NAMESPACE, "-o", "json").stdout)["items"]
    print()
    print(_table(objs, pods))
    print()
    if hub is not None and _model_cache(k, op, hub) != 0:
        return 1
    if args.skip_runtime:
        return 0
    return _runtime(k, op, kubeconfig)


def _wait_planned(k, names: list[str], op, timeout: float = 90) -> dict:
    deadline = time.monotonic() + timeout
    last_report = 0.0
    while True:
        objs = {n: json.loads(k("get", "moed", n, "-n", NAMESPACE, "-o", "json").stdout) for n in names}
        done = [n for n, o in objs.items()
                if any(c["type"] == "Planned" and c["status"] in ("True", "False")
                       for c in (o.get("status") or {}).get("conditions", []))]
        if len(done) == len(names):
            return objs
        if time.monotonic() > deadline:
            say(f"timed out; planned {len(done)}/{len(names)}")
            return objs
        if op.poll() is not None:
            raise SystemExit("[demo] the operator exited; see its log")
        if time.monotonic() - last_report > 5:
            say(f"planned {len(done)}/{len(names)} ...")
            last_report = time.monotonic()
        time.sleep(1)


def _table(objs: dict, pods: list) -> str:
    where: dict[str, set] = {}
    for p in pods:
        dep = p["metadata"].get("labels", {}).get("moe.serving.dev/deployment")
        if dep and p["spec"].get("nodeName"):
            where.setdefault(dep, set()).add(f"{p['spec']['nodeName']}({p['status'].get('phase', '?')})")
    rows = [("NAME", "GPU CLASS", "ENGINE", "BACKEND", "DEFERRED", "PODS ON", "WHY")]
    for n, o in objs.items():
        st = o.get("status") or {}
        plan = st.get("plan") or {}
        planned = next((c for c in st.get("conditions", []) if c["type"] == "Planned"), {})
        why = next((d["reason"] for d in plan.get("decisions", []) if d["key"] == "moe.runnerBackend"), None)
        if planned.get("status") != "True":
            why = planned.get("message", "not planned")
        degraded = next((c for c in st.get("conditions", []) if c["type"] == "Degraded" and c["status"] == "True"), None)
        lws = (st.get("workload") or {}).get("kind") == "LeaderWorkerSet"
        pods_on = ", ".join(sorted(where.get(n, ()))) or (degraded["reason"] if degraded else
                                                          "LWS applied (no LWS controller here)" if lws else "-")
        rows.append((n, st.get("gpuClass", "-"), (plan.get("engine") or {}).get("name", "-"),
                     st.get("runnerBackend", "-"), str(st.get("deferredFinalize", "-")).lower(), pods_on, why or "-"))
    widths = [max(len(r[i]) for r in rows) for i in range(6)]
    lines = []
    for r in rows:
        lines.append("  ".join(r[i].ljust(widths[i]) for i in range(6)) + "  " + r[6])
    return "\n".join(lines)


def demo_cache() -> Path:
    return Path(os.environ.get("MOE_CACHE_DIR", Path.home() / ".cache" / "moe-operator")) / "demo"


def _tool(name: str) -> str:
    return shutil.which(name) or str(Path(sys.executable).parent / name)


def _tiny_checkpoint() -> Path:
    ckpt = demo_cache() / "tiny-deepseek-v3-nvfp4"
    if not (ckpt / "config.json").is_file():
        say(f"generating a tiny DeepSeek-V3-shaped NVFP4 checkpoint in {ckpt}")
        subprocess.run([_tool("moe-runtime"), "make-checkpoint", "--arch", "deepseek_v3", "--format", "nvfp4",
                        "--size", "tiny", str(ckpt)], check=True)
    return ckpt


def _start_hub():
    """The local HTTP server speaking the hub's file API (tests/hub_server.py, in the checkout)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("moe_demo_hub_server", ROOT / "tests" / "hub_server.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # its dataclasses look their module up there
    spec.loader.exec_module(mod)
    hub = mod.Hub()
    hub.start()
    return hub


CACHE_CLASS = "moe-demo-cache"  # a class name only: the demo binds the claim to a hostPath PV it makes
CACHE_REPO = "demo/tiny-deepseek-v3-nvfp4"


def _model_cache(k, op, hub) -> int:
    from . import model_cache
    from .download_cli import READY_MARKER

    ckpt = _tiny_checkpoint()
    files = {p.relative_to(ckpt).as_posix(): p.read_bytes() for p in sorted(ckpt.rglob("*")) if p.is_file()}
    files["README.md"] = f"demo upload {time.time()}\n".encode()  # a new commit each run (README.md is not fetched)
    sha = hub.upload(CACHE_REPO, files)
    claim = model_cache.claim_name(CACHE_REPO, sha)
    pv_dir = demo_cache() / "model-cache" / claim
    pv_dir.mkdir(parents=True, exist_ok=True)
    say(f"model cache: the local hub server serves hf://{CACHE_REPO} (main = {sha[:12]}, {len(files)} files); "
        f"a hostPath PV ({pv_dir}) waits for its cache claim")
    k("delete", "moed", "demo-cached", "-n", NAMESPACE, "--ignore-not-found")  # a fresh object resolves main again
    k("delete", "pv", "-l", "moe.serving.dev/demo-cache=true", "--wait=false", check=False)  # earlier runs' PVs
    pv = {"apiVersion": "v1", "kind": "PersistentVolume",
          "metadata": {"name": f"{claim}-demo", "labels": {"moe.serving.dev/demo-cache": "true"}},
          "spec": {"capacity": {"storage": "1Gi"}, "accessModes": ["ReadWriteMany"], "storageClassName": CACHE_CLASS,
                   "persistentVolumeReclaimPolicy": "Retain", "hostPath": {"path": str(pv_dir)},
                   "claimRef": {"namespace": NAMESPACE, "name": claim}}}
    k("apply", "-f", "-", input=json.dumps(pv))
    doc = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
           "metadata": {"name": "demo-cached", "namespace": NAMESPACE},
           "spec": {"model": {"uri": f"hf://{CACHE_REPO}",
                              "cache": {"enabled": True, "storageClassName": CACHE_CLASS, "size": "1Gi"}},
                    "gpu": {"allowedArchitectures": ["sm90"]}}}
    k("apply", "-f", "-", input=json.dumps(doc))
    job = None
    deadline = time.monotonic() + 60
    while job is None and time.monotonic() < deadline:
        r = k("get", "job", f"{claim}-fill", "-n", NAMESPACE, "-o", "json", check=False)
        job = json.loads(r.stdout) if r.returncode == 0 else None
        if op.poll() is not None:
            raise SystemExit("[demo] the operator exited; see its log")
        time.sleep(0.5)
    if job is None:
        say(f"the operator created no download Job for demo-cached (expected {claim}-fill)")
        return 1
    st = json.loads(k("get", "moed", "demo-cached", "-n", NAMESPACE, "-o", "json").stdout).get("status") or {}
    say(f"the operator pinned hf://{CACHE_REPO} to {st.get('revision')}, created PVC {claim} and Job {claim}-fill")
    say("kwok runs no containers: the Job's container runs here exactly as rendered, its cache volume on the "
        "PV's directory (progress every 0.5 s instead of 5 s):")
    container = job["spec"]["template"]["spec"]["containers"][0]
    tmp = Path(tempfile.mkdtemp(prefix="moe-demo-job-"))
    argv, env = model_cache.local_invocation(container, {"model-cache": str(pv_dir), "tmp": str(tmp)},
                                             executables={"moe-operator": _tool("moe-operator")})
    argv = [str(tmp / "termination-log") if a == "/dev/termination-log" else a for a in argv] + ["--interval", "0.5"]
    print("   $ " + " ".join(container["command"]))
    hub.throttle = 200_000  # bytes/s: a few seconds for the ~440 KiB, so the progress shows
    base = {k_: v for k_, v in os.environ.items() if not k_.startswith("HF_")}
    proc = subprocess.Popen(argv, env={**base, **env}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    last: dict = {}
    shown: dict = {}
    for line in proc.stdout:
        try:
            last = json.loads(line)
        except json.JSONDecodeError:
            print("   " + line.rstrip())
            continue
        if "bytesTotal" in last and "ready" not in last and "error" not in last and last != shown:
            shown = last
            done, total = last.get("bytesDone") or 0, last["bytesTotal"]
            print(f"   {done / 1024:7.1f} / {total / 1024:.1f} KiB  ({100 * done / max(total, 1):3.0f}%)", flush=True)
    proc.wait()
    hub.throttle = None
    shutil.rmtree(tmp, ignore_errors=True)
    if proc.returncode != 0:
        say(f"the download failed: {last.get('error')}")
        return 1
    marker = json.loads((pv_dir / READY_MARKER).read_text())
    say(f"filled: {marker['files']} files, {marker['bytesTotal']} bytes, each checked against the hub's sha256 / git "
        f"blob id; ready marker for {marker['revision'][:12]} written (the pods' init check greps it)")
    ready = None
    deadline = time.monotonic() + 30
    while ready is None and time.monotonic() < deadline:
        o = json.loads(k("get", "moed", "demo-cached", "-n", NAMESPACE, "-o", "json").stdout)
        ready = next((c for c in (o.get("status") or {}).get("conditions", [])
                      if c["type"] == "ModelCacheReady" and c["status"] == "True"), None)
        time.sleep(0.5)
    print("   " + "\n   ".join(k("get", "moed", "demo-cached", "-n", NAMESPACE, "-o", "wide").stdout.strip().splitlines()))
    if ready is None:
        say("ModelCacheReady did not become True within 30 s")
        return 1
    say(f"ModelCacheReady: {ready['message']} (here from the Job kwok marked complete; the bytes are the run above)")
    return 0


def _runtime(k, op, kubeconfig: str) -> int:
    cache = demo_cache()
    ckpt = _tiny_checkpoint()
    runtime = _tool("moe-runtime")
    doc = {"apiVersion": "moe.serving.dev/v1alpha1", "kind": "MoEDeployment",
           "metadata": {"name": "demo-tiny", "namespace": NAMESPACE},
           "spec": {"model": {"uri": f"file://{ckpt}"}, "gpu": {"allowedArchitectures": ["sm90"]}}}
    k("apply", "-f", "-", input=json.dumps(doc))
    _wait_planned(k, ["demo-tiny"], op)
    dep = None
    for _ in range(30):
        r = k("get", "deployment", "demo-tiny", "-n", NAMESPACE, "-o", "json", check=False)
        if r.returncode == 0:
            dep = json.loads(r.stdout)
            break
        time.sleep(1)
    if dep is None:
        say("the operator rendered no Deployment for demo-tiny")
        return 1
    c = dep["spec"]["template"]["spec"]["containers"][0]
    plan_json = json.loads(k("get", "configmap", "demo-tiny-plan", "-n", NAMESPACE, "-o", "json").stdout)["data"]["plan.json"]
    plan_file = cache / "demo-tiny-plan.json"
    plan_file.write_text(plan_json)
    env = {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}
    args = list(c["args"])
    args[args.index("--plan") + 1] = str(plan_file)
    port = _free_port()
    args[args.index("--port") + 1] = str(port)
    args[args.index("--host") + 1] = "127.0.0.1"
    say(f"the operator rendered: {' '.join(c['command'] + c['args'])}")
    say(f"with env {env}")
    say("1) running it here exactly as rendered: the runtime must refuse a plan made for another GPU")
    r = subprocess.run([runtime, "serve", *args], env={**os.environ, **env},
                       capture_output=True, text=True, timeout=300)
    print("   " + (r.stderr.strip().splitlines() or ["(no output)"])[-1])
    say(f"   exit status {r.returncode} (non-zero: it failed fast, before loading weights)")
    say("2) the same env and args without the GPU-bound plan: the runtime resolves the backend for this CPU")
    args_cpu = [a for i, a in enumerate(args) if a != "--plan" and (i == 0 or args[i - 1] != "--plan")]
    env_cpu = {**env, "MOE_RUNNER_BACKEND": "auto"}
    srv = subprocess.Popen([runtime, "serve", *args_cpu, "--device", "cpu"], env={**os.environ, **env_cpu},
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if srv.poll() is not None:
                print(srv.stdout.read())
                say("the runtime exited")
                return 1
            try:
                with urllib.request.urlopen(base + "/ready", timeout=2) as resp:
                    if resp.status == 200:
                        break
            except OSError:
                time.sleep(1)
        with urllib.request.urlopen(base + "/v1/models", timeout=5) as resp:
            model_id = json.loads(resp.read())["data"][0]["id"]
        say(f"runtime ready ({base}, model {model_id!r})")
        body = json.dumps({"model": model_id, "prompt": "The mixture of experts", "max_tokens": 16,
                           "temperature": 0}).encode()
        req = urllib.request.Request(base + "/v1/completions", data=body, headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as resp:
            out = json.loads(resp.read())
        say(f"POST /v1/completions -> {json.dumps(out['choices'][0]['text'])} "
            f"({out.get('usage', {}).get('completion_tokens')} tokens; random weights, so the text is noise)")
        with urllib.request.urlopen(base + "/metrics", timeout=5) as resp:
            metrics = [ln for ln in resp.read().decode().splitlines() if ln.startswith("moe_runtime_") and "backend" in ln]
        for ln in metrics[:4]:
            print("   " + ln)
        return 0
    finally:
        _stop(srv, 30)


def _stop(proc: subprocess.Popen, grace: float) -> None:
    """SIGTERM (the runtime drains, the operator finishes its handlers), then SIGKILL after `grace`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
