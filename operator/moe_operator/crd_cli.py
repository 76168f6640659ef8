"""`moe-operator crd [--format yaml|json] [-o FILE]`: print or write the generated CRD.

`-o` is a file path; its suffix (.json / .yaml / .yml) picks the format unless `--format` says.
`-o json` / `-o yaml` (a bare format word, as `plan -o json` takes it) print that format to
stdout instead of writing a file named `json`; write such a file as `-o ./json`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

_FORMAT_WORDS = ("json", "yaml", "yml")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", metavar="FILE", help="write to this file instead of stdout")
    p.add_argument("--format", choices=["yaml", "json"], default=None,
                   help="output format (default: from the -o suffix, else yaml)")


def run(args: argparse.Namespace) -> int:
    from .crd import crd, crd_yaml

    out, fmt = args.output, args.format
    if out is not None and out.lower() in _FORMAT_WORDS:  # `-o json`: a format, not a path
        if fmt is not None and fmt != ("yaml" if out.lower() == "yml" else out.lower()):
            print(f"error: -o {out} contradicts --format {fmt}", file=sys.stderr)
            return 1
        fmt, out = ("yaml" if out.lower() == "yml" else out.lower()), None
    if fmt is None:
        fmt = "json" if out is not None and out.lower().endswith(".json") else "yaml"
    text = json.dumps(crd(), indent=2) + "\n" if fmt == "json" else crd_yaml()
    if out is None:
        print(text, end="")
        return 0
    path = Path(out)
    if path.is_dir():
        print(f"error: -o {out}: is a directory; give a file path", file=sys.stderr)
        return 1
    try:
        path.write_text(text)
    except OSError as e:
        print(f"error: -o {out}: cannot write ({e.strerror or e})", file=sys.stderr)
        return 1
    return 0
