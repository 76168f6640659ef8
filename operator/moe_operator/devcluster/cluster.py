"""DevCluster: bring the local control plane up, register simulated GPU nodes, tear it down.

    from moe_operator.devcluster import DevCluster
    dc = DevCluster()                      # state in ${MOE_CACHE_DIR:-~/.cache/moe-operator}/dev-cluster
    kubeconfig = dc.up({"h200": 2, "b200": 1})
    dc.kubectl("get", "nodes")
    dc.add_pool("gb200", 4)
    dc.down()

Everything the cluster is made of lives in the state dir: key material, etcd data, component
logs, kubeconfigs, and `state.json` (ports, PIDs and command lines of the processes started), which
is what lets `status`/`down` in another process find and stop exactly those processes.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import shutil
import ssl
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from . import components, kubeconfig as kcfg, pki as pkimod, pools as poolmod, procs
from .api import Api, ApiError, probe
from .binaries import Binaries, ensure_binaries
from .components import Layout, Ports
from .log import log

ENV_CACHE_DIR = "MOE_CACHE_DIR"
START_ATTEMPTS = 3  # a port picked free can be taken before the component binds it


def cache_dir() -> Path:
    return Path(os.environ.get(ENV_CACHE_DIR) or Path.home() / ".cache" / "moe-operator")


def default_state_dir() -> Path:
    return cache_dir() / "dev-cluster"


class StartError(RuntimeError):
    pass


class _PortInUse(StartError):
    pass


class DevCluster:
    def __init__(self, state_dir: str | Path | None = None, kubeconfig: str | Path | None = None,
                 die_with_parent: bool = False):
        """`kubeconfig` attaches to an already running cluster (e.g. one started by another
        process); the state dir then defaults to the kubeconfig's directory.
        `die_with_parent`: the processes `up` starts get SIGKILL when this Python process dies
        (test sessions: nothing outlives a killed pytest). Must then be called from the main
        thread, since Linux ties this to the thread that started them."""
        self.die_with_parent = die_with_parent
        if state_dir is None and kubeconfig is not None:
            state_dir = Path(kubeconfig).resolve().parent
        self.layout = Layout(Path(state_dir or default_state_dir()).resolve())
        self._kubeconfig = Path(kubeconfig).resolve() if kubeconfig else None
        self._binaries: Binaries | None = None

    # ------------------------------------------------------------------ properties
    @property
    def state_dir(self) -> Path:
        return self.layout.root

    @property
    def kubeconfig(self) -> Path:
        return self._kubeconfig or self.layout.kubeconfig

    @property
    def binaries(self) -> Binaries:
        """kubectl, helm, ... of the pinned versions (builds them if the cache is cold)."""
        if self._binaries is None:
            st = self._load_state()
            if st and Binaries(Path(st["bin_dir"])).missing() == []:
                self._binaries = Binaries(Path(st["bin_dir"]))
            else:
                self._binaries = ensure_binaries()
        return self._binaries

    def api(self) -> Api:
        server, token, ca_b64 = kcfg.read_server_and_token(self.kubeconfig)
        return Api(server, token, base64.b64decode(ca_b64).decode() if ca_b64 else None)

    # ------------------------------------------------------------------ lifecycle
    def up(self, pools: dict[str, int] | None = None, build: bool = True, timeout: float = 180.0) -> Path:
        """Start the cluster (or reuse a healthy running one) and make sure `pools` exist
        (None: every pool at its default size on a fresh cluster, unchanged on a reused one).
        Returns the admin kubeconfig path."""
        t0 = time.monotonic()
        self._binaries = ensure_binaries(build=build)
        with self._locked():
            return self._up_locked(pools, timeout, t0)

    def _up_locked(self, pools: dict[str, int] | None, timeout: float, t0: float) -> Path:
        assert self._binaries is not None
        st = self._load_state()
        if st:
            if st.get("bin_dir") != str(self._binaries.dir):
                reason = "the recorded cluster runs other binaries (versions changed)"
            elif self._healthy(st):
                log(f"reusing running cluster ({self.kubeconfig})")
                if pools:
                    self.ensure_pools(pools)
                return self.kubeconfig
            else:
                reason = "the recorded cluster is stale or unhealthy"
            log(f"{reason}; stopping what is left of it")
            self._down_locked(quiet=False)
        for attempt in range(1, START_ATTEMPTS + 1):
            try:
                self._start(self._binaries, timeout)
                break
            except _PortInUse as e:
                log(f"{e}; retrying with new ports (attempt {attempt}/{START_ATTEMPTS})")
                self._down_locked(quiet=True)
                if attempt == START_ATTEMPTS:
                    raise
            except BaseException:
                self._down_locked(quiet=True)
                raise
        self.ensure_pools(pools if pools is not None else poolmod.parse_pools(None))
        log(f"cluster up in {time.monotonic() - t0:.1f}s; export KUBECONFIG={self.kubeconfig}")
        return self.kubeconfig

    def down(self, quiet: bool = False) -> list[str]:
        """Stop the processes recorded in the state file (only those, by PID, after checking
        their command line) and forget the cluster. Returns the names of processes stopped."""
        with self._locked():
            return self._down_locked(quiet)

    def _down_locked(self, quiet: bool) -> list[str]:
        st = self._load_state()
        if not st:
            if not quiet:
                log("no cluster recorded in " + str(self.state_dir))
            return []
        stopped = []
        for raw in reversed(st.get("procs", [])):
            p = procs.Proc(**raw)
            if procs.stop(p):
                stopped.append(p.name)
                if not quiet:
                    log(f"stopped {p.name} (pid {p.pid})")
        self.layout.state_file.unlink(missing_ok=True)
        # The data dies with the cluster: the next `up` starts from an empty etcd.
        shutil.rmtree(self.layout.etcd_data, ignore_errors=True)
        if not quiet:
            log(f"cluster down ({len(stopped)} processes stopped)")
        return stopped

    def pids(self) -> dict[str, int]:
        st = self._load_state() or {}
        return {p["name"]: p["pid"] for p in st.get("procs", [])}

    def status(self) -> dict[str, Any]:
        st = self._load_state()
        if not st:
            return {"running": False, "state_dir": str(self.state_dir)}
        out: dict[str, Any] = {"state_dir": str(self.state_dir), "kubeconfig": str(self.kubeconfig),
                               "server": st["server"], "components": {}}
        for raw in st["procs"]:
            p = procs.Proc(**raw)
            out["components"][p.name] = {"pid": p.pid, "alive": procs.is_ours(p), "log": p.log}
        out["ready"] = self._apiserver_ready(st)
        out["running"] = out["ready"] and all(c["alive"] for c in out["components"].values())
        if out["ready"]:
            out["nodes"] = self.node_counts()
        return out

    # ------------------------------------------------------------------ nodes
    def node_counts(self) -> dict[str, dict[str, int]]:
        """pool -> {"total": n, "ready": m} for the simulated nodes."""
        nodes = self.api().get(f"/api/v1/nodes?labelSelector={poolmod.POOL_LABEL}")["items"]
        counts: dict[str, dict[str, int]] = {}
        for n in nodes:
            c = counts.setdefault(n["metadata"]["labels"][poolmod.POOL_LABEL], {"total": 0, "ready": 0})
            c["total"] += 1
            c["ready"] += _node_ready(n)
        return counts

    def ensure_pools(self, pools: dict[str, int], timeout: float | None = None) -> list[str]:
        """Grow each pool to at least its count (existing nodes are kept); wait until Ready."""
        api = self.api()
        existing = {n["metadata"]["name"] for n in
                    api.get(f"/api/v1/nodes?labelSelector={poolmod.POOL_LABEL}")["items"]}
        manifests = [m for m in poolmod.pool_manifests(pools) if m["metadata"]["name"] not in existing]
        if manifests:
            self._create_nodes(api, manifests)
        names = [poolmod.node_name(p, i) for p, n in pools.items() for i in range(n)]
        self._wait_nodes_ready(api, names, timeout or 60.0 + len(names) * 0.2)
        return names

    def add_pool(self, name: str, count: int = poolmod.DEFAULT_POOL_SIZE) -> list[str]:
        """Make pool `name` have `count` nodes (creating only the missing ones); returns the
        pool's node names once all are Ready. Tests use it to make the operator re-plan."""
        return self.ensure_pools({name: count})

    def remove_pool(self, name: str) -> None:
        if name not in poolmod.GPU_CLASSES:
            raise ValueError(f"unknown pool {name!r}")
        self.api().delete(f"/api/v1/nodes?labelSelector={poolmod.POOL_LABEL}%3D{name}")
        log(f"deleted the nodes of pool {name}")

    # ------------------------------------------------------------------ tools
    def kubectl(self, *args: str, check: bool = True, input: str | None = None,
                timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
        return self._run_tool(self.binaries.kubectl, args, check, input, timeout)

    def helm(self, *args: str, check: bool = True, input: str | None = None,
             timeout: float = 300.0) -> subprocess.CompletedProcess[str]:
        return self._run_tool(self.binaries.helm, args, check, input, timeout)

    def env(self) -> dict[str, str]:
        return {**os.environ, "KUBECONFIG": str(self.kubeconfig)}

    def _run_tool(self, exe: Path, args: tuple[str, ...], check: bool, input: str | None,
                  timeout: float) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(exe), *args], env=self.env(), input=input, capture_output=True,
                              text=True, timeout=timeout)
        if check and proc.returncode != 0:
            raise subprocess.CalledProcessError(proc.returncode, proc.args, proc.stdout, proc.stderr)
        return proc

    # ------------------------------------------------------------------ internals
    @contextlib.contextmanager
    def _locked(self):
        """One `up`/`down` at a time per state dir (two test sessions, or a test and a user)."""
        self.state_dir.mkdir(parents=True, exist_ok=True)
        with open(self.state_dir / ".lock", "w") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    def _load_state(self) -> dict[str, Any] | None:
        try:
            return json.loads(self.layout.state_file.read_text())
        except (FileNotFoundError, ValueError):
            return None

    def _save_state(self, st: dict[str, Any]) -> None:
        tmp = self.layout.state_file.with_suffix(".tmp")
        tmp.write_text(json.dumps(st, indent=2))
        tmp.replace(self.layout.state_file)

    def _apiserver_ready(self, st: dict[str, Any]) -> bool:
        ok, _ = probe(st["server"] + "/readyz", ctx=self._ca_ctx())
        return ok

    def _healthy(self, st: dict[str, Any]) -> bool:
        names = {p["name"] for p in st.get("procs", [])}
        if names != set(components.ORDER) or not self.layout.kubeconfig.is_file():
            return False
        return all(procs.is_ours(procs.Proc(**p)) for p in st["procs"]) and self._apiserver_ready(st)

    def _ca_ctx(self) -> ssl.SSLContext:
        return ssl.create_default_context(cafile=str(self.layout.pki_dir / "ca.crt"))

    def _start(self, b: Binaries, timeout: float) -> None:
        lay = self.layout
        lay.root.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(lay.etcd_data, ignore_errors=True)
        shutil.rmtree(lay.root / "certs", ignore_errors=True)
        pki = pkimod.generate(lay.pki_dir, components.SERVICE_IP)
        tokens = pki.tokens()
        lay.kwok_config.write_text(components.kwok_config(b.kwok_stages.read_text()))
        ports = _distinct_ports()
        server = f"https://127.0.0.1:{ports.apiserver}"
        st: dict[str, Any] = {"version": 1, "bin_dir": str(b.dir), "server": server,
                              "ports": ports.to_json(), "procs": [], "started_at": time.time()}
        # Kubeconfigs first: the components read them at start (the server needs no file).
        kcfg.write(lay.kubeconfig, server, pki.ca_crt, "admin", tokens["admin"])
        kcfg.write(lay.component_kubeconfig("kwok"), server, pki.ca_crt, "admin", tokens["admin"])
        for comp in ("kube-controller-manager", "kube-scheduler"):
            user = f"system:{comp}"
            kcfg.write(lay.component_kubeconfig(comp), server, pki.ca_crt, user, tokens[user])
        log(f"starting control plane in {lay.root} (apiserver {server})")
        for name in components.ORDER:
            for d in (lay.cert_dir(name),):
                d.mkdir(parents=True, exist_ok=True)
            t = time.monotonic()
            proc = procs.start(name, components.ARGV[name](b, lay, ports), lay.log(name),
                               die_with_parent=self.die_with_parent)
            st["procs"].append(proc.to_json())
            self._save_state(st)  # record the PID at once, so `down` can stop a half-started cluster
            self._wait_healthy(name, proc, ports, tokens["admin"], timeout)
            log(f"{name} ready in {time.monotonic() - t:.1f}s (pid {proc.pid}, log {proc.log})")
        self._wait_default_service_account(timeout)

    def _wait_healthy(self, name: str, proc: procs.Proc, ports: Ports, token: str, timeout: float) -> None:
        url = components.health_url(name, ports)
        if name in ("kube-apiserver", "kwok"):  # both serve our CA-signed certificate
            ctx: ssl.SSLContext | None = self._ca_ctx()
        elif url.startswith("https"):
            # controller-manager/scheduler serve with a self-signed cert of their own making.
            ctx = ssl._create_unverified_context()
        else:
            ctx = None
        t0 = last = time.monotonic()
        body = ""
        while time.monotonic() - t0 < timeout:
            if not procs.is_ours(proc):
                tail = procs.log_tail(proc)
                if "address already in use" in tail:
                    raise _PortInUse(f"{name} could not bind its port")
                raise StartError(f"{name} exited (code {procs.exited(proc)}) during startup; "
                                 f"last lines of {proc.log}:\n{tail}")
            ok, body = probe(url + ("?verbose" if name == "kube-apiserver" else ""), ctx=ctx,
                             token=token if name == "kube-apiserver" else None)
            if ok:
                return
            if time.monotonic() - last >= 5:
                last = time.monotonic()
                failing = [ln.strip() for ln in body.splitlines() if ln.startswith("[-]")]
                log(f"waiting for {name} ({time.monotonic() - t0:.0f}s)"
                    + (f": {', '.join(failing)[:200]}" if failing else ""))
            time.sleep(0.25)
        raise StartError(f"{name} not healthy after {timeout:.0f}s ({body.strip()[:300]}); "
                         f"last lines of {proc.log}:\n{procs.log_tail(proc)}")

    def _wait_default_service_account(self, timeout: float) -> None:
        """Pods cannot be created in a namespace until the controller manager has made its
        `default` ServiceAccount; wait for it so callers can apply workloads right away."""
        api, t0 = self.api(), time.monotonic()
        while time.monotonic() - t0 < timeout:
            try:
                api.get("/api/v1/namespaces/default/serviceaccounts/default")
                return
            except ApiError as e:
                if e.status != 404:
                    raise
            time.sleep(0.25)
        raise StartError("the controller manager did not create the default ServiceAccount "
                         f"within {timeout:.0f}s; see {self.layout.log('kube-controller-manager')}")

    def _create_nodes(self, api: Api, manifests: list[dict[str, Any]]) -> None:
        t0 = time.monotonic()

        def create(m: dict[str, Any]) -> None:
            try:
                api.post("/api/v1/nodes", m)
            except ApiError as e:
                if e.status != 409:  # AlreadyExists: another `up` raced us; fine
                    raise

        # Concurrent POSTs: hundreds of nodes register in seconds instead of a minute.
        with ThreadPoolExecutor(max_workers=16) as pool:
            list(pool.map(create, manifests))
        log(f"registered {len(manifests)} nodes in {time.monotonic() - t0:.1f}s")

    def _wait_nodes_ready(self, api: Api, names: list[str], timeout: float) -> None:
        want, t0, last = set(names), time.monotonic(), 0.0
        ready: set[str] = set()
        while time.monotonic() - t0 < timeout:
            nodes = api.get(f"/api/v1/nodes?labelSelector={poolmod.POOL_LABEL}")["items"]
            ready = {n["metadata"]["name"] for n in nodes if _node_ready(n)} & want
            if ready == want:
                log(f"{len(want)} nodes Ready in {time.monotonic() - t0:.1f}s")
                return
            if time.monotonic() - last >= 5:
                last = time.monotonic()
                log(f"waiting for nodes: {len(ready)}/{len(want)} Ready")
            # each look is a LIST of every node (~3 KB each): thousands of them twice a second were
            # a load of their own on the API server the nodes register with
            time.sleep(max(0.5, len(want) / 1000))
        raise StartError(f"only {len(ready)}/{len(want)} nodes Ready after {timeout:.0f}s; "
                         f"see {self.layout.log('kwok')}")


def _node_ready(node: dict[str, Any]) -> bool:
    return any(c.get("type") == "Ready" and c.get("status") == "True"
               for c in node.get("status", {}).get("conditions", []))


def _distinct_ports() -> Ports:
    seen: set[int] = set()
    while len(seen) < 6:
        seen.add(procs.free_port())
    return Ports(*seen)
