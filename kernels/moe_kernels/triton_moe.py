"""Triton MoE experts for SM90 (and any NVIDIA GPU Triton supports): weight-only (W4A16 / W8A16).

Pipeline per forward (no host synchronisation, CUDA-graph capturable):
  align (triton_align.py) -> GEMM1 (gathered x @ [gate; up]^T [+ w13_bias], the activation fused in
  the epilogue: SiLU(gate)*up or gpt-oss's clamped SwiGLU; rows in expert-padded order) -> GEMM2
  (act @ w2^T [+ w2_bias], un-weighted rows = gemm2_out)
  -> finalize (weights, top-k sum, shared add; triton_finalize.py), or hand gemm2_out over (deferred).

Which kernel runs is chosen per batch by rows per expert (triton_config.default_config). FP4 with up
to FRAG_MAX_ROWS rows per expert runs on the fragment-order kernel (triton_frag.py; its own weight
copy, packed in __init__). There, one token skips the alignment (pairwise blocks; GEMM1 and GEMM2
chained with programmatic dependent launch on SM90, pdl.py; GEMM2 does the finalize itself: two
launches), ~8 rows per expert mix 16-row and 8-row blocks (align_mixed), more rows take 16-row
blocks. Above: 128-row tl.dot tiles (triton_tile.py, storage in triton_layout.py) for the rows that
fill them, and an expert's remainder of up to 32 rows in 16-row fragment blocks (align_split).
History and measurements: bench/README.md.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch
import triton

from .experts import ExpertWeights
from .finalize import DeferredMoEOutput, _check as _check_finalize, moe_finalize_fuse_shared
from .pdl import pdl_supported
from .reference import (ACT_QUANTS, ACTIVATIONS, OAI_ALPHA, OAI_LIMIT, _check_inputs, check_activation,
                        expert_biases)
from .triton_align import TAIL_M, Alignment, align_by_expert, align_mixed, align_split
from .triton_config import (FragConfig, GemmConfig, MoEConfig, PrefillConfig, W8A8Config,  # noqa: F401
                            choose_config, default_config, default_w8a8_config, load_table, table_path,
                            tuned_configs)
from .triton_frag import STEP_K, FragWeights, coalesce_activations, frag_asm_args, frag_moe_kernel
from .triton_layout import FMT_FP8, FMT_ID, FMT_NVFP4, FP4_KT, GROUP, Operand, prepare
from .triton_prefill import check_config, prefill_gemm_kernel, step_bytes
from .triton_tile import moe_gemm_kernel
from .triton_w8a8 import GROUP_K, w8a8_gemm_kernel

# The CPU interpreter (TRITON_INTERPRET=1, used to debug without a GPU) multiplies bf16 dot operands
# wrongly (Triton 3.9) and cannot run inline PTX; there the dots run on fp32 copies and the FP4
# decode takes the portable path. Never set on a GPU.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


def _fit(dim: int, want: int, minimum: int) -> int:
    """Largest power of two <= want dividing dim (>= minimum)."""
    b = want
    while b >= minimum:
        if dim % b == 0:
            return b
        b //= 2
    raise ValueError(f"dimension {dim} is not a multiple of {minimum}")


def _sm_count(device) -> int:
    """Multiprocessors of the device (the interpreter: 4, so persistent loops run several tiles)."""
    if _INTERPRET or device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def _constant(cache: dict, key, make):
    """cache[key], made on first use. Not kept when made during CUDA-graph capture: it would live in
    the graph's private pool (the captured graph keeps its own copy alive)."""
    value = cache.get(key)
    if value is None:
        value = make()
        if not torch.cuda.is_current_stream_capturing():
            cache[key] = value
    return value


@dataclass
class _FusedFinalize:
    """The one-token finalize done by the pairwise down GEMM (triton_frag._arrive_and_finalize)."""
    weights: torch.Tensor          # topk_weights [1, K], fp32 or bf16
    shared: torch.Tensor | None    # shared expert's output [1, H] bf16
    out: torch.Tensor              # [1, H] bf16, the layer's output
    counts: torch.Tensor           # int32 arrival counter per column block, zero between forwards
    routed_scale: float


class TritonExperts:
    """Weight-only (W4A16 / W8A16 / bf16) grouped-GEMM MoE experts in Triton. CUDA tensors only.

    config: one MoEConfig for every batch (sweeps, A/Bs), or None: per batch, the tuned table's config
    where there is one (triton_config.choose_config), else default_config.
    frag: keep the fragment-order FP4 copy (None: where the kernel applies; False saves its memory).
    tuned_table: a loaded tuned-config table (triton_config.load_table), {} for none, or None: the
    table of this GPU model where one was written (triton_config.table_path; python -m moe_kernels.tune).
    activation: "silu" or "swiglu_oai" (alpha, limit; reference.activate); expert biases come from
    weights.extras (w13_bias, w2_bias), added in the GEMM epilogues in fp32."""

    activations = ACTIVATIONS
    formats = frozenset({"bf16", "fp8", "nvfp4", "mxfp4"})
    supports_bias = True

    @staticmethod
    def shape_problem(weights: ExpertWeights) -> str | None:
        """Why these experts' dimensions cannot run here (FP4: whole packed scale groups), else None;
        the runtime asks before its self-test, so a model it cannot run falls back to the next backend."""
        fmt_id, h, i = FMT_ID[weights.format], weights.hidden_size, weights.intermediate_size
        group = GROUP[fmt_id]
        if fmt_id >= FMT_NVFP4 and ((h // 2) % group or (i // 2) % group):
            return f"{weights.format} needs H/2 and I/2 to be multiples of {group} (H={h}, I={i})"
        return None

    def __init__(self, weights: ExpertWeights, config: MoEConfig | None = None, frag: bool | None = None,
                 tuned_table: dict | None = None, *, activation: str = "silu", alpha: float = OAI_ALPHA,
                 limit: float = OAI_LIMIT, act_quant: str | None = None):
        # act_quant="fp8": FP8 W8A8 (triton_w8a8.py) for fp8 block weights, activations quantized per
        # token and 128-group (reference.act_fp8_roundtrip); lossy, so only when asked for
        if act_quant is not None:
            if act_quant not in ACT_QUANTS:
                raise ValueError(f"unknown activation quantization {act_quant!r}; known: {sorted(ACT_QUANTS)}")
            if weights.format != "fp8":
                raise ValueError(f"act_quant='fp8' (W8A8) needs fp8 block weights, got {weights.format}")
            h, i = weights.hidden_size, weights.intermediate_size
            if h % GROUP_K or i % GROUP_K:
                raise ValueError(f"W8A8 needs H and I multiples of {GROUP_K}, got H={h}, I={i}")
        self.act_quant = act_quant
        if weights.device.type != "cuda" and not _INTERPRET:
            raise ValueError("TritonExperts needs the expert weights on a CUDA device")
        check_activation(activation, self.activations, "TritonExperts")
        self.activation, self.alpha, self.limit = activation, float(alpha), float(limit)
        self.act_id = 1 if activation == "swiglu_oai" else 0
        b13, b2 = expert_biases(weights)
        dev = weights.device
        self.b13 = None if b13 is None else b13.to(dev, torch.float32).contiguous()
        self.b2 = None if b2 is None else b2.to(dev, torch.float32).contiguous()
        self._no_bias = torch.zeros(1, dtype=torch.float32, device=dev)   # (pointer argument without BIAS)
        # (the ExpertWeights are not kept: only the re-laid-out copies below live on the GPU)
        self.fmt = weights.format
        self.fmt_id = FMT_ID[weights.format]
        self.config = config
        e, h, i = weights.num_experts, weights.hidden_size, weights.intermediate_size
        self.E, self.H, self.I = e, h, i
        if (problem := self.shape_problem(weights)) is not None:
            raise ValueError(problem)
        self.w13 = prepare(weights.w13, self.fmt)
        self.w2 = prepare(weights.w2, self.fmt)
        # FP4: the fragment-order copy for <= FRAG_MAX_ROWS rows per expert and for tail blocks.
        # A second copy of the weights (same bytes again); frag=False keeps only the tiled one.
        fits = (self.fmt_id >= FMT_NVFP4 and i % 16 == 0 and h % 16 == 0
                and h % STEP_K[self.fmt] == 0 and i % STEP_K[self.fmt] == 0)
        if frag and not fits:
            raise ValueError(f"the fragment kernel needs FP4 weights with H, I multiples of "
                             f"{STEP_K.get(self.fmt, 128)} (got {self.fmt}, H={h}, I={i})")
        # mma.sync bf16 and the bf16x2 decode need SM80+; the interpreter cannot run inline PTX
        sm80 = weights.device.type == "cuda" and torch.cuda.get_device_capability(weights.device)[0] >= 8
        if frag and not sm80 and not _INTERPRET:
            raise ValueError("the fragment kernel needs an SM80+ NVIDIA GPU")
        self.frag = bool(fits if frag is None else frag) and sm80 and not _INTERPRET
        self.f13 = FragWeights.pack(weights.w13, self.fmt) if self.frag else None
        self.f2 = FragWeights.pack(weights.w2, self.fmt) if self.frag else None
        # the one-token forward can chain its launches with PDL (MoEConfig.pdl decides whether it does)
        self.can_pdl = self.frag and pdl_supported(weights.device)
        self._pairwise_perm: dict = {}
        # one token: the fused finalize's arrival counters (one int32 per column block, zero between
        # forwards: the last program of a block resets its own), per device. Forwards of this object
        # must therefore not run concurrently on two streams.
        self._fin_counts: dict = {}
        if tuned_table is None and weights.device.type == "cuda":
            tuned_table = load_table(table_path(torch.cuda.get_device_name(weights.device)))
        self.tuned_table = tuned_table or {}
        self._tuned: dict = {}   # top_k -> {token bucket: MoEConfig} of this shape

    def config_for(self, num_pairs: int, top_k: int | None = None) -> MoEConfig:
        """The config a forward of num_pairs (token, expert) pairs runs (top_k: for the tuned table)."""
        if self.config is not None:
            return self.config
        if getattr(self, "act_quant", None):
            return default_w8a8_config(num_pairs, self.E)
        tuned = None
        if top_k and getattr(self, "tuned_table", None):   # (bench stubs are made without __init__)
            if top_k not in self._tuned:
                self._tuned[top_k] = tuned_configs(self.tuned_table, self.fmt, self.E, self.H, self.I, top_k)
            tuned = self._tuned[top_k]
        return choose_config(self.fmt, num_pairs, self.E, self.frag, top_k=top_k, tuned=tuned, inter=self.I)

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, *,
                shared_output: torch.Tensor | None = None, routed_scale: float = 1.0,
                defer_finalize: bool = False):
        _check_inputs(x, topk_weights, topk_ids, self.H)
        t, top_k = topk_ids.shape
        num_pairs = t * top_k
        cfg = self.config_for(num_pairs, top_k)
        if (cfg.frag or cfg.tail is not None) and not self.frag:
            raise ValueError("a fragment-kernel config (or tail blocks, MoEConfig.tail) needs TritonExperts(frag=True) "
                             "FP4 weights on an SM80+ GPU")
        x = x.to(torch.bfloat16).contiguous()
        if cfg.frag:
            return self._forward_frag(cfg, x, topk_weights, topk_ids, shared_output, routed_scale, defer_finalize)
        if cfg.tail is not None and num_pairs:
            return self._forward_split(cfg, x, topk_weights, topk_ids, shared_output, routed_scale, defer_finalize)
        al = align_by_expert(topk_ids, self.E, cfg.block_m)
        inter, gemm2_out = self._buffers(al.p_max, x.device)
        if num_pairs:
            self._launch(self.w13, x, inter, al, self.I, self.H, cfg.gemm1, True, top_k, num_pairs, cfg.asm)
            self._launch(self.w2, inter, gemm2_out, al, self.H, self.I, cfg.gemm2, False, top_k, num_pairs, cfg.asm)
        return self._finish(gemm2_out, topk_weights, al.perm, shared_output, routed_scale, defer_finalize)

    __call__ = forward

    def _forward_frag(self, cfg: MoEConfig, x, topk_weights, topk_ids, shared_output, routed_scale, defer_finalize):
        t, top_k = topk_ids.shape
        num_pairs = t * top_k
        if cfg.small is not None:   # two block sizes (16-row blocks first in the row space)
            if cfg.block_m != 16 or cfg.gemm1.nt != 2 or cfg.small[0].nt != 1:
                raise ValueError("mixed fragment configs: 16-row blocks (nt=2) and small (nt=1) configs")
            mixed = align_mixed(topk_ids, self.E)
            parts = [(mixed.big, cfg.gemm1, cfg.gemm2), (mixed.small, *cfg.small)]
            perm, p_max, pairwise = mixed.perm, mixed.p_max, False
        else:
            if t == 1 and cfg.block_m == 8:
                al = self._pairwise(topk_ids)   # one token: its experts are distinct; no sort needed
            else:
                al = align_by_expert(topk_ids, self.E, cfg.block_m)
            parts = [(al, cfg.gemm1, cfg.gemm2)]
            perm, p_max, pairwise = al.perm, al.p_max, al.pairwise
        inter, gemm2_out = self._buffers(p_max, x.device)
        # PDL only for one token: measured -1.5 us there, +0-2% at 8-64 tokens
        pdl = self.can_pdl and cfg.pdl and pairwise
        # GEMM2 reads (and GEMM1 writes) the intermediate activations in the coalesced order; GEMM1 reads
        # a reordered copy of x, except for one token (pairwise: one row, the copy costs more than it saves)
        co = cfg.coalesce
        xco = co and not pairwise
        fin = None
        if pairwise and not defer_finalize and cfg.fuse_finalize:
            fin = self._fused_finalize_args(gemm2_out, topk_weights, perm, shared_output, routed_scale)
        if num_pairs:
            xin = coalesce_activations(x, self.fmt) if xco else x
            for al, g1, _ in parts:
                self._launch_frag(self.f13, xin, inter, al, self.I, g1, True, top_k, num_pairs, xco=xco, operm=co,
                                  pdl=pdl, gate_up_pdl=cfg.gate_up_pdl)
            for al, _, g2 in parts:
                self._launch_frag(self.f2, inter, gemm2_out, al, self.H, g2, False, top_k, num_pairs, xco=co,
                                  fin=fin, pdl=pdl)
        if fin is not None:
            return fin.out
        return self._finish(gemm2_out, topk_weights, perm, shared_output, routed_scale, defer_finalize, pdl=pdl)

    def _forward_split(self, cfg: MoEConfig, x, topk_weights, topk_ids, shared_output, routed_scale,
                       defer_finalize):
        """Large batches: block_m-row tl.dot tiles for the rows that fill them, an expert's remainder
        of <= cfg.tail_rows rows in 16-row fragment-kernel blocks (align_split)."""
        t, top_k = topk_ids.shape
        num_pairs = t * top_k
        if cfg.tail[0].nt != TAIL_M // 8 or cfg.tail[1].nt != TAIL_M // 8:
            raise ValueError(f"tail configs run {TAIL_M}-row blocks (nt={TAIL_M // 8})")
        split = align_split(topk_ids, self.E, cfg.block_m, cfg.tail_rows)
        inter, gemm2_out = self._buffers(split.p_max, x.device)
        self._launch(self.w13, x, inter, split.big, self.I, self.H, cfg.gemm1, True, top_k, num_pairs, cfg.asm)
        # tail rows: GEMM1 reads x as it is (a reordered copy of all of x is not worth a few rows per
        # expert) and writes the intermediate in the coalesced order for GEMM2
        co = cfg.coalesce
        self._launch_frag(self.f13, x, inter, split.small, self.I, cfg.tail[0], True, top_k, num_pairs, operm=co)
        self._launch(self.w2, inter, gemm2_out, split.big, self.H, self.I, cfg.gemm2, False, top_k, num_pairs,
                     cfg.asm)
        self._launch_frag(self.f2, inter, gemm2_out, split.small, self.H, cfg.tail[1], False, top_k, num_pairs,
                          xco=co)
        return self._finish(gemm2_out, topk_weights, split.perm, shared_output, routed_scale, defer_finalize)

    def _launch(self, op: Operand, a, c, al, n, k, cfg: GemmConfig, gate_up: bool, top_k: int, num_pairs: int,
                asm: bool):
        """One GEMM on the tile kernel (or the prefill kernel: PrefillConfig). gate_up: GEMM1 (rows of x
        gathered by pair, SiLU(gate) * up)."""
        if isinstance(cfg, PrefillConfig):
            return self._launch_prefill(op, a, c, al, n, k, cfg, gate_up, top_k, num_pairs, asm)
        if isinstance(cfg, W8A8Config):
            return self._launch_w8a8(op, a, c, al, n, k, cfg, gate_up, top_k, num_pairs)
        fp4 = self.fmt_id >= FMT_NVFP4
        bk = _fit(k, cfg.block_k, 32 if fp4 else 16)
        if self.fmt_id == FMT_FP8:
            bk = min(bk, 128)
        if fp4:
            bk = 2 * FP4_KT  # one K tile of the K-tiled storage per step
        bn = min(cfg.block_n, max(16, triton.next_power_of_2(n)))
        one_row = cfg.one_row and fp4
        if one_row and al.block_m != 1:
            raise ValueError("the one-row loop handles one row per block (block_m=1)")
        # one-row loop: 8 bytes of a [block_n, 32-byte] tile per thread (the mma.sync B fragment)
        num_warps = bn * FP4_KT // (8 * 32) if one_row else cfg.num_warps
        grid = (al.max_blocks * triton.cdiv(n, bn),)
        moe_gemm_kernel[grid](
            a, a.stride(0),
            op.w, op.w.stride(0), op.row_w, op.tile_w,
            op.s, op.s.stride(0), op.row_s, op.tile_s,
            op.p, op.p.stride(0),
            c, c.stride(0),
            al.sorted_ids, al.expert_ids, al.num_post_pad,
            n, k, num_pairs, self.I if gate_up else 0, al.max_blocks,
            TOP_K=top_k, GATHER_A=gate_up, GATED=gate_up, FMT=self.fmt_id, GROUP=GROUP[self.fmt_id],
            BLOCK_M=al.block_m, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=cfg.group_m, SWAP=cfg.swap and not one_row,
            ASM=asm and not _INTERPRET, DOT_F32=_INTERPRET, ONE_ROW=one_row, PIPE=cfg.pipe if one_row else 0,
            **self._epilogue(gate_up),
            num_warps=num_warps, num_stages=cfg.num_stages,
        )

    def _launch_prefill(self, op: Operand, a, c, al, n, k, cfg: PrefillConfig, gate_up: bool, top_k: int,
                        num_pairs: int, asm: bool):
        """One GEMM on the prefill kernel (triton_prefill.py; FP4, the tile kernel's storage)."""
        if self.fmt_id < FMT_NVFP4:
            raise ValueError(f"the prefill kernel runs FP4 weights (nvfp4, mxfp4), not {self.fmt}")
        check_config(self.fmt, gate_up, cfg.block_n, cfg.swap)
        bn_out = cfg.block_n // 2 if gate_up else cfg.block_n
        tiles = al.max_blocks * triton.cdiv(n, bn_out)
        progs = tiles if cfg.progs_per_sm <= 0 else min(tiles, cfg.progs_per_sm * _sm_count(a.device))
        s32 = op.s.view(torch.int32)[..., 0]   # one 4-byte scale word per row and K tile
        prefill_gemm_kernel[(progs,)](
            a, a.stride(0),
            op.w, op.w.stride(0), op.tile_w,
            s32, s32.stride(0), s32.stride(1),
            op.p, op.p.stride(0),
            c, c.stride(0),
            al.sorted_ids, al.expert_ids, al.num_post_pad,
            n, k, num_pairs, self.I if gate_up else 0, progs,
            TOP_K=top_k, GATHER_A=gate_up, GATED=gate_up, FMT=self.fmt_id, GROUP=GROUP[self.fmt_id],
            BLOCK_M=al.block_m, BLOCK_N=cfg.block_n, BKH=step_bytes(k // 2, cfg.bkh), GROUP_M=cfg.group_m,
            SWAP=cfg.swap, ASM=asm and not _INTERPRET, DOT_F32=_INTERPRET, FLATTEN=cfg.flatten, WS=cfg.ws,
            **self._epilogue(gate_up),
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def _launch_w8a8(self, op: Operand, a, c, al, n, k, cfg: W8A8Config, gate_up: bool, top_k: int,
                     num_pairs: int):
        """One GEMM on the FP8 W8A8 kernel (triton_w8a8.py; fp8 weights, the tile kernel's storage)."""
        if self.fmt_id != FMT_FP8 or k % GROUP_K:
            raise ValueError(f"the W8A8 kernel runs fp8 block weights with K a multiple of {GROUP_K} "
                             f"(got {self.fmt}, K={k})")
        bn_out = cfg.block_n // 2 if gate_up else cfg.block_n
        tiles = al.max_blocks * triton.cdiv(n, bn_out)
        progs = tiles if cfg.progs_per_sm <= 0 else min(tiles, cfg.progs_per_sm * _sm_count(a.device))
        w8a8_gemm_kernel[(progs,)](
            a, a.stride(0),
            op.w, op.w.stride(0), op.w.stride(1),
            op.s, op.s.stride(0), op.s.stride(1),
            c, c.stride(0),
            al.sorted_ids, al.expert_ids, al.num_post_pad,
            n, k, num_pairs, self.I if gate_up else 0, progs,
            **self._epilogue(gate_up),
            TOP_K=top_k, GATHER_A=gate_up, GATED=gate_up, BLOCK_M=al.block_m, BLOCK_N=cfg.block_n,
            GROUP_M=cfg.group_m, DOT_F32=_INTERPRET,
            num_warps=cfg.num_warps, num_stages=cfg.num_stages,
        )

    def _epilogue(self, gate_up: bool) -> dict:
        """The bias and activation arguments of either kernel for GEMM1 (gate_up) or GEMM2."""
        bias = self.b13 if gate_up else self.b2
        return dict(bias_ptr=self._no_bias if bias is None else bias, stride_be=0 if bias is None else bias.stride(0),
                    alpha=self.alpha, limit=self.limit, BIAS=bias is not None, ACT=self.act_id if gate_up else 0)

    def _launch_frag(self, fw: FragWeights, a, c, al, n: int, cfg: FragConfig, gate_up: bool, top_k: int,
                     num_pairs: int, *, xco: bool = False, operm: bool = False, fin: _FusedFinalize | None = None,
                     pdl: bool = False, gate_up_pdl: bool = True):
        """One GEMM on the fragment kernel. xco: `a` is in the coalesced order (coalesce_activations);
        operm: write `c` in that order. fin: the fused one-token finalize (pairwise down GEMM only).
        pdl: PDL code in the kernel; the gate/up GEMM keeps it (it lets the down GEMM launch early) but
        is itself launched early only with gate_up_pdl: its programs are placed beside the previous
        kernel's."""
        if fin is not None and not (al.pairwise and not gate_up):
            raise ValueError("the fused finalize is for the one-token (pairwise) down GEMM")
        steps = fw.k // STEP_K[self.fmt]
        wk = math.gcd(cfg.wk, steps)   # K-splitting warps: a divisor of the step count
        if al.block_m != 8 * cfg.nt:
            raise ValueError(f"fragment kernel with nt={cfg.nt} needs block_m={8 * cfg.nt}, got {al.block_m}")
        if a.stride(1) != 1 or a.stride(0) % 8 or a.data_ptr() % 16:
            a = a.contiguous().clone()
        grid = (al.max_blocks * triton.cdiv(n, 16 * cfg.wn * cfg.rt),)
        launch_pdl = pdl and (not gate_up or gate_up_pdl)
        frag_moe_kernel[grid](
            a, a.stride(0) // 2,
            fw.w, fw.w.stride(0), fw.w.stride(1),
            fw.s, fw.s.stride(0), fw.s.stride(1),
            fw.p,
            c, c.stride(0),
            al.sorted_ids, al.expert_ids, al.num_post_pad,
            n, steps, num_pairs, (fw.n // 2) // 16 if gate_up else 0, al.max_blocks, self.E,
            TOP_K=top_k, GATHER_A=gate_up, GATED=gate_up, SUBS=fw.sub, PAIRWISE=al.pairwise,
            ROW_START=al.row_start, PDL=pdl, XCO=xco, OPERM=operm, NT=cfg.nt, RT=cfg.rt, WN=cfg.wn,
            WK=wk, GROUP_M=cfg.group_m, PIPE=cfg.pipe, **frag_asm_args(self.fmt, cfg.nt, cfg.rt),
            # (unused pointer arguments without FIN: any tensor)
            fin_w_ptr=fin.weights if fin else c, fin_s_ptr=fin.shared if fin and fin.shared is not None else c,
            fin_out_ptr=fin.out if fin else c, fin_count_ptr=fin.counts if fin else c,
            routed_scale=fin.routed_scale if fin else 1.0, FIN=fin is not None,
            FIN_SHARED=fin is not None and fin.shared is not None, **self._epilogue(gate_up),
            num_warps=cfg.wn * wk, **({"launch_pdl": True} if launch_pdl else {}),
        )

    def _fused_finalize_args(self, gemm2_out, topk_weights, perm, shared_output, routed_scale) -> _FusedFinalize:
        """What the pairwise down GEMM needs to finalize the one token itself (FIN in triton_frag)."""
        _check_finalize(gemm2_out, topk_weights, perm, shared_output)
        shared = None
        if shared_output is not None:
            if shared_output.shape[1] != self.H:
                raise TypeError(f"shared_output must be bf16 [T, {self.H}], got {tuple(shared_output.shape)}")
            shared = shared_output.contiguous()
        dev = gemm2_out.device
        # one counter per 16-row column block at most, zeroed once
        counts = _constant(self._fin_counts, dev, lambda: torch.zeros(triton.cdiv(self.H, 16), dtype=torch.int32,
                                                                       device=dev))
        out = torch.empty(1, self.H, dtype=torch.bfloat16, device=dev)
        return _FusedFinalize(topk_weights.contiguous(), shared, out, counts, float(routed_scale))

    def _pairwise(self, topk_ids: torch.Tensor) -> Alignment:
        """One 8-row block per (token, expert) pair, pair i on row 8i: no alignment launches (the
        fragment kernel reads the expert of block i from topk_ids itself). The row map is a constant,
        made once per top-k outside graph capture."""
        ids = topk_ids.reshape(-1)
        n = ids.numel()
        perm = _constant(self._pairwise_perm, (n, ids.device),
                         lambda: torch.arange(0, 8 * n, 8, dtype=torch.int32, device=ids.device))
        return Alignment(ids, ids, ids, perm, 8, n, pairwise=True)

    def _buffers(self, p_max: int, device):
        """GEMM1's output (the intermediate activations) and GEMM2's (un-weighted rows), p_max rows each."""
        return (torch.empty(p_max, self.I, dtype=torch.bfloat16, device=device),
                torch.empty(p_max, self.H, dtype=torch.bfloat16, device=device))

    @staticmethod
    def _finish(gemm2_out, topk_weights, perm, shared_output, routed_scale, defer_finalize: bool, pdl: bool = False):
        """Hand the rows over (deferred finalize) or finalize them here, with the shared expert's output."""
        if defer_finalize:
            return DeferredMoEOutput(gemm2_out, topk_weights, perm, float(routed_scale))
        return moe_finalize_fuse_shared(gemm2_out, topk_weights, perm, shared_output, float(routed_scale), pdl=pdl)
