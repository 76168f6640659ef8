"""sglang's command line: `python3 -m sglang.launch_server` with the operator's and the plan's flags."""

from __future__ import annotations

from ..command import Launch

MAX_LEN_FLAG = "--context-length"


def command(x: Launch) -> tuple[list[str], list[str]]:
    args = ["--model-path", x.model, "--host", "0.0.0.0", "--port", str(x.port), *x.extra, *x.plan_args]
    if x.nodes > 1:
        args += ["--nnodes", str(x.nodes), "--node-rank", x.rank, "--dist-init-addr", "$(LWS_LEADER_ADDRESS):20000"]
    return ["python3", "-m", "sglang.launch_server"], args
