"""`moe-operator` command line. Each subcommand lives in its own module and is imported lazily,
so `moe-operator plan` never pays for kopf or the kubernetes client.

Exit statuses: 0 ok; 1 bad input; 2 the plan has errors (`plan`); 3 usage (unknown flag or
subcommand, a missing or malformed argument). An unexpected failure is one `error:` line, with
the traceback only under `--debug`."""

from __future__ import annotations

import argparse
import importlib
import sys
import traceback

EXIT_BAD_INPUT, EXIT_USAGE = 1, 3


class UsageParser(argparse.ArgumentParser):
    """argparse whose usage errors exit 3 (2 is 'the plan has errors')."""

    def error(self, message: str):
        self.print_usage(sys.stderr)
        self.exit(EXIT_USAGE, f"error: {self.prog}: {message}\n")

# subcommand -> (module, help). Each module exposes `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("moe_operator.plan_cli", "plan backend/env choices for a checkpoint on a GPU class"),
    "crd": ("moe_operator.crd_cli", "print the CustomResourceDefinition generated from the API models"),
    "dev-cluster": ("moe_operator.devcluster.cli", "local control plane with simulated GPU nodes (up|down|status)"),
    "run": ("moe_operator.run_cli", "run the operator (kopf) against the configured cluster"),
    "demo": ("moe_operator.demo", "end-to-end local demo: control plane, operator, samples, one runtime"),
    "download-model": ("moe_operator.download_cli", "fill a model cache directory with one hub commit (the cache Job)"),
}


def main(argv: list[str] | None = None) -> int:
    from . import __version__

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = UsageParser(prog="moe-operator", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"moe-operator {__version__}")
    parser.add_argument("--debug", action="store_true", help="print the traceback of an unexpected failure")
    sub = parser.add_subparsers(dest="command", required=True)
    # Only import the module of the subcommand actually asked for (keeps `plan` fast and light).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help / --version (0) or a usage error (3)
        return e.code if isinstance(e.code, int) else EXIT_USAGE
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # `moe-operator plan ... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0
    except KeyboardInterrupt:
        print("error: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001 - one line, not a traceback (unless --debug)
        if args.debug:
            traceback.print_exc()
        hint = "" if args.debug else " (run with --debug for the traceback)"
        print(f"error: {args.command} failed: {type(e).__name__}: {e}{hint}", file=sys.stderr)
        return EXIT_BAD_INPUT


if __name__ == "__main__":
    sys.exit(main())
