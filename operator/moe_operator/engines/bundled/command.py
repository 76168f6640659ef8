"""The bundled runtime's command line: `moe-runtime serve` with the plan file, the operator's and the plan's
flags; a multi-node replica adds the rendezvous port."""

from __future__ import annotations

from ..command import Launch

MAX_LEN_FLAG = "--max-model-len"


def command(x: Launch) -> tuple[list[str], list[str]]:
    args = ["--model", x.model, "--plan", x.plan_file, "--host", "0.0.0.0", "--port", str(x.port), *x.extra,
            *x.plan_args]
    if x.nodes > 1:
        # one process per local GPU on every pod of the group; the rendezvous (TCPStore on the leader's
        # global rank 0 at LWS_LEADER_ADDRESS:DIST_PORT) comes from the LWS env (render.bundled_lws_env)
        args += ["--dist-port", str(x.dist_port)]
    return ["moe-runtime", "serve"], args
