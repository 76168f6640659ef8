"""`moe-operator dev-cluster up|down|status|kubeconfig|env` (routed here by moe_operator.cli)."""

from __future__ import annotations

import argparse
import json
import shlex
import sys

from .binaries import BuildError, ensure_binaries
from .cluster import DevCluster, StartError
from .pools import GPU_CLASSES, parse_pools


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--state-dir", help="cluster state dir (default ${MOE_CACHE_DIR:-~/.cache/moe-operator}/dev-cluster)")
    sub = parser.add_subparsers(dest="action", required=True)
    up = sub.add_parser("up", help="build the binaries if needed, start the control plane, register GPU nodes")
    up.add_argument("--pools", help=f"pool sizes, e.g. h200=2,b200=1 or all=3 (pools: {', '.join(GPU_CLASSES)}; "
                    "default: 2 nodes of every pool on a fresh cluster)")
    up.add_argument("--build-only", action="store_true", help="only build (or find cached) binaries and print their dir")
    up.add_argument("--timeout", type=float, default=180.0, help="seconds to wait for each component")
    sub.add_parser("down", help="stop the processes `up` started (by PID) and delete the cluster data")
    st = sub.add_parser("status", help="show components, health and nodes per pool")
    st.add_argument("--json", action="store_true")
    sub.add_parser("kubeconfig", help="print the admin kubeconfig path")
    sub.add_parser("env", help="print `export KUBECONFIG=...` (eval \"$(moe-operator dev-cluster env)\")")


def run(args: argparse.Namespace) -> int:
    dc = DevCluster(args.state_dir)
    try:
        if args.action == "up":
            if args.build_only:
                print(ensure_binaries().dir)
                return 0
            pools = parse_pools(args.pools) if args.pools else None
            print(dc.up(pools, timeout=args.timeout))
            return 0
        if args.action == "down":
            dc.down()
            return 0
        if args.action == "status":
            return _status(dc, args.json)
        if args.action == "kubeconfig":
            print(dc.kubeconfig)
            return 0 if dc.kubeconfig.is_file() else 1
        if args.action == "env":
            print(f"export KUBECONFIG={shlex.quote(str(dc.kubeconfig))}")
            return 0
    except (BuildError, StartError, ValueError) as e:
        print(f"[dev-cluster] error: {e}", file=sys.stderr)
        return 1
    return 2


def _status(dc: DevCluster, as_json: bool) -> int:
    st = dc.status()
    if as_json:
        print(json.dumps(st, indent=2))
        return 0 if st["running"] else 1
    if "components" not in st:
        print(f"no cluster recorded in {st['state_dir']}")
        return 1
    print(f"server     {st['server']}  ({'ready' if st['ready'] else 'NOT READY'})")
    print(f"kubeconfig {st['kubeconfig']}")
    for name, c in st["components"].items():
        print(f"  {name:<24} pid {c['pid']:<8} {'running' if c['alive'] else 'DEAD':<8} {c['log']}")
    for pool, n in sorted(st.get("nodes", {}).items()):
        print(f"  pool {pool:<19} {n['ready']}/{n['total']} nodes Ready")
    return 0 if st["running"] else 1
