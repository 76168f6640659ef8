"""`moe-runtime`: probe | inspect | make-checkpoint | serve.

Exit statuses: 0 ok; 1 bad input (a flag value, a checkpoint, a plan that does not fit this node,
no usable backend; `probe`: no GPU); 2 the plan has errors; 3 usage (unknown flag or subcommand,
a missing or malformed argument). Every failure is one `error: ...` line on stderr, never a
traceback unless `--debug`. Heavy imports (torch, fastapi) happen inside the subcommands so
`probe`/`inspect` stay fast.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

from . import __version__
from .errors import EXIT_BAD_INPUT, EXIT_USAGE, RuntimeFailure

# Measured on a 2-core host with the tiny checkpoint (bench/README.md, "CPU threads of
# moe-runtime serve"): one intra-op thread is faster than torch's default at every concurrency.
DEFAULT_THREADS = 1


class UsageParser(argparse.ArgumentParser):
    """argparse whose usage errors exit 3 (2 is 'the plan has errors')."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message}\n")


def _common() -> argparse.ArgumentParser:
    c = argparse.ArgumentParser(add_help=False)
    c.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                   help="print the traceback of an unexpected failure")
    return c


def _parser() -> argparse.ArgumentParser:
    p = UsageParser(prog="moe-runtime", description="MoE inference runtime",
                    epilog="exit status: 0 ok, 1 bad input, 2 the plan has errors, 3 usage")
    p.add_argument("--version", action="version", version=f"moe-runtime {__version__}")
    p.add_argument("--debug", action="store_true", help="print the traceback of an unexpected failure")
    sub = p.add_subparsers(dest="cmd", required=True, metavar="{probe,inspect,make-checkpoint,serve}")
    common = [_common()]

    pr = sub.add_parser("probe", help="GPUs of this node as JSON (NVML)", parents=common)
    pr.add_argument("--annotate-node", metavar="NODE", default=None,
                    help="also write moe.serving.dev/gpu.* annotations on this Node (the node-probe DaemonSet)")

    i = sub.add_parser("inspect", help="checkpoint facts as JSON", parents=common)
    i.add_argument("path")
    i.add_argument("--termination-log", default=None,
                   help="also write the JSON here (default: /dev/termination-log when writable)")

    m = sub.add_parser("make-checkpoint", help="write a random-weight checkpoint in the HF layout", parents=common)
    from moe_core.runtime import BUNDLED  # torch-free: the writer's table (every pair it can write)

    m.add_argument("--arch", required=True, choices=list(dict.fromkeys(BUNDLED.architectures.values())))
    m.add_argument("--format", required=True, choices=list(BUNDLED.checkpoint_formats),
                   help="the formats the runtime reads for each architecture (moe_core.runtime.BUNDLED.formats_for)")
    m.add_argument("--size", default="tiny", choices=["tiny", "small"])
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--device", default="cpu", help="where to generate/quantize: cpu, cuda, cuda:N "
                   "(cuda is much faster for small)")
    m.add_argument("--force", action="store_true", help="replace the contents of a non-empty directory")
    m.add_argument("dir", help="a new or empty directory (or any directory with --force)")

    s = sub.add_parser("serve", help="serve an OpenAI-compatible API", parents=common)
    s.add_argument("--model", required=True, help="checkpoint directory")
    s.add_argument("--plan", default=None, help="plan JSON file rendered by the operator")
    s.add_argument("--host", default="0.0.0.0")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"])
    s.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"],
                   help="activation dtype (auto: bf16, which runs the planned backend; float32: exact mode "
                        "with the fp32 reference experts)")
    s.add_argument("--max-batch", type=int, default=None,
                   help="sequences decoded together per step (>= 1; default: from the KV cache's blocks, at most "
                        "1024 on an H100/H200-class GPU, 256 on others, 128 on CPU)")
    s.add_argument("--max-queue", type=int, default=None,
                   help="waiting requests before 429 (>= 1; default: 8 x max batch, at least 1024)")
    s.add_argument("--max-model-len", type=int, default=None,
                   help="KV cache length per sequence (at most the model's max_position_embeddings)")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--threads", type=int, default=DEFAULT_THREADS,
                   help=f"CPU threads for torch (default {DEFAULT_THREADS}, measured fastest for small models "
                        "on small hosts; 0: torch's default, one per core)")
    s.add_argument("--api-key", default=os.environ.get("MOE_RUNTIME_API_KEY") or None,
                   help="require 'Authorization: Bearer KEY' on /v1/*, /tokenize, /detokenize "
                        "(default: $MOE_RUNTIME_API_KEY; unset: no key)")
    s.add_argument("--max-body-bytes", type=int, default=32 * 1024 * 1024,
                   help="largest request body accepted (413 above)")
    s.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (vLLM's flag: the tokenizer config and chat template, which "
                        "lm-eval's remote tokenizer reads)")
    s.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True,
                   help="replay captured CUDA graphs for decode steps on GPU (default on)")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (a power of two, 1..256)")
    s.add_argument("--kv-blocks", type=int, default=None,
                   help="KV-cache blocks (default: from --gpu-memory-utilization on GPU, --kv-cache-mib on CPU)")
    s.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="fraction of GPU memory for weights + KV cache, measured after the weights load (0-1]")
    s.add_argument("--kv-cache-mib", type=int, default=None,
                   help="KV-cache budget in MiB (CPU default: 2 x --max-batch sequences of the context length)")
    s.add_argument("--max-prefill-tokens", type=int, default=2048,
                   help="tokens per engine step (decode rows + prefill chunks): a longer prompt is prefilled in chunks")
    # vLLM 0.11.0's values (vllm/config/cache.py CacheDType: "fp8 (=fp8_e4m3)"); sglang spells it fp8_e4m3
    s.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                   help="KV-cache storage: auto, the model's dtype; fp8 (= fp8_e4m3), e4m3 with the checkpoint's "
                        "per-tensor self_attn.k_scale/v_scale (1.0 where absent): half the bytes, twice the tokens "
                        "for the same memory")
    s.add_argument("--prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV blocks of a prompt prefix computed before (default on)")
    s.add_argument("--skip-selftest", action="store_true",
                   help="do not self-test the MoE backend kernels (tests only; the forward of the loaded model still runs)")
    s.add_argument("--tp", type=int, default=1, help="tensor parallel size (attention, dense layers, vocab)")
    s.add_argument("--ep", type=int, default=1, help="expert parallel size (routed experts split E/ep); "
                   "one process per rank, max(tp, ep) ranks")
    s.add_argument("--dist-port", type=int, default=29500,
                   help="rendezvous port on rank 0's host (LWS_LEADER_ADDRESS multi-node; 0: any free port, one node)")
    s.add_argument("--dist-init-timeout", type=float, default=600.0, help="seconds for every rank to join")
    s.add_argument("--dist-timeout", type=float, default=300.0,
                   help="seconds a collective may wait before the group goes down")
    return p


def _run(args: argparse.Namespace) -> int:
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
        from .flags import prepare_output_dir, validate_device

        validate_device("--device", args.device)
        prepare_output_dir(args.dir, args.force)
        from .checkpoint_writer import make_checkpoint
        from .log import log

        make_checkpoint(args.dir, args.arch, args.format, args.size, seed=args.seed, device=args.device,
                        log=lambda s: log("make_checkpoint", s))
        return 0
    if args.cmd == "serve":
        from .flags import validate_serve

        validate_serve(args)  # before anything loads; serve binds the port first thing
        if max(args.tp, args.ep) > 1:
            from .serve import serve_parallel

            return serve_parallel(args)
        from .serve import serve

        return serve(args)
    raise AssertionError(f"unhandled subcommand {args.cmd}")


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
    except SystemExit as e:  # --help / --version (0) or a usage error (3): a status, not an exception
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    debug = bool(getattr(args, "debug", False))
    try:
        return _run(args)
    except RuntimeFailure as e:
        if debug:
            traceback.print_exc()
        print(f"error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr, flush=True)
        return 130
    except BrokenPipeError:  # `moe-runtime inspect ... | head`: the reader left
        return 0
    except Exception as e:  # noqa: BLE001 - a bug or an unforeseen input: one line, not a traceback
        if debug:
            traceback.print_exc()
        where = "" if debug else " (run with --debug for the traceback)"
        print(f"error: {args.cmd} failed: {type(e).__name__}: {e}{where}", file=sys.stderr, flush=True)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
