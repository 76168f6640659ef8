"""Sizing: does a checkpoint fit a layout on a GPU class, and which is the smallest layout that does. Pure.

Per GPU of a replica (one rank per GPU, tensor parallel across all of them):
  weights    the checkpoint's tensor bytes from the safetensors headers, placed as tensor parallelism
             places them (checkpoint.tp_placement, by tensor name): the tensors every rank holds whole
             (norms, MLA q_a/kv_a projections, routers: replicatedBytes) on every GPU, k/v projections
             over at most num_key_value_heads GPUs (kvHeadBytes), the rest / GPUs. DeepSeek-V3 NVFP4 at
             tp 8: 1.9 GiB whole + 378.9 / 8 = 49.3 GiB per GPU, what the bundled runtime's ShardPlan
             loads on each rank (an even split would say 47.6);
  KV cache   maxModelLen x maxConcurrency tokens of KV for every layer:
             MLA (kv_lora_rank set): (kv_lora_rank + qk_rope_head_dim) elements per token and layer,
               the same latent on every rank (MLA has one KV head: tensor parallelism does not split it);
             otherwise 2 (K and V) x ceil(num_key_value_heads / tp) x head_dim (KV heads are replicated
               when tp exceeds their count);
             1 byte per element when the checkpoint asks for an FP8 KV cache, else 2 (bf16);
  workspace  activations of one chunked-prefill step plus a fixed allowance for the CUDA context,
             NCCL buffers and CUDA graphs;
against MEMORY_FRACTION of the GPU's memory (the share engines give themselves by default:
vLLM --gpu-memory-utilization 0.9; sglang's mem_fraction_static is at or below it).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .checkpoint import CheckpointInfo
from .gpu import GpuClass

GiB = 1024 ** 3
MiB = 1024 ** 2
MEMORY_FRACTION = 0.90
FIXED_WORKSPACE = 2 * GiB  # CUDA context, NCCL, CUDA graphs, allocator slack
PREFILL_CHUNK_TOKENS = 8192  # engines' default chunked-prefill size (vLLM max_num_batched_tokens 8192)
ACTIVATION_BUFFERS = 16  # hidden-sized bf16 buffers live at once per token during a prefill step
DEFAULT_MAX_MODEL_LEN = 8192  # when neither the spec nor config.json says
DEFAULT_MAX_CONCURRENCY = 1  # engines check at start-up that one sequence of max length fits


def gib(n: float) -> str:
    return f"{n / GiB:.1f} GiB"


@dataclass(frozen=True)
class KvShape:
    per_token_per_gpu: int | None  # bytes of KV per token on one GPU (all layers); None: unknown
    how: str


def kv_per_token(ckpt: CheckpointInfo, tp: int) -> KvShape:
    layers = ckpt.numLayers
    elem = 1 if ckpt.kvCacheFp8 else 2
    dtype = "fp8" if ckpt.kvCacheFp8 else "bf16"
    if not layers:
        return KvShape(None, "KV cache size unknown (config.json has no num_hidden_layers)")
    if ckpt.kvLoraRank:
        per_layer = (ckpt.kvLoraRank + (ckpt.qkRopeHeadDim or 0)) * elem
        return KvShape(layers * per_layer, f"MLA {layers} layers x ({ckpt.kvLoraRank} + {ckpt.qkRopeHeadDim or 0}) "
                                           f"x {elem} B ({dtype}), not split by tp")
    if ckpt.numKeyValueHeads and ckpt.headDim:
        heads = -(-ckpt.numKeyValueHeads // tp)
        per_layer = 2 * heads * ckpt.headDim * elem
        return KvShape(layers * per_layer, f"{layers} layers x 2 x {heads} of {ckpt.numKeyValueHeads} KV heads per GPU "
                                           f"x {ckpt.headDim} x {elem} B ({dtype})")
    return KvShape(None, "KV cache size unknown (config.json has neither kv_lora_rank nor num_key_value_heads/head_dim)")


@dataclass(frozen=True)
class Fit:
    gpus: int  # GPUs per replica (= tp)
    nodes: int
    memory: int  # bytes per GPU
    weights: int  # per GPU
    kv: int  # per GPU
    workspace: int
    tokens: int  # KV tokens sized for
    kv_how: str
    replicated: int = 0  # of `weights`: the bytes every GPU holds whole

    @property
    def need(self) -> int:
        return self.weights + self.kv + self.workspace

    @property
    def usable(self) -> int:
        return int(self.memory * MEMORY_FRACTION)

    @property
    def fits(self) -> bool:
        return self.need <= self.usable

    def weights_text(self) -> str:
        whole = f" (incl. {gib(self.replicated)} every GPU holds whole)" if self.replicated and self.gpus > 1 else ""
        return f"{gib(self.weights)} weights{whole}"

    def numbers(self) -> str:
        return (f"per GPU {self.weights_text()} + {gib(self.kv)} KV cache ({self.tokens} tokens; {self.kv_how})"
                f" + {gib(self.workspace)} workspace = {gib(self.need)} "
                f"{'<=' if self.fits else '>'} {gib(self.usable)} usable ({MEMORY_FRACTION:.0%} of {gib(self.memory)})")


def max_model_len(ckpt: CheckpointInfo, requested: int | None) -> int:
    return requested or ckpt.maxPositionEmbeddings or DEFAULT_MAX_MODEL_LEN


def weights_per_gpu(ckpt: CheckpointInfo, gpus: int) -> tuple[int, int]:
    """(bytes of weights on one GPU of a `gpus`-way tensor-parallel replica, of which held whole):
    replicatedBytes on every GPU, kvHeadBytes over min(gpus, num_key_value_heads) GPUs, the rest
    over all of them (each rounded up)."""
    whole = min(max(ckpt.replicatedBytes, 0), ckpt.totalBytes)
    kv = min(max(ckpt.kvHeadBytes, 0), ckpt.totalBytes - whole)
    rest = ckpt.totalBytes - whole - kv
    kv_ways = min(gpus, ckpt.numKeyValueHeads) if ckpt.numKeyValueHeads else gpus
    return whole + -(-kv // max(kv_ways, 1)) + -(-rest // gpus), whole


def estimate(ckpt: CheckpointInfo, memory: int, gpus: int, nodes: int = 1, *, max_len: int | None = None,
             concurrency: int | None = None) -> Fit:
    """The memory one GPU of a `gpus`-GPU replica needs (tensor parallel over all of them)."""
    tokens = max_model_len(ckpt, max_len) * (concurrency or DEFAULT_MAX_CONCURRENCY)
    kv = kv_per_token(ckpt, gpus)
    kv_bytes = (kv.per_token_per_gpu or 0) * tokens
    hidden = ckpt.hiddenSize or 0
    workspace = FIXED_WORKSPACE + PREFILL_CHUNK_TOKENS * hidden * 2 * ACTIVATION_BUFFERS
    weights, whole = weights_per_gpu(ckpt, gpus)
    return Fit(gpus=gpus, nodes=nodes, memory=memory, weights=weights, kv=kv_bytes,
               workspace=workspace, tokens=tokens, kv_how=kv.how, replicated=whole)


def memory_bytes(gpu: GpuClass) -> int | None:
    return gpu.memoryMiB * MiB if gpu.memoryMiB else None


def layouts(gpus_per_node: int, max_nodes: int, multiple_of: int = 1) -> list[tuple[int, int]]:
    """Candidate (GPUs per replica, nodes) in the order sizing tries them: powers of two up to one
    node's GPUs, then whole nodes (2, 3, ... x GPUs per node). Each is a multiple of `multiple_of`
    (ep and dp must divide tp)."""
    out: list[tuple[int, int]] = []
    n = 1
    while n <= gpus_per_node:
        out.append((n, 1))
        n *= 2
    if gpus_per_node and (gpus_per_node, 1) not in out:
        out.append((gpus_per_node, 1))
    for nodes in range(2, max_nodes + 1):
        out.append((gpus_per_node * nodes, nodes))
    return [(g, k) for g, k in out if g % multiple_of == 0]


@dataclass(frozen=True)
class Choice:
    fit: Fit | None  # the smallest layout that fits, None when none does
    largest: Fit | None  # the largest layout tried (the numbers of a refusal)
    reason: str


def _where(f: Fit) -> str:
    return f"{f.nodes} nodes x {f.gpus // f.nodes} GPUs" if f.nodes > 1 else f"{f.gpus} GPU{'s' if f.gpus > 1 else ''}"


def smallest_fit(ckpt: CheckpointInfo, gpu: GpuClass, gpus_per_node: int, max_nodes: int, *,
                 max_len: int | None = None, concurrency: int | None = None, multiple_of: int = 1,
                 refuses: Callable[[Fit], str | None] | None = None) -> Choice:
    """The smallest layout that fits. `refuses` (optional): why the engine would refuse a layout that fits
    (a message) or None; a refused layout is passed over, the next one that fits and is accepted is chosen,
    and the reason says which were passed over and why. When every layout that fits is refused, the choice
    is None and the reason gives the first refusal (which says what works instead)."""
    memory = memory_bytes(gpu)
    if memory is None:
        return Choice(None, None, f"GPU memory of {gpu.key()} unknown (no nvidia.com/gpu.memory label)")
    tried = [estimate(ckpt, memory, g, k, max_len=max_len, concurrency=concurrency)
             for g, k in layouts(gpus_per_node, max_nodes, multiple_of)]
    if not tried:
        return Choice(None, None, f"no layout of {gpus_per_node} GPUs per node is a multiple of {multiple_of}")
    refused: list[tuple[Fit, str]] = []
    for i, f in enumerate(tried):
        if f.fits:
            why_not = refuses(f) if refuses else None
            if why_not:
                refused.append((f, why_not))
                continue
            prev = tried[i - 1] if i else None
            smaller = f" (tp={prev.gpus} would need {gib(prev.need)} per GPU)" if prev and not prev.fits else ""
            if refused:
                passed = "; ".join(f"tp={r.gpus} ({_where(r)}) fits but {msg}" for r, msg in refused)
                return Choice(f, tried[-1], f"tp={f.gpus} ({_where(f)}) is the smallest layout that fits "
                                            f"{gib(ckpt.totalBytes)} of weights on {gpu.key()} and that the engine "
                                            f"accepts: {f.numbers()}; passed over: {passed}")
            return Choice(f, tried[-1], f"tp={f.gpus} ({_where(f)}) is the smallest layout that fits "
                                        f"{gib(ckpt.totalBytes)} of weights on {gpu.key()}: {f.numbers()}{smaller}")
    if refused:
        first, msg = refused[0]
        others = ", ".join(str(r.gpus) for r, _ in refused[1:])
        also = f" (as are the larger layouts that fit, tp={others})" if others else ""
        return Choice(None, tried[-1], f"tp={first.gpus} ({_where(first)}) is the smallest layout that fits "
                                       f"{gib(ckpt.totalBytes)} of weights on {gpu.key()} ({first.numbers()}), but the "
                                       f"engine refuses it{also}: {msg}")
    last = tried[-1]
    span = f"{last.nodes} nodes x {gpus_per_node} GPUs" if last.nodes > 1 else \
        f"{last.gpus} GPU{'s' if last.gpus > 1 else ''}"
    return Choice(None, last, f"does not fit even on {span} (tp={last.gpus}): {gib(ckpt.totalBytes)} of weights, "
                              f"{last.numbers()}")


# ---------------------------------------------------------------------------------------------
# Admission: a layout the user gave that cannot fit on any GPU the spec allows.
#
# The cluster's nodes are not consulted (a spec may be applied before its nodes join); the memory is
# the largest of the GPUs the spec allows, from moe_core.gpu.PRODUCTS: the pinned gpu.product, else
# the largest product of each allowed architecture (of every one when none is given). A layout that
# does not fit on the largest GPU of a family fits on none of it (the need per GPU does not depend
# on the GPU). Thor and GB10 have no memory in that table (their GPU shares the system's memory): for
# refusing, their 128 GiB of unified memory is an upper bound of what the GPU can hold; planning
# never uses it. A GPU of unknown memory, or a checkpoint of unknown size, is never a refusal.

UNIFIED_MEMORY_BOUND_MIB = {"sm110": 128 * 1024, "sm121": 128 * 1024}  # Jetson Thor, DGX Spark GB10


def largest_gpus(product: str | None, families: list[str] | None) -> list[GpuClass]:
    """The GPUs an admission check sizes against: the product, else the largest of each family."""
    from .gpu import FAMILIES, PRODUCTS, GpuClassError, from_name

    if product:
        try:
            return [from_name(product)]
        except GpuClassError:
            return [GpuClass(family="unknown", vendor="nvidia", product=product)]  # memory unknown: not judged
    out = []
    for fam in families or list(FAMILIES):
        members = [from_name(p) for p, (_, f, _, _) in PRODUCTS.items() if f == fam]
        if not members:
            out.append(GpuClass(family=fam, vendor="amd" if fam.startswith("gfx") else "nvidia", product=""))
            continue
        out.append(max(members, key=lambda g: g.memoryMiB or 0))
    return out


def bound_bytes(gpu: GpuClass) -> int | None:
    """The GPU's memory for an admission refusal: the table's, else the unified-memory bound."""
    mib = gpu.memoryMiB or UNIFIED_MEMORY_BOUND_MIB.get(gpu.family)
    return mib * MiB if mib else None


def layout_refusal(ckpt: CheckpointInfo, gpus_allowed: list[GpuClass], gpus: int, nodes: int = 1, *,
                   max_len: int | None = None, concurrency: int | None = None,
                   gpus_per_node: int = 8) -> str | None:
    """Why a replica of `gpus` GPUs (tp = gpus) cannot hold the checkpoint on any of `gpus_allowed`,
    with the need per GPU, each GPU's usable memory and the smallest tp that would fit on the largest;
    None when one of them holds it or when it cannot be judged (checkpoint size or a GPU's memory unknown)."""
    if not ckpt.totalBytes or not gpus_allowed or gpus < 1:
        return None
    memories = [(g, bound_bytes(g)) for g in gpus_allowed]
    if any(m is None for _, m in memories):
        return None
    fits = [estimate(ckpt, m, gpus, nodes, max_len=max_len, concurrency=concurrency) for _, m in memories]
    if any(f.fits for f in fits):
        return None
    f = fits[0]  # the need per GPU is the same on every GPU
    usable = ", ".join(f"{g.product or g.family} {gib(x.usable)}" + ("" if g.memoryMiB else " (of unified memory)")
                       for (g, _), x in zip(memories, fits))
    g_max, m_max = max(memories, key=lambda gm: gm[1])
    hint = ""
    for n, k in layouts(gpus_per_node, 8):
        if n > gpus and (bigger := estimate(ckpt, m_max, n, k, max_len=max_len, concurrency=concurrency)).fits:
            where = f" ({k} nodes x {n // k} GPUs)" if k > 1 else ""
            hint = f"; tp={n}{where} would fit on {g_max.product or g_max.family} ({gib(bigger.need)} per GPU)"
            break
    span = f"{gpus} GPUs over {nodes} nodes" if nodes > 1 else f"{gpus} GPU{'s' if gpus > 1 else ''}"
    return (f"tp={gpus} ({span} per replica) cannot hold {gib(ckpt.totalBytes)} of weights on any allowed GPU: "
            f"per GPU {f.weights_text()} + {gib(f.kv)} KV cache ({f.tokens} tokens; {f.kv_how}) + "
            f"{gib(f.workspace)} workspace = {gib(f.need)} > usable ({MEMORY_FRACTION:.0%} of memory) {usable}{hint}; "
            "leave parallelism.tp and gpusPerReplica unset to size it, or give more GPUs")
