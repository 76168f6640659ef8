"""Launch configurations of the Triton MoE experts and the default choice by rows per expert.

All numbers behind the defaults and thresholds are H200 measurements in bench/README.md.
A tuned table (JSON data written by `python -m moe_kernels.tune`, one file per GPU model) overrides
the defaults per shape and token bucket where present (choose_config; tables at the end of this file).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from dataclasses import dataclass
from fractions import Fraction


@dataclass(frozen=True)
class GemmConfig:
    """One GEMM on the tile kernel (triton_tile.py)."""
    block_n: int
    block_k: int
    num_warps: int      # (one_row: derived from block_n instead, 8 weight bytes per thread)
    num_stages: int
    group_m: int = 1
    swap: bool = False  # weights as the MMA's left operand (token rows as its N dimension)
    one_row: bool = False  # FP4, block_m=1: the one-row decode loop (triton_row.py)
    pipe: int = 4       # one_row: cp.async stages of its K loop

    def __post_init__(self):
        if self.one_row and self.pipe < 1:
            raise ValueError(f"the one-row loop needs at least one cp.async stage, got pipe={self.pipe}")


@dataclass(frozen=True)
class FragConfig:
    """FP4 fragment-order kernel (triton_frag.py): 8*nt token rows per block; each warp takes rt
    16-row weight tiles; wn x wk warps per program (wk: warps splitting K); pipe: cp.async stages."""
    nt: int = 1
    rt: int = 1
    wn: int = 4
    wk: int = 1
    pipe: int = 4
    group_m: int = 1


@dataclass(frozen=True)
class PrefillConfig:
    """One GEMM on the prefill kernel (triton_prefill.py), FP4 only: block_n weight rows per tile
    (gate/up: half gate rows, half the matching up rows, one accumulator), bkh packed bytes per K step
    (2 * bkh weights; fewer where K / 2 is not a multiple), num_stages for Triton's pipeliner;
    progs_per_sm: persistent programs per SM (0: one program per tile of the worst-case count)."""
    block_n: int = 128
    bkh: int = 64
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    swap: bool = False
    progs_per_sm: int = 0
    flatten: bool = False   # Triton's loop flattening across a persistent program's tiles
    ws: bool = False        # Triton's warp specialisation of the K loop

    def __post_init__(self):
        if self.bkh < 32 or self.bkh & (self.bkh - 1):
            raise ValueError(f"bkh is a power of two >= 32 (whole 32-byte K tiles), got {self.bkh}")
        if self.block_n < 32 or self.block_n & (self.block_n - 1):
            raise ValueError(f"block_n is a power of two >= 32, got {self.block_n}")


@dataclass(frozen=True)
class W8A8Config:
    """One GEMM on the FP8 W8A8 kernel (triton_w8a8.py; fp8 weights, TritonExperts(act_quant="fp8")):
    block_n weight rows per tile (gate/up: half gate, half up), 128-wide K steps."""
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    group_m: int = 8
    progs_per_sm: int = 0


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    gemm1: GemmConfig | FragConfig | PrefillConfig | W8A8Config
    gemm2: GemmConfig | FragConfig | PrefillConfig | W8A8Config
    # fragment kernel, mixed blocks (triton_align.align_mixed): gemm1/gemm2 (nt=2) run the 16-row blocks
    # of experts with > 8 rows, these two (nt=1) the one 8-row block of each other expert
    small: tuple[FragConfig, FragConfig] | None = None
    # tl.dot tiles (block_m rows) with 16-row fragment-kernel tail blocks (triton_align.align_split):
    # an expert's remainder of at most tail_rows rows past its full block_m blocks runs in these two
    # (nt=2) configs instead of one more, mostly padded, block_m-row tile. Needs the fragment copy.
    tail: tuple[FragConfig, FragConfig] | None = None
    tail_rows: int = 0
    # one token (pairwise) under PDL: launch the gate/up GEMM early too (its programs are then placed
    # beside the previous kernel's, which can stack them unevenly over the SMs; see default_config)
    gate_up_pdl: bool = True
    # Path switches. The defaults are the measured winners; False exists for same-run A/Bs (benches)
    # and bit-equality tests, so they are fields here rather than flags to flip on an experts object.
    pdl: bool = True            # one token: programmatic dependent launch where the device has it (pdl.py)
    fuse_finalize: bool = True  # one token: the down GEMM finalizes (False: a finalize launch)
    coalesce: bool = True       # fragment kernel: activations in the coalesced K order (False: natural)
    asm: bool = True            # tile kernel: inline-PTX FP4 decode (False: the portable Triton decode)

    @property
    def frag(self) -> bool:
        return isinstance(self.gemm1, FragConfig)


# 128-row tl.dot tiles of large batches (both GEMMs): the tile kernel (bf16 / fp8, and FP4's old path)
TILE128 = GemmConfig(128, 64, 8, 2, 8)
# FP4 large batches: the prefill kernel (triton_prefill.py), gate/up in one accumulator. H200 sweep at
# 4096 tokens (python -m moe_kernels.tune, 2026-12-02; bench/README.md): 256-row weight tiles as the
# wgmma A operand (swap), 32-byte K steps, 4 stages, for both GEMMs: whole forward 9.34 ms on the
# DeepSeek-V3 layer (old tiles 12.4-12.7), 2.24 ms on its TP8 shard (2.68). MXFP4's gate/up keeps
# 128-row tiles without swap: with swap at 256 rows its output was wrong (triton_prefill.check_config).
PREFILL = {"nvfp4": (PrefillConfig(256, 32, 8, 4, swap=True),) * 2,
           "mxfp4": (PrefillConfig(128, 64, 8, 3), PrefillConfig(256, 32, 8, 4, swap=True))}

# Above this many rows per expert, mixed blocks (align_mixed: 16-row blocks for experts with > 8 rows,
# one 8-row block for the others) instead of 8-row blocks only, of which an expert with 9-16 rows
# needs two (its weights read and decoded twice). Below, hardly any expert has > 8 rows (Poisson:
# P(rows > 8) < 4% at 4 rows), so the extra two launches of the mixed path are not worth it.
# Set from the 256-token runs, not measured at the boundary itself.
FRAG_NT1_ROWS = 6
# Up to this many rows per expert, mixed 8/16-row blocks; above, 16-row blocks only.
FRAG_MIXED_ROWS = 12
# Rows per expert up to which the fragment-order kernel (8 or 16 token rows per block, no shared-memory
# operand staging) is used; above, 128-row tensor-core tiles share activations between warps. Measured
# at 32 and 64 rows (1024, 2048 tokens: frag faster) and 128 (4096: frag 19.6-20.5 ms against
# 12.8-13.3 for tiles + tails); the crossover between 64 and 128 rows is interpolated, not measured.
FRAG_MAX_ROWS = 80

# Without the fragment copy: rows per expert up to which the one-row loop wins. It re-reads an
# expert's weights for every row, so it pays off only while nearly every expert has a single row.
ONE_ROW_MAX_ROWS = 1.5


# One token: below this many gate/up programs at four row tiles per warp (pairs x I / 64), the gate/up
# GEMM leaves SMs idle (132 on an H200); it then takes one row tile per warp with K split over four
# warps: four times the programs. H200, 2026-12-01 (python -m moe_kernels.tune, NVFP4): DeepSeek-V3
# TP8 (I=256, 32 programs) 42.6 -> 15.3 us, Qwen3-235B TP4 (I=384, 48) 29.5 -> 15.4 us; the whole
# DeepSeek-V3 layer (I=2048, 256 programs) keeps four tiles (64 us, 72% of its byte limit).
DECODE_MIN_PROGRAMS = 256


def default_config(fmt: str, num_pairs: int, num_experts: int, frag: bool = False,
                   inter: int | None = None) -> MoEConfig:
    """Tile choice by rows per touched expert (measured on an H200, see bench/README.md).

    FP4 with the fragment copy (frag=True), up to FRAG_MAX_ROWS rows per expert: the fragment-order
    kernel (triton_frag.py) with 8-row blocks (one token: pairwise, no alignment launches), above
    FRAG_NT1_ROWS mixed 8/16-row blocks, above FRAG_MIXED_ROWS 16-row blocks; beyond FRAG_MAX_ROWS
    128-row tiles with 16-row fragment tail blocks (align_split). Without it, FP4 decode runs the
    one-row cp.async loop with mma.sync (triton_row.py) and small batches 16-row tensor-core tiles.
    Large batches: 128-row tiles reuse each dequantised weight tile 128 times. Register counts were
    read from the compiled SM90 cubins (no spills)."""
    rows = num_pairs / max(1, min(num_experts, num_pairs))
    fp4 = fmt in ("nvfp4", "mxfp4")
    nt2 = FragConfig(2, 4, 1, 1, 3)   # 16-row blocks, four row tiles per warp
    if fp4 and frag and rows <= FRAG_MAX_ROWS:
        # (nt, rt, wn, wk, pipe[, group_m]) from the H200 sweeps in bench/README.md. MXFP4 GEMM1 keeps
        # two row tiles per warp with 8-row blocks at 2-8 rows per expert (four: more registers in its
        # 4-sub-step loop; slower there, faster at one token since the cheaper word decode).
        if rows <= 1.5:   # decode: few programs, so GEMM1 splits K over two warps to fill the SMs.
            # Launched early (PDL), GEMM1's programs are placed while the previous kernel's are still
            # resident: where three fit on an SM (NVFP4 with 4 stages), some SMs got three and others
            # none (+20% time). MXFP4's 3-stage programs take > 1/3 of an SM's shared memory (at most
            # two per SM): launched early. NVFP4 keeps 4 stages and waits for the previous kernel
            # (64.6 us against 65.5 with 5 stages launched early; one-token A/B in bench/README.md).
            # Down GEMM: one-warp programs (also the fused finalize's column blocks).
            # Small I (TP shards): more, K-split gate/up programs (DECODE_MIN_PROGRAMS).
            if inter is not None and num_pairs * inter // 64 < DECODE_MIN_PROGRAMS:
                g2 = FragConfig(1, 4, 1, 1, 3)
                return MoEConfig(8, FragConfig(1, 1, 1, 4, 4), g2, gate_up_pdl=False)
            if fmt == "nvfp4":
                return MoEConfig(8, FragConfig(1, 4, 1, 2, 4), FragConfig(1, 4, 1, 1, 3), gate_up_pdl=False)
            return MoEConfig(8, FragConfig(1, 4, 1, 2, 3), FragConfig(1, 4, 1, 1, 3))
        if rows <= FRAG_NT1_ROWS:   # 8-row token blocks: nearly every expert fits in one
            g1 = FragConfig(1, 4, 1, 2, 3) if fmt == "nvfp4" else FragConfig(1, 2, 2, 1, 3)
            g2 = FragConfig(1, 4, 1, 1, 4, 2) if fmt == "nvfp4" else FragConfig(1, 4, 2, 1, 3, 2)
            return MoEConfig(8, g1, g2)
        if rows <= FRAG_MIXED_ROWS:
            # mixed blocks: 16-row blocks for the experts with > 8 rows (one block instead of re-reading
            # and re-decoding their weights for a second 8-row block), one 8-row block for the others.
            # Measured at 256 tokens: 2% (NVFP4) / 6% (MXFP4) faster than 16-row blocks only; with every
            # row real, both block sizes cost ~1.4x the bandwidth limit per weight byte there
            small = ((FragConfig(1, 4, 1, 2, 3) if fmt == "nvfp4" else FragConfig(1, 2, 2, 1, 3)),
                     (FragConfig(1, 4, 1, 1, 4, 2) if fmt == "nvfp4" else FragConfig(1, 4, 2, 1, 3, 2)))
            return MoEConfig(16, nt2, nt2, small)
        # 16-row blocks only: at 1024 tokens (~32 rows per expert) 5.5 ms NVFP4 against 8.5 ms for
        # 32-row tl.dot tiles (MXFP4 5.9 / 6.6), at 2048 (~64 rows) 10.3 / 13.1-17.6 ms for 64-row
        # tiles with or without tails (MXFP4 10.9 / 10.9-13.8)
        return MoEConfig(16, nt2, nt2)
    if fp4 and frag:
        # 128-row tl.dot tiles; an expert's remainder of up to a quarter tile goes to 16-row tail blocks
        # instead of one more, mostly padded tile (align_split; at 4096 tokens about half the experts
        # have a few rows over 128: 12.8 ms against 16.4 ms for both formats, any bound from 32 to 96)
        return MoEConfig(128, *PREFILL[fmt], tail=(nt2, nt2), tail_rows=32)
    if not fp4:  # bf16 / fp8: not tuned; plain tiles
        if rows <= 16:
            return MoEConfig(16, GemmConfig(64, 128, 4, 4, swap=True), GemmConfig(64, 128, 4, 4, swap=True))
        return MoEConfig(64, GemmConfig(64, 64, 4, 3, 8), GemmConfig(128, 64, 8, 3, 8))
    if rows <= ONE_ROW_MAX_ROWS:
        return MoEConfig(1, GemmConfig(32, 64, 4, 1, one_row=True, pipe=4),
                         GemmConfig(32, 64, 4, 1, one_row=True, pipe=4))
    if rows <= 16:
        return MoEConfig(16, GemmConfig(64, 64, 4, 2), GemmConfig(64, 64, 4, 2))
    if rows <= 48:
        return MoEConfig(32, GemmConfig(64, 64, 4, 2, 4, swap=True), GemmConfig(128, 64, 8, 2, 4, swap=True))
    if rows <= 96:
        return MoEConfig(64, GemmConfig(64, 64, 4, 2, 8), GemmConfig(128, 64, 8, 2, 8))
    return MoEConfig(128, *PREFILL[fmt])


def default_w8a8_config(num_pairs: int, num_experts: int) -> MoEConfig:
    """FP8 W8A8 (TritonExperts(act_quant="fp8")) by rows per touched expert. Not yet measured on a GPU:
    block sizes by analogy with the tile kernel's (16-row blocks for decode, 64 / 128 for prefill)."""
    rows = num_pairs / max(1, min(num_experts, num_pairs))
    if rows <= 16:
        return MoEConfig(16, W8A8Config(128, 4, 4), W8A8Config(128, 4, 4))
    if rows <= 48:
        return MoEConfig(32, W8A8Config(128, 4, 4), W8A8Config(128, 4, 4))
    if rows <= 96:
        return MoEConfig(64, W8A8Config(128, 4, 3), W8A8Config(128, 4, 3))
    return MoEConfig(128, W8A8Config(256, 8, 3), W8A8Config(256, 8, 3))


# ------------------------------------------------------------------------------- tuned tables (data)
# A table written by `python -m moe_kernels.tune` (kernels/moe_kernels/tune.py) for one GPU model:
#   {"format_version": 1, "device": "NVIDIA H200",
#    "entries": {"nvfp4 E=256,H=7168,I=256,topk=8": {"1": {config}, "8": {...}, ...}}, "meta": {...}}
# Keys of an entry are token counts (the buckets the sweep ran); a forward of T tokens takes the bucket
# nearest to T in ratio (log distance; a tie goes to the smaller), if within TUNED_REACH of T. A shape, format or top-k with no
# entry, or a config this experts object cannot run (fragment kernel without the fragment copy), falls
# back to default_config. The committed table (configs/NVIDIA_H200.json) holds the H200 sweeps of 2026-12-01.
TABLE_VERSION = 1
TABLE_ENV = "MOE_KERNELS_TUNED_CONFIGS"   # a table file, or a directory of <device>.json files
TABLE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "configs")


def device_file_name(device_name: str) -> str:
    """'NVIDIA H200' -> 'NVIDIA_H200.json' (the way sglang names its per-device files)."""
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", device_name.strip()) + ".json"


def table_path(device_name: str, env: dict | None = None, table_dir: str = TABLE_DIR) -> str:
    """Where the table of this GPU model is looked for: $MOE_KERNELS_TUNED_CONFIGS (a file, or a
    directory holding <device>.json), else kernels/moe_kernels/configs/<device>.json."""
    env = os.environ if env is None else env
    p = env.get(TABLE_ENV, "")
    if p:
        return os.path.join(p, device_file_name(device_name)) if os.path.isdir(p) else p
    return os.path.join(table_dir, device_file_name(device_name))


def shape_key(fmt: str, num_experts: int, hidden: int, inter: int, top_k: int) -> str:
    return f"{fmt} E={num_experts},H={hidden},I={inter},topk={top_k}"


def config_to_dict(cfg: MoEConfig) -> dict:
    def gemm(g):
        if isinstance(g, FragConfig):
            return {"kind": "frag", **dataclasses.asdict(g)}
        if isinstance(g, PrefillConfig):
            return {"kind": "prefill", **dataclasses.asdict(g)}
        if isinstance(g, W8A8Config):
            return {"kind": "w8a8", **dataclasses.asdict(g)}
        return {"kind": "tile", **dataclasses.asdict(g)}
    d = {"block_m": cfg.block_m, "gemm1": gemm(cfg.gemm1), "gemm2": gemm(cfg.gemm2)}
    d["small"] = None if cfg.small is None else [gemm(g) for g in cfg.small]
    d["tail"] = None if cfg.tail is None else [gemm(g) for g in cfg.tail]
    for f in ("tail_rows", "gate_up_pdl", "pdl", "fuse_finalize", "coalesce", "asm"):
        d[f] = getattr(cfg, f)
    return d


def config_from_dict(d: dict) -> MoEConfig:
    """Inverse of config_to_dict; unknown or missing fields are errors (a table of another version)."""
    def gemm(g):
        g = dict(g)
        kind = g.pop("kind", None)
        cls = {"frag": FragConfig, "tile": GemmConfig, "prefill": PrefillConfig, "w8a8": W8A8Config}.get(kind)
        if cls is None:
            raise ValueError(f"unknown GEMM config kind {kind!r}")
        names = {f.name for f in dataclasses.fields(cls)}
        if set(g) - names:
            raise ValueError(f"unknown {kind} config fields {sorted(set(g) - names)}")
        return cls(**g)
    d = dict(d)
    names = {f.name for f in dataclasses.fields(MoEConfig)}
    if set(d) - names or "block_m" not in d or "gemm1" not in d or "gemm2" not in d:
        raise ValueError(f"not a MoEConfig: fields {sorted(d)}")
    for f in ("gemm1", "gemm2"):
        d[f] = gemm(d[f])
    for f in ("small", "tail"):
        if d.get(f) is not None:
            d[f] = tuple(gemm(g) for g in d[f])
    return MoEConfig(**d)


def load_table(path: str) -> dict | None:
    """The table at path, None when there is none. A file that exists but is not a table of this
    version raises (a broken table is a setup error, not a reason to run untuned silently)."""
    if not path or not os.path.isfile(path):
        return None
    with open(path) as f:
        table = json.load(f)
    if not isinstance(table, dict) or table.get("format_version") != TABLE_VERSION \
            or not isinstance(table.get("entries"), dict):
        raise ValueError(f"{path}: not a tuned-config table of format_version {TABLE_VERSION}")
    return table


def tuned_configs(table: dict | None, fmt: str, num_experts: int, hidden: int, inter: int,
                  top_k: int) -> dict[int, MoEConfig]:
    """{token bucket: MoEConfig} of one shape from a loaded table ({} when absent)."""
    if not table:
        return {}
    entry = table.get("entries", {}).get(shape_key(fmt, num_experts, hidden, inter, top_k))
    if not entry:
        return {}
    return {int(t): config_from_dict(c["config"] if "config" in c else c) for t, c in entry.items()}


def nearest_bucket(buckets, num_tokens: int) -> int:
    """The bucket nearest to num_tokens in ratio (log distance); a tie goes to the smaller bucket."""
    t = max(1, int(num_tokens))
    return min(sorted(buckets), key=lambda b: Fraction(max(t, b), max(1, min(t, b))))   # exact ratio


# A tuned bucket stands for token counts within this factor of it: kernels change with rows per expert
# (a 64-token winner ran 4096 tokens 1.6-1.9x slower than the default on the H200, 2026-12-01), so
# further away the default's rules decide.
TUNED_REACH = 2


def choose_config(fmt: str, num_pairs: int, num_experts: int, frag: bool = False, *,
                  top_k: int | None = None, tuned: dict[int, MoEConfig] | None = None,
                  inter: int | None = None) -> MoEConfig:
    """The tuned config of the nearest token bucket (within TUNED_REACH of the batch's token count)
    when `tuned` (tuned_configs of this shape and top_k) has one this object can run, else
    default_config."""
    if tuned and top_k:
        t = max(1, num_pairs // top_k)
        b = nearest_bucket(tuned, t)
        cfg = tuned[b] if max(t, b) <= TUNED_REACH * min(t, b) else None
        if cfg is not None and (frag or not (cfg.frag or cfg.tail is not None or cfg.small is not None)):
            return cfg
    return default_config(fmt, num_pairs, num_experts, frag, inter)
