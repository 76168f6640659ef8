"""The flags the operator owns on vLLM's command line (aliases from vLLM 0.33.0 vllm/engine/arg_utils.py
EngineArgs.add_cli_args) and the spec field that sets each."""

from __future__ import annotations

from ..owned import MODEL, SERVER, SERVED, TP, EP, DP, NODES, PP, CONFIG

OWNED: dict[str, str] = {
    "--model": MODEL, "--revision": "spec.model.uri (hf://org/name@revision)",
    "--host": SERVER, "--port": SERVER, "--served-model-name": SERVED,
    "--max-model-len": "spec.engine.maxModelLen",
    "--tensor-parallel-size": TP, "-tp": TP,
    "--data-parallel-size": DP, "-dp": DP, "--data-parallel-size-local": DP, "-dpl": DP,
    "--data-parallel-rank": DP, "-dpn": DP, "--data-parallel-start-rank": DP, "-dpr": DP,
    "--data-parallel-address": NODES, "-dpa": NODES, "--data-parallel-rpc-port": NODES, "-dpp": NODES,
    "--enable-expert-parallel": EP, "-ep": EP, "--pipeline-parallel-size": PP, "-pp": PP,
    "--prefill-context-parallel-size": PP, "-pcp": PP,
    "--moe-backend": "spec.moe.runnerBackend", "--all2all-backend": "spec.moe.a2aBackend",
    "--quantization": "spec.model.format", "-q": "spec.model.format",
    "--nnodes": NODES, "-n": NODES, "--node-rank": NODES, "-r": NODES, "--master-addr": NODES,
    "--master-port": NODES, "--headless": NODES,
    "--config": CONFIG,
}
