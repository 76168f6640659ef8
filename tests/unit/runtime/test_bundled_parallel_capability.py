"""The planner and the runtime capability table agree on the bundled runtime's parallel layouts (issue 19):
tp/ep up to BUNDLED.max_gpus_per_node on one node, one of them dividing the other, all-reduce combine
(moe.a2aBackend none); the plan carries --tp/--ep for `moe-runtime serve`, with a reason."""

from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import from_name
from moe_core.runtime import BUNDLED, parallelism_problems
from moe_operator.planner import Choices, plan


def _ckpt():
    return CheckpointInfo(architecture="DeepseekV3ForCausalLM", modelType="deepseek_v3", format="nvfp4",
                          formatSource="test", numExperts=256, numSharedExperts=1)


def test_capability_table_accepts_one_node_tp_ep():
    assert BUNDLED.max_tp >= 8 and BUNDLED.max_ep >= 8 and BUNDLED.max_gpus_per_node == 8
    assert parallelism_problems(tp=8, ep=8) == [] and parallelism_problems(tp=8, ep=2) == []
    assert parallelism_problems(tp=1, ep=4) == []
    assert any(p.startswith("[B6]") and "divide" in p for p in parallelism_problems(tp=6, ep=4))
    # 16 ranks on one node: more than one node's GPUs (multi-node: test_render_bundled_multinode)
    assert any(p.startswith("[B6]") and "at most 8 per node" in p for p in parallelism_problems(tp=16, nodes=1))
    assert any(p.startswith("[B5]") for p in parallelism_problems(tp=8, ep=8, a2a="deepep"))


def test_bundled_plan_carries_tp_ep_args_with_a_reason():
    p = plan(_ckpt(), from_name("H200"), Choices(tp=8, ep=8), engine="bundled")
    assert p.errors == []
    assert p.args[p.args.index("--tp"):p.args.index("--tp") + 4] == ["--tp", "8", "--ep", "8"]
    d = [d for d in p.decisions if d.key == "parallel"]
    assert d and d[0].rule == "B6" and "8 processes" in d[0].reason
    one = plan(_ckpt(), from_name("H200"), Choices(), engine="bundled")
    assert "--tp" not in one.args  # one GPU: the runtime as before


def test_bundled_plan_refuses_a_layout_the_runtime_cannot_run():
    p = plan(_ckpt(), from_name("H200"), Choices(tp=16, ep=1), engine="bundled")  # 16 GPUs on one node
    assert any(e.startswith("[B6]") for e in p.errors) and "--tp" not in p.args
