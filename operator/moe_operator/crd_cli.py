"""`moe-operator crd [-o FILE]`: print or write the generated CRD."""

from __future__ import annotations

import argparse
from pathlib import Path


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("-o", "--output", help="write to this file instead of stdout")


def run(args: argparse.Namespace) -> int:
    from .crd import crd_yaml

    text = crd_yaml()
    if args.output:
        Path(args.output).write_text(text)
    else:
        print(text, end="")
    return 0
