"""`moe-runtime`: probe | inspect | make-checkpoint | serve.

Exit codes: 0 ok; 1 no GPU (probe); 2 a RuntimeFailure (bad checkpoint, plan mismatch, no usable
backend, bad arguments to make-checkpoint) - printed as one `error: ...` line on stderr.
Heavy imports (torch, fastapi) happen inside the subcommands so `probe`/`inspect` stay fast.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import RuntimeFailure


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="moe-runtime", description="MoE inference runtime")
    sub = p.add_subparsers(dest="cmd", required=True)

    pr = sub.add_parser("probe", help="GPUs of this node as JSON (NVML)")
    pr.add_argument("--annotate-node", metavar="NODE", default=None,
                    help="also write moe.serving.dev/gpu.* annotations on this Node (the node-probe DaemonSet)")

    i = sub.add_parser("inspect", help="checkpoint facts as JSON")
    i.add_argument("path")
    i.add_argument("--termination-log", default=None,
                   help="also write the JSON here (default: /dev/termination-log when writable)")

    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in the HF layout")
    m.add_argument("--arch", required=True, choices=["deepseek_v3", "qwen3_moe"])
    m.add_argument("--format", required=True, choices=["bf16", "fp8", "nvfp4", "mxfp4"])
    m.add_argument("--size", default="tiny", choices=["tiny", "small"])
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", default="cpu", help="where to generate/quantize (cuda is much faster for small)")
    m.add_argument("dir")

    s = sub.add_parser("serve", help="serve an OpenAI-compatible API")
    s.add_argument("--model", required=True, help="checkpoint directory")
    s.add_argument("--plan", default=None, help="plan JSON file rendered by the operator")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="activation dtype (auto: bf16, which runs the planned backend; float32: exact mode "
                        "with the fp32 reference experts)")
    s.add_argument("--max-batch", type=int, default=8, help="sequences decoded together per step")
    s.add_argument("--max-queue", type=int, default=64, help="waiting requests before 429")
    s.add_argument("--max-model-len", type=int, default=None, help="KV cache length per sequence")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--threads", type=int, default=0,
                   help="CPU threads for torch (0: torch's default). Small CPU models decode faster on 1")
    s.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay captured CUDA graphs for decode steps on GPU (default on)")
    s.add_argument("--skip-selftest", action="store_true", help="do not self-test the MoE backend (tests only)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    try:
        if args.cmd == "probe":
            from .probe import annotate_node, node_annotations, probe_nvml

            result = probe_nvml()
            print(json.dumps(result.to_dict(), indent=2))
            if args.annotate_node:
                annotate_node(args.annotate_node, node_annotations(result))
            return 0
        if args.cmd == "inspect":
            from .inspect_cmd import run_inspect

            print(run_inspect(args.path, args.termination_log))
            return 0
        if args.cmd == "make-checkpoint":
            from .checkpoint_writer import make_checkpoint
            from .log import log

            make_checkpoint(args.dir, args.arch, args.format, args.size, seed=args.seed, device=args.device,
                            log=lambda s: log("make_checkpoint", s))
            return 0
        if args.cmd == "serve":
            from .serve import serve

            return serve(args)
    except RuntimeFailure as e:
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    return 2


if __name__ == "__main__":
    sys.exit(main())
