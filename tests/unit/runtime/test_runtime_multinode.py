"""Two "nodes" of a LeaderWorkerSet group on one CPU host (issue 19): two `moe-runtime serve --tp 2 --ep 4`
launchers with the LWS env the LeaderWorkerSet webhook sets (LWS_LEADER_ADDRESS, LWS_GROUP_SIZE=2,
LWS_WORKER_INDEX 0 / 1), each spawning its 2 local ranks (global rank = worker index x 2 + local rank),
gloo over 127.0.0.1: the layout the operator renders for a 2-node replica (moe_core.bundled.parallel_args:
attention tensor-parallel inside a node, experts over all 4 ranks). The leader's /ready stays 503 until
the worker node's ranks joined and loaded; the greedy completions equal one process (fp32 exact mode)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

from moe_runtime.dist.launch import rendezvous
from moe_runtime.checkpoint_writer import make_checkpoint
from test_runtime_parallel import PROMPTS, _free_port, _rank_pids

pytestmark = pytest.mark.timeout(420)


class Node:
    """One pod of the group: `moe-runtime serve` with the LWS env of worker index `index`."""

    def __init__(self, model, index: int, dist_port: int, tmp, *extra, nodes: int = 2):
        self.port = _free_port()
        self.log_path = tmp / f"node{index}-{self.port}.log"
        self.log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if nodes > 1:
            env.update(LWS_LEADER_ADDRESS="127.0.0.1", LWS_GROUP_SIZE=str(nodes), LWS_WORKER_INDEX=str(index))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "moe_runtime.cli", "serve", "--model", str(model), "--port", str(self.port),
             "--host", "127.0.0.1", "--device", "cpu", "--skip-selftest", "--served-model-name", "m",
             "--dtype", "float32", "--threads", "1", "--dist-port", str(dist_port), "--dist-timeout", "60",
             "--dist-init-timeout", "120", *extra],
            stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def get(self, path: str) -> int:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=2) as r:
                return r.status
        except urllib.error.HTTPError as e:
            return e.code
        except OSError:
            return 0

    def wait(self, path: str, status: int, timeout: float = 180):
        t0 = time.time()
        while time.time() - t0 < timeout:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode}:\n{self.logs()}")
            if self.get(path) == status:
                return
            time.sleep(0.3)
        raise AssertionError(f"{path} never {status}:\n{self.logs()}")

    def complete(self, prompt: str, n: int = 12) -> str:
        body = json.dumps({"model": "m", "prompt": prompt, "max_tokens": n, "temperature": 0, "ignore_eos": True})
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}/v1/completions", data=body.encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=120) as r:
            return json.loads(r.read())["choices"][0]["text"]

    def logs(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def stop(self, sig=signal.SIGTERM):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=40)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def test_two_lws_nodes_serve_the_same_greedy_completions_as_one_process(tmp_path):
    path = tmp_path / "ckpt"
    make_checkpoint(path, "deepseek_v3", "bf16", "tiny", seed=1, log=lambda s: None)
    one = Node(path, 0, 0, tmp_path, nodes=1)
    try:
        one.wait("/ready", 200)
        ref = [one.complete(p) for p in PROMPTS]
    finally:
        one.stop()
    dist_port = _free_port()
    leader = Node(path, 0, dist_port, tmp_path, "--tp", "2", "--ep", "4")
    worker = None
    try:
        leader.wait("/health", 200)
        time.sleep(2)
        assert leader.get("/ready") == 503, "ready before the worker node's ranks joined"
        worker = Node(path, 1, dist_port, tmp_path, "--tp", "2", "--ep", "4")
        leader.wait("/ready", 200)
        assert worker.get("/health") == 0  # workers run the model loop, no HTTP server
        got = [leader.complete(p) for p in PROMPTS]
        assert got == ref
        assert sorted(_rank_pids(leader.logs())) == [0, 1] and sorted(_rank_pids(worker.logs())) == [2, 3]
        assert '"event": "group_ready"' in leader.logs() and '"event": "group_ready"' in worker.logs()
    finally:
        leader.stop()
        if worker is not None:
            try:
                worker.proc.wait(timeout=40)  # rank 0's stop reaches the followers: the worker node exits by itself
            except subprocess.TimeoutExpired:
                pass
            worker.stop()
    assert leader.proc.returncode == 0, leader.logs()
    assert worker.proc.returncode == 0, worker.logs()


def test_rendezvous_needs_the_leader_address_on_several_nodes():
    with pytest.raises(Exception, match="no LWS_LEADER_ADDRESS"):
        rendezvous(4, 29500, {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1"})
    r = rendezvous(4, 29500, {"LWS_GROUP_SIZE": "2", "LWS_WORKER_INDEX": "1", "MASTER_ADDR": "10.0.0.1"})
    assert (r.addr, r.node_index, r.local_world) == ("10.0.0.1", 1, 2)
    with pytest.raises(Exception, match="must be integers"):
        rendezvous(4, 29500, {"LWS_GROUP_SIZE": "two"})
