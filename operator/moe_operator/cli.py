"""`moe-operator` command line. Each subcommand lives in its own module and is imported lazily,
so `moe-operator plan` never pays for kopf or the kubernetes client."""

from __future__ import annotations

import importlib
import sys

# subcommand -> (module, help). Each module exposes `add_arguments(parser)` and `run(args) -> int`.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("moe_operator.plan_cli", "plan backend/env choices for a checkpoint on a GPU class"),
    "crd": ("moe_operator.crd_cli", "print the CustomResourceDefinition generated from the API models"),
    "dev-cluster": ("moe_operator.devcluster.cli", "local control plane with simulated GPU nodes (up|down|status)"),
    "run": ("moe_operator.run_cli", "run the operator (kopf) against the configured cluster"),
    "demo": ("moe_operator.demo", "end-to-end local demo: control plane, operator, samples, one runtime"),
}


def main(argv: list[str] | None = None) -> int:
    import argparse

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="moe-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    # Only import the module of the subcommand actually asked for (keeps `plan` fast and light).
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_)
        if name == chosen:
            mod = importlib.import_module(module)
            mod.add_arguments(p)
            p.set_defaults(_run=mod.run)
    args = parser.parse_args(argv)
    try:
        return int(args._run(args) or 0)
    except BrokenPipeError:  # `moe-operator plan ... | head`: the reader left, nothing to report
        sys.stderr.close()
        return 0


if __name__ == "__main__":
    sys.exit(main())
