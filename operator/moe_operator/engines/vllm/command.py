"""vLLM's command line: `vllm serve` with the operator's and the plan's flags (workers of a multi-node
replica run headless)."""

from __future__ import annotations

from ..command import Launch

MAX_LEN_FLAG = "--max-model-len"


def command(x: Launch) -> tuple[list[str], list[str]]:
    args = [x.model, "--host", "0.0.0.0", "--port", str(x.port), *x.extra, *x.plan_args]
    if x.nodes > 1:
        args += ["--nnodes", str(x.nodes), "--node-rank", x.rank, "--master-addr", "$(LWS_LEADER_ADDRESS)"]
        if x.role == "worker":
            args.append("--headless")
    return ["vllm", "serve"], args
