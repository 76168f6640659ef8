"""Tensor and expert parallelism of the bundled runtime over torch.distributed (NCCL on GPUs, gloo on CPU).

Layout (the API's convention: `parallelism.tp` GPUs per replica, `ep` divides it; `--tp 1 --ep M`
is accepted too): world W = max(tp, ep), the larger a multiple of the smaller. Rank r:
- attention: tensor parallel over the `tp` consecutive ranks of r's attention group (heads split;
  replicated across the W/tp groups when tp < W); one all-reduce (attention group) after o_proj.
- vocab-parallel embedding (masked lookup + all-reduce) and LM head (local vocab slice, all-gather),
  over the attention group.
- dense MLP and the shared expert: intermediate split over all W ranks (column-parallel gate/up,
  row-parallel down); the dense MLP all-reduces over the world; the shared expert's partial output
  goes into the MoE block's one all-reduce.
- routed experts: ep groups of etp = W/ep ranks; r holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep)
  with their intermediate split etp ways (TP inside experts). Activations are replicated on every
  rank after the attention all-reduce, so dispatch is the all-gather of the degenerate kind (each
  rank already has every token); a rank runs its experts on the pairs routed to them (other ids become
  -1, which the experts backends and the deferred finalize skip) and the combine of (routed partial +
  shared partial) over the world is moe_runtime.dispatch's: one fp32 all-reduce for small batches, or
  all_to_all_single of the rows to the tokens' owners + all_gather_into_tensor for large ones.

All reductions run in fp32 (the bf16 partials summed once in fp32, then rounded).

Launch: `launch()` (from `moe-runtime serve --tp N --ep M`) spawns one process per local rank;
global rank 0 serves HTTP and its model is a `LeaderModel` that broadcasts every model call (the
batch of each engine step) to the other ranks over a gloo control group; the others run `follow()`.
Multi-node: LWS_LEADER_ADDRESS / LWS_GROUP_SIZE / LWS_WORKER_INDEX (LeaderWorkerSet) give the
rendezvous. Init and collective timeouts; the launcher takes the node's group down (non-zero exit,
with the rank and its exit status) when one process dies, and a rank whose collective fails exits
non-zero naming the failure.
"""

from __future__ import annotations

import datetime
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from .errors import RuntimeFailure
from .log import log

DEFAULT_PORT = 29500
DEFAULT_INIT_TIMEOUT = 600.0
DEFAULT_COLLECTIVE_TIMEOUT = 300.0


# ------------------------------------------------------------------------------------------------
# Layout (pure arithmetic, no process group)

@dataclass(frozen=True)
class Layout:
    tp: int = 1
    ep: int = 1
    rank: int = 0

    @property
    def world(self) -> int:
        return max(self.tp, self.ep)

    @property
    def tp_rank(self) -> int:
        return self.rank % self.tp

    @property
    def attn_group_index(self) -> int:
        return self.rank // self.tp

    @property
    def etp(self) -> int:
        return self.world // self.ep

    @property
    def ep_rank(self) -> int:
        return self.rank // self.etp

    @property
    def etp_rank(self) -> int:
        return self.rank % self.etp

    def problem(self) -> str | None:
        if self.tp < 1 or self.ep < 1:
            return f"--tp {self.tp} --ep {self.ep}: both must be >= 1"
        if self.world % self.tp or self.world % self.ep:
            return (f"--tp {self.tp} --ep {self.ep}: one must divide the other (the world is max(tp, ep) ranks: "
                    f"attention over tp ranks, experts over ep groups)")
        return None


def _split(n: int, parts: int, i: int) -> tuple[int, int]:
    k = n // parts
    return i * k, (i + 1) * k


class ShardPlan:
    """Which slice of each checkpoint tensor one rank reads: None = the whole tensor, "skip" = not on this
    rank, ("part", dim, parts, i) = part i of dimension dim, ("range", dim, start, stop) = those rows."""

    def __init__(self, cfg: dict[str, Any], expert_format: str, layout: Layout):
        self.cfg, self.fmt, self.lay = cfg, expert_format, layout
        from .model_spec import arch_of, num_experts

        self.E = num_experts(cfg)
        self.gpt_oss = arch_of(cfg) == "gpt_oss"
        self.expert_lo, self.expert_hi = _split(self.E, layout.ep, layout.ep_rank) if self.E else (0, 0)

    @property
    def local_experts(self) -> int:
        return self.expert_hi - self.expert_lo

    def problems(self) -> list[str]:
        """Headers-only: every size the layout must divide, named."""
        c, lay, out = self.cfg, self.lay, []
        if (p := lay.problem()):
            return [p]

        def need(what: str, n: int, parts: int, flag: str):
            if parts > 1 and n % parts:
                out.append(f"{what} {n} is not divisible by {flag} {parts}")

        need("num_attention_heads", c["num_attention_heads"], lay.tp, "--tp")
        need("vocab_size", c["vocab_size"], lay.tp, "--tp")
        nkv = c.get("num_key_value_heads") or c["num_attention_heads"]
        if "kv_lora_rank" not in c and lay.tp > 1 and nkv % lay.tp and lay.tp % nkv:
            out.append(f"num_key_value_heads {nkv} and --tp {lay.tp}: one must divide the other")
        if not self.gpt_oss:  # gpt-oss has no dense MLP: its intermediate_size is the experts'
            need("intermediate_size (dense MLP)", c.get("intermediate_size") or 0, lay.world, "the world size")
        if c.get("n_shared_experts"):
            need("shared expert intermediate size", c["moe_intermediate_size"] * c["n_shared_experts"], lay.world,
                 "the world size")
        if self.E:
            need("number of routed experts", self.E, lay.ep, "--ep")
            key = "intermediate_size" if self.gpt_oss else "moe_intermediate_size"
            inter = c[key]
            group = {"fp8": 128, "nvfp4": 16, "mxfp4": 32, "bf16": 1}[self.fmt]
            if self.gpt_oss and lay.etp > 1 and inter % group == 0:
                # gpt-oss's own torch experts take uneven parts (whole blocks: _gpt_oss_inter_range)
                if inter // group < lay.etp:
                    out.append(f"{key} {inter} split {lay.etp} ways inside the experts (world {lay.world} / --ep "
                               f"{lay.ep}) needs a whole {self.fmt} block of {group} per rank ({inter // group} "
                               f"blocks); use --ep {lay.world} (whole experts per rank)")
            elif lay.etp > 1 and inter % (lay.etp * group):
                out.append(f"{key} {inter} split {lay.etp} ways inside the experts (world {lay.world} / "
                           f"--ep {lay.ep}) leaves slices that are not whole {self.fmt} blocks of {group}; "
                           f"use --ep {lay.world} (whole experts per rank)")
        return out

    def rule(self, name: str):
        lay = self.lay
        parts = name.split(".")
        leaf = parts[-1]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self._dim_rule(name, 0, lay.tp, lay.tp_rank)
        if ".self_attn." in name:
            proj = parts[-2]
            if leaf == "sinks":  # gpt-oss: one sink logit per query head, split with the heads
                return self._dim_rule(name, 0, lay.tp, lay.tp_rank)
            if leaf == "bias" and proj == "o_proj":
                return None  # replicated; the model adds it once (gpt_oss.RowParallelBiased)
            if leaf not in ("weight", "weight_scale_inv", "bias"):  # q/k/v biases follow their weight's rows
                return None
            c = self.cfg
            if proj in ("q_proj", "q_b_proj", "kv_b_proj"):
                return self._dim_rule(name, 0, lay.tp, lay.tp_rank)
            if proj in ("k_proj", "v_proj"):
                nkv, hd = c.get("num_key_value_heads") or c["num_attention_heads"], self._head_dim()
                if lay.tp == 1:
                    return None
                if nkv % lay.tp == 0:
                    return self._dim_rule(name, 0, lay.tp, lay.tp_rank)
                # fewer KV heads than ranks: each rank reads the one its query heads share
                first = lay.tp_rank * nkv // lay.tp
                return ("range", 0, first * hd, (first + 1) * hd)
            if proj == "o_proj":
                return self._dim_rule(name, 1, lay.tp, lay.tp_rank)
            return None  # q_a_proj, kv_a_proj_with_mqa, norms: replicated
        if ".mlp.experts." in name:
            tag = parts[parts.index("experts") + 1]
            if self.gpt_oss:
                return self._gpt_oss_expert_rule(tag)
            if not tag.isdigit():  # fused layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
                if lay.etp > 1:
                    raise RuntimeFailure(f"{name}: fused expert tensors are split by whole experts only; "
                                         f"use --ep {lay.world}")
                return None if lay.ep == 1 else ("range", 0, self.expert_lo, self.expert_hi)
            e = int(tag)
            if not self.expert_lo <= e < self.expert_hi:
                return "skip"
            if leaf in ("weight_scale_2", "input_scale"):
                return None
            proj = parts[-2]
            return self._dim_rule(name, 1 if proj == "down_proj" else 0, lay.etp, lay.etp_rank, full=True)
        if ".mlp." in name and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
            if leaf not in ("weight", "weight_scale_inv"):
                return None
            return self._dim_rule(name, 1 if parts[-2] == "down_proj" else 0, lay.world, lay.rank)
        return None

    def _gpt_oss_expert_rule(self, tag: str):
        """gpt-oss's fused expert tensors (model_spec.gpt_oss_shapes): this rank's experts [lo, hi) on
        dimension 0 and, with TP inside the experts (etp > 1), its part of the intermediate dimension:
        gate_up's 2I columns (bf16 [E, H, 2I], its bias [E, 2I]) or rows (mxfp4 blocks [E, 2I, H/32, 16],
        scales [E, 2I, H/32]), a contiguous part of the gate/up-interleaved 2I holding gate and up of the
        same intermediate slice; down's I rows (bf16 [E, I, H]) or its I/32 blocks (mxfp4 [E, H, I/32, 16]
        and [E, H, I/32]). down's bias [E, H] is read whole by every rank of the expert group; only
        etp rank 0 adds it (the loader zeroes it elsewhere: gpt_oss.stack_experts). The intermediate
        parts may be uneven (_gpt_oss_inter_range): gpt-oss-20b/120b's 2880 is 90 MXFP4 blocks, which
        4 or 8 ranks do not divide."""
        lay, rules = self.lay, []
        if lay.ep > 1:
            rules.append(("range", 0, self.expert_lo, self.expert_hi))
        if lay.etp > 1:
            lo, hi = self._gpt_oss_inter_range()
            g = 32 if self.fmt == "mxfp4" else 1
            dim_range = {"gate_up_proj": (2, 2 * lo, 2 * hi), "gate_up_proj_bias": (1, 2 * lo, 2 * hi),
                         "gate_up_proj_blocks": (1, 2 * lo, 2 * hi), "gate_up_proj_scales": (1, 2 * lo, 2 * hi),
                         "down_proj": (1, lo, hi), "down_proj_blocks": (2, lo // g, hi // g),
                         "down_proj_scales": (2, lo // g, hi // g)}.get(tag)
            if dim_range is not None:
                rules.append(("range", *dim_range))
        if not rules:
            return None
        return rules[0] if len(rules) == 1 else ("all", *rules)

    def _gpt_oss_inter_range(self) -> tuple[int, int]:
        """This rank's intermediate rows [lo, hi) inside its experts: whole blocks of the expert format
        (mxfp4 32, bf16 1), spread as evenly as they go (parts differ by at most one block)."""
        lay, g = self.lay, 32 if self.fmt == "mxfp4" else 1
        nb = self.cfg["intermediate_size"] // g
        return lay.etp_rank * nb // lay.etp * g, (lay.etp_rank + 1) * nb // lay.etp * g

    def _head_dim(self) -> int:
        c = self.cfg
        return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    def _dim_rule(self, name: str, dim: int, parts: int, i: int, full: bool = False):
        """("part", dim, parts, i): part i of `parts` equal parts of the tensor's own dimension `dim` (for a
        packed or block-scaled tensor that is the matching part of its logical dimension)."""
        if parts == 1:
            return None
        return ("part", dim, parts, i)


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
    return (dim,) + _split(n, parts, i)


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
    from moe_kernels.formats import FP8_BLOCK, Fp8BlockTensor, dequantize_fp8_block

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
    from safetensors import safe_open

    from .loader import Progress

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
                if r is not None and r[0] == "all":  # several dimensions sliced at once (gpt-oss experts)
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


# ------------------------------------------------------------------------------------------------
# Process groups and the collectives the models call

@dataclass
class Group:
    layout: Layout
    local_rank: int
    backend: str
    device: str
    attn: Any = None  # this rank's attention-group ProcessGroup
    world_pg: Any = None
    ctrl: Any = None  # gloo group for the control channel (object broadcasts)
    collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT
    attn_ranks: list[int] = field(default_factory=list)


STATE: Group | None = None


def _reduce(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    y = x.float().contiguous()
    dist.all_reduce(y, group=group)
    return y.to(x.dtype)


def all_reduce_attn(x: torch.Tensor) -> torch.Tensor:
    if STATE is None or STATE.layout.tp == 1 and STATE.layout.world > 1:
        return x
    return _reduce(x, STATE.attn)


def all_reduce_world(x: torch.Tensor) -> torch.Tensor:
    if STATE is None:
        return x
    return _reduce(x, STATE.world_pg)


class RowParallelLinear(nn.Module):
    """A bias-free linear over this rank's input-dimension slice, its output all-reduced over `group`
    ("attn" or "world"); the plain linear without a process group."""

    def __init__(self, weight: torch.Tensor, group: str):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = F.linear(x, self.weight)
        return all_reduce_attn(y) if self.group == "attn" else all_reduce_world(y)


def embed(input_ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Vocab-parallel embedding: this rank's rows [lo, lo + V/tp), others masked to zero, summed."""
    if STATE is None or STATE.layout.tp == 1 and STATE.layout.world > 1:
        return F.embedding(input_ids, weight)
    lo = STATE.layout.tp_rank * weight.shape[0]
    local = input_ids - lo
    inside = (local >= 0) & (local < weight.shape[0])
    x = F.embedding(local.clamp(0, weight.shape[0] - 1), weight) * inside[..., None].to(weight.dtype)
    return all_reduce_attn(x)


def gather_vocab(logits: torch.Tensor) -> torch.Tensor:
    """LM head over this rank's vocab slice -> the full logits on every rank of the attention group."""
    if STATE is None or STATE.layout.tp == 1 and STATE.layout.world > 1:
        return logits
    import torch.distributed as dist

    parts = [torch.empty_like(logits) for _ in range(STATE.layout.tp)]
    dist.all_gather(parts, logits.contiguous(), group=STATE.attn)
    return torch.cat(parts, dim=-1)


def _num_local_experts(experts) -> int:
    """Experts on this rank: every backend keeps the ExpertWeights it was built from, or its E."""
    w = getattr(experts, "weights", None)
    if w is not None and hasattr(w, "num_experts"):
        return w.num_experts
    return int(getattr(experts, "E"))


def localize_expert_ids(ids: torch.Tensor, experts) -> torch.Tensor:
    """Global expert ids -> this rank's local ids; experts on other ranks become -1 (skipped by the
    backends' alignment and by the finalize)."""
    if STATE is None or STATE.layout.ep == 1:
        return ids
    n = _num_local_experts(experts)
    local = ids - STATE.layout.ep_rank * n
    return torch.where((local >= 0) & (local < n), local, torch.full_like(local, -1))


def init(layout: Layout, local_rank: int, device: str, master_addr: str, master_port: int,
         init_timeout: float = DEFAULT_INIT_TIMEOUT, collective_timeout: float = DEFAULT_COLLECTIVE_TIMEOUT) -> Group:
    """Join the group (TCPStore rendezvous at master_addr:master_port within init_timeout), make the
    attention groups and the gloo control group; every collective has collective_timeout."""
    global STATE
    import torch.distributed as dist

    os.environ["NCCL_NVLS_ENABLE"] = "0"
    backend = "nccl" if device.startswith("cuda") else "gloo"
    if backend == "nccl":
        torch.cuda.set_device(device)
    t0 = time.time()
    try:
        store = dist.TCPStore(master_addr, master_port, layout.world, is_master=layout.rank == 0,
                              timeout=datetime.timedelta(seconds=init_timeout), wait_for_workers=True)
        timeout = datetime.timedelta(seconds=collective_timeout)
        kw = {"device_id": torch.device(device)} if backend == "nccl" else {}
        dist.init_process_group(backend, store=store, rank=layout.rank, world_size=layout.world, timeout=timeout, **kw)
    except Exception as e:  # noqa: BLE001 - TCPStore/c10d raise several types; one message
        raise RuntimeFailure(f"rank {layout.rank}: cannot join the torch.distributed group of {layout.world} at "
                             f"{master_addr}:{master_port} within {init_timeout:.0f}s ({type(e).__name__}: {e})") from None
    g = Group(layout, local_rank, backend, device, collective_timeout=collective_timeout)
    g.world_pg = dist.group.WORLD
    for k in range(layout.world // layout.tp):
        ranks = list(range(k * layout.tp, (k + 1) * layout.tp))
        pg = dist.new_group(ranks, timeout=timeout)
        if k == layout.attn_group_index:
            g.attn, g.attn_ranks = pg, ranks
    g.ctrl = dist.new_group(list(range(layout.world)), backend="gloo", timeout=timeout)
    STATE = g
    log("distributed", f"rank {layout.rank}/{layout.world} joined ({backend}, tp={layout.tp} ep={layout.ep}) in "
        f"{time.time() - t0:.1f}s", rank=layout.rank, world=layout.world, backend=backend, device=device)
    return g


def group_ready(group: Group, timeout: float = DEFAULT_INIT_TIMEOUT) -> None:
    """Every rank has loaded and built its model: a barrier on the gloo control group (monitored, so a
    rank that never arrives is named). Rank 0 marks the server ready only after it, so /ready means the
    whole group (on every node of a LeaderWorkerSet) is up; loading takes longer than the collective
    timeout on large checkpoints, hence the init timeout here."""
    import torch.distributed as dist

    t0 = time.time()
    try:
        dist.monitored_barrier(group=group.ctrl, timeout=datetime.timedelta(seconds=timeout), wait_all_ranks=True)
    except Exception as e:  # noqa: BLE001 - gloo names the ranks that did not arrive
        raise RuntimeFailure(f"rank {group.layout.rank}: not every rank of the group of {group.layout.world} loaded its "
                             f"model within {timeout:.0f}s ({type(e).__name__}: {e})") from None
    log("group_ready", f"rank {group.layout.rank}: all {group.layout.world} ranks loaded ({time.time() - t0:.1f}s "
        "waiting for the others)", rank=group.layout.rank, world=group.layout.world)


def shutdown() -> None:
    global STATE
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - best effort at exit
            pass
    STATE = None


def fatal(msg: str) -> None:
    """A rank that can no longer follow the group: one error line, exit 1 (the launcher takes the rest down)."""
    print(f"error: {msg}", file=sys.stderr, flush=True)
    log("fatal", msg)
    os._exit(1)


# ------------------------------------------------------------------------------------------------
# Leader / follower: the engine runs on rank 0; every model call is mirrored on the other ranks

def _to(obj, device):
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to(o, device) for o in obj)
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _mirrored_methods(model) -> set[str]:
    """The model's own methods (CausalLM's, not nn.Module's): the calls that change or read its state."""
    names = set()
    for cls in type(model).__mro__:
        if cls in (nn.Module, object):
            break
        names.update(n for n, v in vars(cls).items() if callable(v) and not n.startswith("_"))
    return names


class LeaderModel:
    """Rank 0's model: each call is broadcast to the followers (the batch of every step), then run here.
    A heartbeat keeps idle followers inside their collective timeout; a failed call is fatal."""

    def __init__(self, model, group: Group):
        self._model, self._g = model, group
        self._lock = threading.Lock()
        self._last = time.time()
        self._stopped = False
        self._mirrored = _mirrored_methods(model)
        self._beat = max(min(group.collective_timeout / 4, 10.0), 0.05)
        threading.Thread(target=self._heartbeat, name="moe-heartbeat", daemon=True).start()

    def _send(self, cmd) -> None:
        import torch.distributed as dist

        with self._lock:
            if self._stopped:
                return
            dist.broadcast_object_list([cmd], src=0, group=self._g.ctrl)
            self._last = time.time()

    def _heartbeat(self) -> None:
        while not self._stopped:
            time.sleep(self._beat)
            if time.time() - self._last >= self._beat:
                try:
                    self._send(("ping",))
                except Exception as e:  # noqa: BLE001
                    if not self._stopped:
                        fatal(f"rank 0: a follower rank is gone (control channel: {type(e).__name__}: {e}); "
                              "the group goes down")

    def _call(self, name: str, args, kwargs):
        try:
            self._send((name, _to(args, "cpu"), _to(kwargs, "cpu")))
            fn = self._model if name == "__call__" else getattr(self._model, name)
            return fn(*args, **kwargs)
        except Exception as e:  # noqa: BLE001 - the followers are out of step now
            fatal(f"rank 0: model call {name} failed with the group of {self._g.layout.world} "
                  f"({type(e).__name__}: {e}); the group goes down")

    def __call__(self, *args, **kwargs):
        return self._call("__call__", args, kwargs)

    def __getattr__(self, name):
        attr = getattr(self._model, name)
        if name in self._mirrored:
            return lambda *a, **k: self._call(name, a, k)
        return attr

    def stop(self) -> None:
        try:
            self._send(("stop",))
        except Exception:  # noqa: BLE001 - followers already gone
            pass
        self._stopped = True


def follow(model, group: Group) -> int:
    """A non-zero rank: run every call rank 0 broadcasts until it says stop. A failed collective (rank 0
    gone, or silent past the timeout) is fatal with the cause."""
    import torch.distributed as dist

    r = group.layout.rank
    while True:
        box = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=group.ctrl)
        except Exception as e:  # noqa: BLE001
            fatal(f"rank {r}: rank 0 is gone or silent for more than {group.collective_timeout:.0f}s "
                  f"({type(e).__name__}: {e}); the group goes down")
        cmd = box[0]
        if cmd[0] == "ping":
            continue
        if cmd[0] == "stop":
            log("shutdown", f"rank {r}: rank 0 stopped; exiting", rank=r)
            return 0
        name, args, kwargs = cmd
        try:
            fn = model if name == "__call__" else getattr(model, name)
            with torch.inference_mode():
                fn(*_to(args, group.device), **_to(kwargs, group.device))
        except Exception as e:  # noqa: BLE001
            fatal(f"rank {r}: model call {name} failed ({type(e).__name__}: {e}); the group goes down")


# ------------------------------------------------------------------------------------------------
# Launch: one process per local device

@dataclass(frozen=True)
class Rendezvous:
    addr: str
    port: int
    nodes: int
    node_index: int
    local_world: int


def rendezvous(world: int, port: int, env=os.environ) -> Rendezvous:
    """This node's place in the group: the LeaderWorkerSet environment when present, else one node.
    LWS_GROUP_SIZE nodes of world / nodes ranks each; this node's ranks are LWS_WORKER_INDEX x (world /
    nodes) + local rank; the group's rank 0 (TCPStore, HTTP) is on the leader, LWS_LEADER_ADDRESS
    (MASTER_ADDR when that is unset, as torchrun names it)."""
    try:
        nodes = int(env.get("LWS_GROUP_SIZE") or 1)
        index = int(env.get("LWS_WORKER_INDEX") or 0)
    except ValueError:
        raise RuntimeFailure(f"LeaderWorkerSet env: LWS_GROUP_SIZE={env.get('LWS_GROUP_SIZE')!r} and LWS_WORKER_INDEX="
                             f"{env.get('LWS_WORKER_INDEX')!r} must be integers") from None
    addr = env.get("LWS_LEADER_ADDRESS") or env.get("MASTER_ADDR") or ""
    if nodes < 1 or not 0 <= index < nodes:
        raise RuntimeFailure(f"LeaderWorkerSet env: LWS_WORKER_INDEX={index} outside 0..{nodes - 1} (LWS_GROUP_SIZE={nodes})")
    if world % nodes:
        raise RuntimeFailure(f"world of {world} ranks (max(--tp, --ep)) does not split over LWS_GROUP_SIZE={nodes} nodes")
    if nodes > 1 and not addr:
        raise RuntimeFailure(f"LeaderWorkerSet env: LWS_GROUP_SIZE={nodes} but no LWS_LEADER_ADDRESS (or MASTER_ADDR) "
                             "to meet the group's rank 0 at")
    addr = addr or "127.0.0.1"
    if port == 0:
        if nodes > 1:
            raise RuntimeFailure("--dist-port 0 (any free port) works on one node only; multi-node needs a fixed port")
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    return Rendezvous(addr, port, nodes, index, world // nodes)


def _child(local_rank: int, args, rdv: Rendezvous, device: str, entry: Callable[..., int]) -> None:
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    rank = rdv.node_index * rdv.local_world + local_rank
    lay = Layout(args.tp, args.ep, rank)
    dev = f"cuda:{local_rank}" if device.startswith("cuda") else "cpu"
    code = 1
    try:
        code = entry(args, lay, local_rank, dev, rdv)
    except RuntimeFailure as e:
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        code = e.exit_code
    except Exception as e:  # noqa: BLE001
        print(f"error: rank {rank}: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def launch(args, device: str, entry: Callable[..., int], env=os.environ) -> int:
    """Spawn this node's ranks; supervise them: the first to exit non-zero takes the others down (exit 1
    with the rank and its status); rank 0 exiting 0 (a drained SIGTERM) stops the rest and exits 0."""
    import multiprocessing as mp

    lay = Layout(args.tp, args.ep)
    if (p := lay.problem()):
        raise RuntimeFailure(p)
    rdv = rendezvous(lay.world, args.dist_port, env)
    if device.startswith("cuda"):
        n = torch.cuda.device_count()
        if rdv.local_world > n:
            raise RuntimeFailure(f"--tp {args.tp} --ep {args.ep} over {rdv.nodes} node(s) needs {rdv.local_world} GPUs "
                                 f"on this node; {n} visible")
    os.environ["NCCL_NVLS_ENABLE"] = "0"
    ctx = mp.get_context("spawn")
    procs = []
    for i in range(rdv.local_world):
        p = ctx.Process(target=_child, args=(i, args, rdv, device, entry), name=f"moe-rank-{i}", daemon=False)
        p.start()
        procs.append(p)
        log("launch", f"rank {rdv.node_index * rdv.local_world + i} pid {p.pid}", rank=rdv.node_index * rdv.local_world + i,
            pid=p.pid, node=rdv.node_index, master=f"{rdv.addr}:{rdv.port}")

    def forward_signal(sig, frame):
        first = procs[0]
        if first.is_alive():
            os.kill(first.pid, sig)  # rank 0 of this node drains (leader) or exits (worker)

    old = {s: signal.signal(s, forward_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        while True:
            for i, p in enumerate(procs):
                if p.exitcode is None:
                    continue
                rank = rdv.node_index * rdv.local_world + i
                if p.exitcode != 0 or i == 0:
                    if p.exitcode != 0:
                        how = f"signal {-p.exitcode}" if p.exitcode < 0 else f"status {p.exitcode}"
                        print(f"error: rank {rank} (pid {p.pid}) exited with {how}; stopping the other "
                              f"{len(procs) - 1} rank(s) of this node", file=sys.stderr, flush=True)
                    _stop(procs)
                    return 0 if p.exitcode == 0 else 1
            if all(p.exitcode == 0 for p in procs):
                return 0
            time.sleep(0.1)
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _stop(procs, grace: float = 5.0) -> None:
    for p in procs:
        if p.exitcode is None:
            p.terminate()
    t0 = time.time()
    for p in procs:
        p.join(timeout=max(grace - (time.time() - t0), 0.1))
        if p.exitcode is None:
            p.kill()
            p.join(timeout=2)
