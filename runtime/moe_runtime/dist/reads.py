"""Reading one rank's slices of a checkpoint (safe_open + get_slice), as its shard plan says."""

from __future__ import annotations

import time
from typing import Any, Callable

import torch
from moe_kernels.formats import FP8_BLOCK, Fp8BlockTensor, dequantize_fp8_block
from safetensors import safe_open

from ..errors import RuntimeFailure
from ..progress import Progress
from .layout import split
from .shard import ShardPlan


def _bounds(shape, rule, name: str) -> tuple[int, int, int] | None:
    """(dim, start, stop) of a "part"/"range" rule on a tensor of `shape`; None: read it whole (a scalar)."""
    dim = rule[1]
    if len(shape) <= dim:
        return None
    if rule[0] == "range":
        return dim, rule[2], rule[3]
    n, parts, i = shape[dim], rule[2], rule[3]
    if n % parts:
        raise RuntimeFailure(f"tensor {name} dimension {dim} ({n}) does not split into {parts} equal parts")
    return (dim,) + split(n, parts, i)


def _read_rows(f, name: str, dim: int, a: int, b: int) -> torch.Tensor:
    sl = f.get_slice(name)
    index = [slice(None)] * len(sl.get_shape())
    index[dim] = slice(a, b)
    return sl[tuple(index)]


def _read_box(f, name: str, bounds: list[tuple[int, int, int]]) -> torch.Tensor:
    """The slice of `name` bounded on each (dim, start, stop) of `bounds` (one get_slice read)."""
    sl = f.get_slice(name)
    index = [slice(None)] * len(sl.get_shape())
    for dim, a, b in bounds:
        index[dim] = slice(a, b)
    return sl[tuple(index)]


def _read_fp8_rows(f_w, f_s, name: str, scale_name: str, dim: int, a: int, b: int) -> torch.Tensor:
    """A block-FP8 dense linear's slice [a, b) of `dim`, dequantised (fp32): read the 128-aligned superset
    (weight and its scale rows/columns), dequantise, trim. At most two extra blocks are read."""
    n = f_w.get_slice(name).get_shape()[dim]
    a0, b0 = a // FP8_BLOCK * FP8_BLOCK, min(-(-b // FP8_BLOCK) * FP8_BLOCK, n)
    w = _read_rows(f_w, name, dim, a0, b0)
    s = _read_rows(f_s, scale_name, dim, a0 // FP8_BLOCK, -(-b0 // FP8_BLOCK)).float()
    d = dequantize_fp8_block(Fp8BlockTensor(w, s), torch.float32)
    keep = [slice(None)] * 2
    keep[dim] = slice(a - a0, b - a0)
    return d[tuple(keep)].contiguous()


def read_sharded(v, device: str, log_fn: Callable[..., None], plan: ShardPlan, rank: int = 0):
    """This rank's slices of the checkpoint (safe_open + get_slice: nothing else is read). Routed experts
    come back renamed to their local index (experts.{e - first}); block-FP8 dense linears that are split
    come back dequantised (fp32) without their scale. Returns (tensors, seconds)."""
    where = {n: fname for fname, names in v.files.items() for n in names}
    out: dict[str, torch.Tensor] = {}
    est = int(v.nbytes / plan.lay.world) if plan.lay.world > 1 else v.nbytes
    prog = Progress(est, lambda ev, msg, **kw: log_fn(ev, f"rank {rank}: {msg}", rank=rank, **kw))
    files = sorted(v.files)
    handles: dict[str, Any] = {}
    done = 0

    def handle(fname):
        if fname not in handles:
            handles[fname] = safe_open(str(v.root / fname), framework="pt", device="cpu")
        return handles[fname]

    try:
        for k, fname in enumerate(files, 1):
            f = handle(fname)
            for n in v.files[fname]:
                r = plan.rule(n)
                if r == "skip":
                    continue
                stem = n[: -len("weight")] if n.endswith(".weight") else None
                if n.endswith(".weight_scale_inv") and ".mlp.experts." not in n and r is not None:
                    continue  # read with its weight
                shape = None if r is None else f.get_slice(n).get_shape()
                if r is not None and r[0] == "all":  # several dimensions sliced at once (fused experts split both ways)
                    bounds = [b for sub in r[1:] if (b := _bounds(shape, sub, n)) is not None]
                else:
                    bounds = None if r is None else _bounds(shape, r, n)
                sname = (stem + "weight_scale_inv") if stem else None
                if bounds is None:
                    t = f.get_tensor(n)
                elif isinstance(bounds, list):
                    t = _read_box(f, n, bounds)
                elif sname and sname in where and ".mlp.experts." not in n:
                    t = _read_fp8_rows(f, handle(where[sname]), n, sname, *bounds)
                else:
                    t = _read_rows(f, n, *bounds)
                ps = n.split(".")
                if ".mlp.experts." in n and ps[ps.index("experts") + 1].isdigit():
                    j = ps.index("experts") + 1
                    ps[j] = str(int(ps[j]) - plan.expert_lo)
                    n = ".".join(ps)
                nb = t.numel() * t.element_size()
                done += nb
                prog.advance(nb)
                out[n] = t.to(device, non_blocking=True) if device != "cpu" else t
            prog.file_done(fname, k, len(files))
    except RuntimeFailure:
        raise
    except Exception as e:  # safetensors' own error types for corrupt data
        raise RuntimeFailure(f"{v.root}: cannot read this rank's tensor slices ({type(e).__name__}: {e})") from None
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    secs = time.time() - prog.t0
    log_fn("load_shard", f"rank {rank} read {done / 1e9:.3f} GB of the checkpoint's {v.nbytes / 1e9:.3f} GB",
           rank=rank, bytes_rank=done, bytes_total=v.nbytes, seconds=round(secs, 2))
    return out, secs
