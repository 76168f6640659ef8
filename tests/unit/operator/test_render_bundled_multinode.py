"""A bundled multi-node replica (issue 19): the capability table and the planner's bundled rules allow
tp x ep over the nodes of a LeaderWorkerSet group, the plan records the layout with a reason, and the
operator renders leader + worker pods running `moe-runtime serve` with the rendezvous env wired."""

from moe_core.bundled import parallel_args
from moe_core.checkpoint import inspect_dir
from moe_core.runtime import BUNDLED, parallelism_problems
from moe_operator.api import MoEDeploymentSpec
from moe_operator.inventory import build, node_info
from moe_operator.placement import place
from moe_operator.render import DIST_PORT, Owner, render
from moe_operator.sample_checkpoints import write_sample



def node(name, product, major, minor, gpus=8):
    return {"metadata": {"name": name, "labels": {
        "nvidia.com/gpu.product": product, "nvidia.com/gpu.compute.major": str(major),
        "nvidia.com/gpu.compute.minor": str(minor), "nvidia.com/gpu.count": str(gpus), "kubernetes.io/arch": "amd64"}},
        "status": {"allocatable": {"nvidia.com/gpu": str(gpus)}, "capacity": {"nvidia.com/gpu": str(gpus)},
                   "conditions": [{"type": "Ready", "status": "True"}]}}


def _h200_nodes(n=2):
    return build([node_info(node(f"h200-{i}", "NVIDIA-H200", 9, 0)) for i in range(n)], {})


def _spec(**kw):
    base = {"model": {"uri": "file:///models/x"}, "parallelism": {"tp": 16, "ep": 16}, "gpusPerReplica": 16,
            "nodesPerReplica": 2}
    base.update(kw)
    return MoEDeploymentSpec.model_validate(base)


def test_capability_table_allows_bundled_replicas_over_nodes():
    assert BUNDLED.max_nodes >= 2 and BUNDLED.max_gpus_per_node == 8 and BUNDLED.max_tp >= 16
    assert parallelism_problems(tp=16, ep=16, nodes=2) == [] and parallelism_problems(tp=16, ep=8, nodes=2) == []
    assert any("at most 8 per node" in p for p in parallelism_problems(tp=16, ep=16, nodes=1))
    assert any("the same number on each" in p for p in parallelism_problems(tp=8, ep=8, nodes=3))
    assert any(p.startswith("[B6]") for p in parallelism_problems(tp=8 * (BUNDLED.max_nodes + 1),
                                                                   nodes=BUNDLED.max_nodes + 1))


def test_parallel_args_keep_attention_inside_a_node_when_experts_span_the_replica():
    args, why = parallel_args(16, 16, 2)
    assert args == ["--tp", "8", "--ep", "16"] and "2 nodes x 8 GPUs" in why and "NVLink" in why
    args, why = parallel_args(16, 8, 2)  # ep < tp: attention over all 16 ranks, said so
    assert args == ["--tp", "16", "--ep", "8"] and "crosses nodes" in why
    assert parallel_args(8, 8, 1)[0] == ["--tp", "8", "--ep", "8"]


def test_bundled_two_node_replica_renders_a_leaderworkerset_with_the_rendezvous_env(tmp_path):
    ck = inspect_dir(write_sample("deepseek-v3-fp8", tmp_path / "c"))
    s = _spec()
    pl = place(s, ck, _h200_nodes())
    assert pl.ok, pl.explain()
    p = pl.plan
    assert p.layout.nodes == 2 and p.layout.gpusPerNode == 8 and p.layout.tp == 16
    d = [d for d in p.decisions if d.key == "parallel"]
    assert d and d[0].rule == "B6" and d[0].value == "tp=16 ep=16 nodes=2" and "LeaderWorkerSet" in d[0].reason
    assert p.args[p.args.index("--tp"):p.args.index("--tp") + 4] == ["--tp", "8", "--ep", "16"]
    objs = render(Owner("m", "ns", "u"), pl.spec or s, p, pl.inventory.gpu_class)
    lws = objs[[o["kind"] for o in objs].index("LeaderWorkerSet")]
    assert lws["spec"]["leaderWorkerTemplate"]["size"] == 2
    assert lws["spec"]["startupPolicy"] == "LeaderCreated"  # the leader is ready only once the workers joined
    assert lws["spec"]["leaderWorkerTemplate"]["restartPolicy"] == "RecreateGroupOnPodRestart"
    tpl = lws["spec"]["leaderWorkerTemplate"]
    leader, worker = (tpl[k]["spec"]["containers"][0] for k in ("leaderTemplate", "workerTemplate"))
    for c in (leader, worker):
        assert c["command"] == ["moe-runtime", "serve"]
        assert c["args"][c["args"].index("--dist-port") + 1] == str(DIST_PORT)
        assert c["args"][c["args"].index("--tp") + 1] == "8" and c["args"][c["args"].index("--ep") + 1] == "16"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == "8"  # one process per local GPU
        env = {e["name"]: e for e in c["env"]}
        assert env["LWS_WORKER_INDEX"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.labels['leaderworkerset.sigs.k8s.io/worker-index']"
        assert env["LWS_GROUP_SIZE"]["valueFrom"]["fieldRef"]["fieldPath"] == \
            "metadata.annotations['leaderworkerset.sigs.k8s.io/size']"
    assert leader["args"] == worker["args"]  # the rank comes from the env, the pod specs differ only by role
    # the leader serves HTTP and is ready only when every rank is up; workers have no HTTP server or probes
    assert leader["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "readinessProbe" not in worker and "livenessProbe" not in worker
    assert {"name": "dist", "containerPort": DIST_PORT} in leader["ports"]
    assert objs[1]["spec"]["selector"]["leaderworkerset.sigs.k8s.io/worker-index"] == "0"


def test_crd_cel_rule_bounds_bundled_nodes_by_the_table():
    import json

    from moe_operator.crd import crd

    text = json.dumps(crd())
    assert f"self.nodesPerReplica <= {BUNDLED.max_nodes} || self.engine.name != 'bundled'" in text
    assert "the bundled engine serves one node per replica" not in text


def test_plan_cli_sizing_over_two_nodes_plans_the_bundled_flags_for_them(tmp_path):
    """`moe-operator plan --engine bundled --nodes 2`: sizing spans 2 nodes (380.8 GiB on L40S) and the
    planner's bundled rules get the node count (else they would refuse 16 ranks on one node)."""
    from moe_core.gpu import from_name
    from moe_operator.placement import sized_for_cli
    from moe_operator.planner import Choices, plan
    from moe_operator.sample_checkpoints import write_full_size

    ck = inspect_dir(write_full_size("deepseek-v3-nvfp4", tmp_path / "c"))
    gpu = from_name("L40S")
    kw: dict = {}
    tp, record = sized_for_cli(ck, gpu, "bundled", kw, 8, 2, None, None)
    assert tp == 16 and kw["nodes"] == 2
    kw["tp"] = tp
    p = plan(ck, gpu, Choices(**kw), engine="bundled")
    record(p)
    assert p.errors == [] and p.layout.nodes == 2 and p.args[-4:] == ["--tp", "16", "--ep", "1"]
    assert [d.value for d in p.decisions if d.key == "parallel"] == ["tp=16 ep=1 nodes=2"]
