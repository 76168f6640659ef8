"""The flags the operator owns on sglang's command line (aliases from sglang 0.5.23
sglang/srt/arg_groups/fields/{model,parallel}.py `aliases=`) and the spec field that sets each."""

from __future__ import annotations

from ..owned import MODEL, SERVER, SERVED, TP, EP, DP, NODES, PLANNER, PP, CONFIG

OWNED: dict[str, str] = {
    "--model-path": MODEL, "--model": MODEL, "--revision": "spec.model.uri (hf://org/name@revision)",
    "--host": SERVER, "--port": SERVER, "--served-model-name": SERVED,
    "--context-length": "spec.engine.maxModelLen",
    "--tp-size": TP, "--tp": TP, "--tensor-parallel-size": TP,
    "--ep-size": EP, "--ep": EP, "--expert-parallel-size": EP,
    "--dp-size": DP, "--dp": DP, "--data-parallel-size": DP, "--enable-dp-attention": DP,
    "--attn-dp-size": DP, "--attention-data-parallel-size": DP, "--moe-dp-size": DP, "--moe-data-parallel-size": DP,
    "--pp-size": PP, "--pipeline-parallel-size": PP,
    "--moe-runner-backend": "spec.moe.runnerBackend", "--moe-a2a-backend": "spec.moe.a2aBackend",
    "--deepep-mode": "spec.moe.a2aBackend (the planner picks the DeepEP mode)",
    "--attention-backend": PLANNER, "--quantization": "spec.model.format",
    "--nnodes": NODES, "--node-rank": NODES, "--dist-init-addr": NODES, "--nccl-init-addr": NODES,
    "--config": CONFIG,
}
