"""Checks of the `serve` and `make-checkpoint` flags that argparse's types cannot express, run
before anything is loaded, and the listening socket of `serve` (bound before the model loads).
Each failure is a BadInput (exit 1) whose message names the flag, the value and what would work."""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
from pathlib import Path

from .errors import BadInput, PlanFailure

MAX_THREADS = 1024
MAX_BATCH = 4096
MAX_QUEUE = 1_000_000
MIN_BODY_BYTES = 1024


def _bad(flag: str, value, why: str) -> BadInput:
    return BadInput(f"{flag} {value!r}: {why}")


def model_max_len(model_dir: str | Path) -> int | None:
    """max_position_embeddings of the checkpoint's config.json (None when absent or unreadable:
    the checkpoint checks report that)."""
    try:
        v = json.loads((Path(model_dir) / "config.json").read_text()).get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        return None
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


def addresses(host: str, port: int) -> list:
    """getaddrinfo of the --host to listen on; a host that does not resolve is a BadInput."""
    try:
        return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except (socket.gaierror, UnicodeError, ValueError, OverflowError) as e:
        raise _bad("--host", host, f"cannot be resolved ({e})") from None


def listen(host: str, port: int) -> socket.socket:
    """The listening socket of `serve`, bound before anything loads (a busy port or a host that
    does not resolve fails in milliseconds, not after the model loaded) and then handed to uvicorn,
    so no other process can take the port in between. Bound as uvicorn binds (SO_REUSEADDR), with
    the first address of the host that works."""
    last: OSError | None = None
    for family, kind, proto, _, addr in addresses(host, port):
        s = socket.socket(family, kind, proto)
        try:
            if os.name != "nt":
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
            s.listen(2048)  # uvicorn's default backlog
            s.set_inheritable(True)
            return s
        except OSError as e:
            s.close()
            last = e
    if last is not None and last.errno == errno.EADDRINUSE:
        raise BadInput(f"--port {port}: address {host}:{port} is already in use") from None
    if last is not None and last.errno in (errno.EACCES, errno.EPERM):
        raise BadInput(f"--port {port}: permission denied to listen on {host}:{port}") from None
    raise BadInput(f"--host {host!r} --port {port}: cannot listen there ({last})") from None


def check_bind(host: str, port: int) -> None:
    """`listen` and close: for the launcher of `serve --tp/--ep`, whose rank 0 (another process)
    listens itself; a busy port is refused before any rank is spawned."""
    listen(host, port).close()


def server_options(args):
    """The HTTP layer's settings from the serve flags (http.state.ServerOptions), passed to its state."""
    from .http.state import ServerOptions

    return ServerOptions(api_key=getattr(args, "api_key", None),
                         max_body_bytes=getattr(args, "max_body_bytes", ServerOptions.max_body_bytes),
                         tokenizer_info=getattr(args, "enable_tokenizer_info_endpoint", False))


def check_plan_errors(path: str) -> None:
    """A plan the planner marked as having errors is exit 2 ('the plan has errors'); an unreadable
    or malformed plan is left to the plan checks (exit 1 / their message)."""
    p = Path(path)
    if not p.is_file():
        raise _bad("--plan", path, "no such file")
    try:
        errors = json.loads(p.read_text()).get("errors")
    except (OSError, ValueError, AttributeError):
        return
    if isinstance(errors, list) and errors:
        raise PlanFailure(f"plan {p}: the plan has errors and cannot be served: " + "; ".join(map(str, errors)))


def validate_serve(args) -> None:
    """Refuse flag values that cannot work (instead of a server that reports Ready and then fails)."""
    if not 0 <= args.port <= 65535:
        raise _bad("--port", args.port, "must be in 0..65535 (0: any free port)")
    if not args.host or args.host != args.host.strip():
        raise _bad("--host", args.host, "must be a host name or address")
    if args.max_batch is not None and not 1 <= args.max_batch <= MAX_BATCH:
        raise _bad("--max-batch", args.max_batch, f"must be in 1..{MAX_BATCH} (sequences decoded together)")
    if args.max_queue is not None and not 1 <= args.max_queue <= MAX_QUEUE:
        raise _bad("--max-queue", args.max_queue, f"must be in 1..{MAX_QUEUE} (waiting requests before 429)")
    if not 0 <= args.threads <= MAX_THREADS:
        raise _bad("--threads", args.threads, f"must be in 0..{MAX_THREADS} (0: torch's default)")
    if args.served_model_name is not None and not args.served_model_name.strip():
        raise _bad("--served-model-name", args.served_model_name, "must not be empty")
    if getattr(args, "api_key", None) is not None and not args.api_key.strip():
        raise _bad("--api-key", args.api_key, "must not be empty (leave it out to serve without a key)")
    if getattr(args, "max_body_bytes", MIN_BODY_BYTES) < MIN_BODY_BYTES:
        raise _bad("--max-body-bytes", args.max_body_bytes, f"must be at least {MIN_BODY_BYTES}")
    bs = getattr(args, "block_size", 16)
    if not 1 <= bs <= 256 or bs & (bs - 1):
        raise _bad("--block-size", bs, "must be a power of two in 1..256 (tokens per KV-cache block)")
    if getattr(args, "kv_blocks", None) is not None and args.kv_blocks < 1:
        raise _bad("--kv-blocks", args.kv_blocks, "must be at least 1")
    if not 0 < getattr(args, "gpu_memory_utilization", 0.9) <= 1:
        raise _bad("--gpu-memory-utilization", args.gpu_memory_utilization, "must be in (0, 1]")
    if getattr(args, "kv_cache_mib", None) is not None and args.kv_cache_mib < 1:
        raise _bad("--kv-cache-mib", args.kv_cache_mib, "must be at least 1")
    if getattr(args, "max_prefill_tokens", 1) < 1:
        raise _bad("--max-prefill-tokens", args.max_prefill_tokens, "must be at least 1")
    model = Path(args.model)
    if not model.exists():
        raise _bad("--model", args.model, "no such directory")
    if not model.is_dir():
        raise _bad("--model", args.model, "is not a directory (a checkpoint directory with config.json)")
    if args.plan is not None:
        check_plan_errors(args.plan)
    if args.max_model_len is not None:
        if args.max_model_len < 2:
            raise _bad("--max-model-len", args.max_model_len, "must be at least 2 (a prompt token and one more)")
        limit = model_max_len(model)
        if limit is not None and args.max_model_len > limit:
            raise _bad("--max-model-len", args.max_model_len,
                       f"is beyond the model's max_position_embeddings ({limit}) in {model / 'config.json'}")
    addresses(args.host, args.port)  # the port itself: serve binds it first (listen), before the checkpoint is read


def engine_options(args) -> dict:
    """serve's KV-cache and scheduler flags as engine.Engine keyword arguments."""
    mib = getattr(args, "kv_cache_mib", None)
    return {"block_size": getattr(args, "block_size", 16), "kv_blocks": getattr(args, "kv_blocks", None),
            "kv_memory_bytes": mib * 2**20 if mib else None,
            "gpu_memory_utilization": getattr(args, "gpu_memory_utilization", 0.9),
            "max_prefill_tokens": getattr(args, "max_prefill_tokens", 2048),
            "prefix_caching": getattr(args, "prefix_caching", True),
            "kv_cache_dtype": getattr(args, "kv_cache_dtype", "auto")}


def validate_device(flag: str, device: str) -> None:
    """`cpu`, `cuda` or `cuda:N` with such a GPU present."""
    import torch

    try:
        d = torch.device(device)
    except (RuntimeError, TypeError) as e:
        raise _bad(flag, device, f"is not a device (cpu, cuda, cuda:N): {e}") from None
    if d.type == "cpu":
        return
    if d.type != "cuda":
        raise _bad(flag, device, "must be cpu, cuda or cuda:N")
    if not torch.cuda.is_available():
        raise _bad(flag, device, "torch cannot use a GPU on this machine (torch.cuda.is_available() is False)")
    if d.index is not None and d.index >= torch.cuda.device_count():
        raise _bad(flag, device, f"this machine has {torch.cuda.device_count()} GPU(s)")


def prepare_output_dir(path: str | Path, force: bool) -> Path:
    """make-checkpoint's target: a new or empty directory, or (with --force) a directory whose
    contents are removed first, so no stale file of an earlier checkpoint survives."""
    out = Path(path)
    if out.exists() and not out.is_dir():
        raise BadInput(f"{out}: exists and is not a directory; make-checkpoint writes a checkpoint directory")
    for parent in out.parents:
        if parent.exists():
            if not parent.is_dir():
                raise BadInput(f"{out}: {parent} is a file, not a directory")
            break
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise BadInput(f"{out}: directory is not empty; choose a new directory or pass --force to "
                                 "replace its contents")
        for child in out.iterdir():
            if child.is_dir() and not child.is_symlink():
                shutil.rmtree(child)
            else:
                child.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise BadInput(f"{out}: cannot create the directory ({e.strerror or e})") from None
    return out
