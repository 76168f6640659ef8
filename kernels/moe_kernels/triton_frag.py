"""FP4 expert GEMMs on mma.sync fragments, for 1 to ~80 token rows per expert (in 8- or 16-row blocks).

The weights are packed once in *fragment order* (TritonExperts keeps this copy next to its tiled
layout for larger batches): for each expert, 16-row tile and K step, the 32
lanes of a warp each read 16 contiguous bytes (one 128-bit load, one 512-byte coalesced read per
warp), and those 32 codes are exactly that lane's A fragments (weights = the MMA's M side,
`mma.sync.m16n8k16`) for four MMAs. The token rows are the MMA's N side (8 per tile), so one
decoded fragment serves up to 8 (NT=1) or 16 (NT=2) tokens and nothing is staged through shared
memory besides the cp.async pipeline Triton builds (`tl.range(num_stages=PIPE)`). Each warp takes
RT (1, 2, 4) row tiles per activation fragment it loads (four independent MMA chains at RT=4), and
WN x WK warps share a program (WK splits K; partial sums are added once at the end).

K is permuted inside each step (weights and activations alike, so the products are unchanged):
lane t of a lane group covers 16*SUB contiguous K values per loop step, so
- its activations are two contiguous 16-byte loads per 64-K sub-step (B fragments of four MMAs),
- its block scales are two groups per loop step (SUB=2 for NVFP4's 16-groups, SUB=4 for MXFP4's
  32-groups): one 4-byte word per lane and step holds (row g, row g+8) x (group 0, group 1).
In that natural K order each activation load instruction would use half of every 32-byte sector it
touches (a lane's two 16-byte halves of a sector come from two instructions, and these cp.async
copies do not meet in L1), so activation traffic from L2 was twice its bytes. The kernel therefore
reads activations in a *coalesced* order (XCO, `coalesce_activations`: inside each step, the chunks
of the four lanes of a row side by side); GEMM1 writes its output in that order (OPERM), and x gets
one reordering copy per forward. The same K values meet in every MMA: results are bit-identical.

Decode (inline PTX, per 32-bit word = 8 codes = one A fragment): each code c must become bf16 bits
(c & 8) << 12 | (c & 7) << 6 of its half of a register; the packing scatters the code bits over the
word so that register 0 is `w & 0x81C081C0`, registers 1 and 2 the same after a rotation by 3 and 6,
and register 3 `(w & 0x001B001B) * 0x1084 & 0x81C081C0` (fp4_ptx.WORD_OPS; 8 integer instructions
per word instead of 13 for nibble order). Those bits are value * 2^-126; one bf16x2 FMA by the
block scale pair S (exact: at most 6 significant bits). S comes from one stored byte B per
(row, group) with `prmt` (B into both halves) and one `mad`: NVFP4 stores e4m3 re-encoded as
B = (E + 3) << 3 | m' (subnormal scales become normals; exact), S = B * 16 + 234 << 7 per half
= scale * 2^(126 - 9); MXFP4 stores B = s + 126 - c, S = B << 7 = 2^(s-127) * 2^(126 - c).
Zero scales store B = 0 with their codes zeroed; negative NVFP4 scales flip their codes' signs;
the per-expert factors (NVFP4 global scale * 2^9, MXFP4 2^c) multiply the fp32 accumulators.

`FragWeights.dequantize` inverts the packing with the same bit operations in torch; the CPU tests
check it bit-exactly against the formats' own decoders, and `emulate` runs the whole lane/fragment
schedule in torch, so the layout logic is tested without a GPU.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from . import formats as F
from . import fp4_ptx as ptx
from .pdl import gdc_launch_dependents, gdc_wait

# bf16 bit constants of the decode (see module docstring)
_NV_C = 9                      # NVFP4 exponent offset: weights come out * 2^-9, the 2^9 goes to the accumulator
_NV_MUL, _NV_ADD = 16, ((243 - _NV_C) << 7) * 0x00010001
_MX_MUL, _MX_ADD = 128, 0
STEP_K = {"nvfp4": 128, "mxfp4": 256}   # K per loop step (2 scale groups per lane)
SUB = {"nvfp4": 2, "mxfp4": 4}          # 64-K sub-steps (16-byte loads per lane) per loop step


# ------------------------------------------------------------------------------ packing (torch)
def _word_pos() -> torch.Tensor:
    """int64 [8 code slots, 4 code bits] -> bit of the 32-bit word. Code slot i is A register
    p = i % 4, half e = i // 4; code bit 0 (mantissa), 1, 2 (exponent), 3 (sign) must land on bf16
    bit 6, 7, 8, 15 of that half after the register's integer ops (fp4_ptx.WORD_OPS), which decide
    the layout: it is read off them by decoding single bits."""
    role = {6: 0, 7: 1, 8: 2, 15: 3}
    pos = torch.full((8, 4), -1, dtype=torch.int64)
    for p_ in range(4):
        for b in range(32):
            out = ptx.word_pair_bits(1 << b, p_)
            if out:
                o = out.bit_length() - 1
                pos[p_ + 4 * (o // 16), role[o % 16]] = b
    if (pos < 0).any() or len(set(pos.flatten().tolist())) != 32:
        raise AssertionError("fp4_ptx.WORD_OPS do not place 32 distinct bits")
    return pos


WORD_POS = _word_pos()
# int64 [8 code slots, 16 codes]: the word bits of code c in slot i
WORD_BITS = ((torch.arange(16).view(1, 16, 1) >> torch.arange(4).view(1, 1, 4) & 1)
             << WORD_POS.view(8, 1, 4)).sum(dim=2)


def _lane_maps(sub: int):
    """Index maps of one (row tile, loop step): for [sub, lane, word, code slot] the row (0..15) and the
    K offset (0..64*sub-1) inside the tile and step. Slot i is A register p = i % 4 (rows g, g+8,
    g, g+8; K +0, +0, +2, +2), e = i // 4 its low/high bf16 (WORD_POS: where its bits go). Fragment j takes K 4j..4j+3 of
    the lane's 16: its B registers (K pairs 4j, 4j+2) are adjacent words in memory, so the 16-byte
    activation loads land in the register pairs mma.sync wants without moves."""
    s = torch.arange(sub).view(sub, 1, 1, 1)
    lane = torch.arange(32).view(1, 32, 1, 1)
    j = torch.arange(4).view(1, 1, 4, 1)
    i = torch.arange(8).view(1, 1, 1, 8)
    g, t, p, e = lane // 4, lane % 4, i % 4, i // 4
    row = g + 8 * (p % 2)
    k = 16 * sub * t + 16 * s + 4 * j + 2 * (p // 2) + e
    return row.expand(sub, 32, 4, 8), k.expand(sub, 32, 4, 8)


def _scale_maps():
    """[lane, byte] -> (row 0..15, group 0..1 of the lane's pair of scale groups in a loop step)."""
    lane = torch.arange(32).view(32, 1)
    b = torch.arange(4).view(1, 4)
    return (lane // 4 + 8 * (b % 2)).expand(32, 4), (b // 2).expand(32, 4), (lane % 4).expand(32, 4)


_NV_TABLE = None


def _nv_scale_bytes(code: torch.Tensor):
    """e4m3 bit patterns (uint8) -> (B, negative, zero): B = (E + 3) << 3 | m' of |scale| as a normal
    number with a 5-bit exponent (E = -2..15), so that bf16 bits B << 4 = |scale| * 2^-117."""
    global _NV_TABLE
    if _NV_TABLE is None:
        vals = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float().abs()
        table = torch.zeros(256, dtype=torch.int32)
        for c in range(256):
            v = float(vals[c])
            if v != v or v == 0.0:   # NaN (rejected by the caller) or +-0
                continue
            m, ex = torch.frexp(torch.tensor(v, dtype=torch.float64))   # v = m * 2^ex, m in [0.5, 1)
            e = int(ex) - 1                                              # v = 1.f * 2^e
            frac = int(round((float(m) * 2 - 1) * 8))
            table[c] = ((e + 7 + 3) << 3) | frac
        _NV_TABLE = table
    c = code.to(torch.int64)
    return _NV_TABLE.to(code.device)[c], (c & 0x80) != 0, (c & 0x7F) == 0


@dataclass
class FragWeights:
    """One FP4 weight matrix [E, N, K] in fragment order (see module docstring)."""
    fmt: str
    w: torch.Tensor      # int32 [E, N/16, K/STEP, SUB, 32, 4]
    s: torch.Tensor      # int32 [E, N/16, K/STEP, 32]: per lane (row g, g+8) x (group 0, 1) bytes
    p: torch.Tensor      # fp32 [E, 2]: accumulator multipliers of the first / second half of the rows
    #                      (NVFP4 global scale * 2^9: w13 may carry gate and up scales; MXFP4 2^c)
    n: int
    k: int

    @property
    def sub(self) -> int:
        return SUB[self.fmt]

    @classmethod
    def pack(cls, t, fmt: str) -> "FragWeights":
        """From NvFp4Tensor / MxFp4Tensor ([E, N, K/2] packed codes + block scales; NVFP4 global scale
        [E] or [E, 2] = separate scales of the two row halves, e.g. gate and up)."""
        if fmt not in SUB:
            raise ValueError(f"fragment packing is for nvfp4/mxfp4, not {fmt}")
        packed = t.packed
        e, n, half = packed.shape
        k = 2 * half
        step = STEP_K[fmt]
        if n % 16 or k % step:
            raise ValueError(f"{fmt} fragment kernels need N % 16 == 0 and K % {step} == 0 (N={n}, K={k})")
        group = F.NVFP4_BLOCK if fmt == "nvfp4" else F.MXFP4_BLOCK
        p = torch.empty(e, 2, dtype=torch.float32, device=packed.device)
        rows, ks = _lane_maps(SUB[fmt])
        rows, ks = rows.to(packed.device), ks.to(packed.device)
        s_rows, s_grp, s_t = (x.to(packed.device) for x in _scale_maps())
        bits = WORD_BITS.flatten().to(packed.device)
        slot16 = 16 * torch.arange(8, device=packed.device).view(1, 1, 1, 8, 1, 1)
        w_out = torch.empty(e, n // 16, k // step, SUB[fmt], 32, 4, dtype=torch.int32, device=packed.device)
        s_out = torch.empty(e, n // 16, k // step, 32, dtype=torch.int32, device=packed.device)
        for x in range(e):   # one expert at a time: bounded temporaries
            codes = F.unpack_e2m1(packed[x]).to(torch.int64)            # [N, K]
            if fmt == "nvfp4":
                raw = t.block_scale[x].view(torch.uint8)
                if ((raw & 0x7F) == 0x7F).any():
                    raise ValueError("NVFP4 block scales contain NaN")
                b, neg, zero = _nv_scale_bytes(raw)
                gs = t.global_scale.reshape(e, -1).float()
                if gs.shape[1] not in (1, 2):
                    raise ValueError(f"NVFP4 global scale must be [E] or [E, 2], got {tuple(t.global_scale.shape)}")
                p[x] = gs[x].expand(2) * 2.0 ** _NV_C
            else:
                sc = t.scale[x].to(torch.int64)
                if (sc == 255).any():
                    raise ValueError("MXFP4 scales contain NaN (E8M0 0xFF)")
                c = max(int(sc.max()) - 127, 0)
                b = sc + 126 - c
                zero = b <= 0           # more than 2^126 below the expert's largest scale: flushed
                b = torch.where(zero, torch.zeros_like(b), b)
                neg = torch.zeros_like(zero)
                p[x] = 2.0 ** c
            # blocks with a zero scale decode to zero: zero their codes (S is not zero for B = 0);
            # negative scales: |scale| with the codes' signs flipped (exact)
            zero_k = zero.repeat_interleave(group, dim=1)
            neg_k = neg.repeat_interleave(group, dim=1)
            codes = torch.where(zero_k, torch.zeros_like(codes), codes ^ (neg_k.to(torch.int64) << 3))
            # weights: [N/16, 16, K/step, step] -> gather [sub, lane, word, slot] per (tile, step)
            c5 = codes.view(n // 16, 16, k // step, step)
            g = c5[:, rows, :, ks]                        # [sub, 32, 4, 8, N/16, K/step]
            # code c in slot i adds WORD_BITS[i, c] (its bits at their WORD_POS places) to the word
            words = bits[g + slot16].sum(dim=3)                      # [sub, 32, 4, N/16, K/step]
            words = torch.where(words >= 2 ** 31, words - 2 ** 32, words).to(torch.int32)
            w_out[x] = words.permute(3, 4, 0, 1, 2)
            # scales: [N/16, 16, K/step, 8 groups per step] (group of lane t's pair q = 2t + q)
            b4 = b.view(n // 16, 16, k // step, step // group)
            sb = b4[:, s_rows, :, 2 * s_t + s_grp]        # [32, 4, N/16, K/step]
            word = (sb << (8 * torch.arange(4, device=packed.device).view(1, 4, 1, 1))).sum(dim=1)
            s_out[x] = word.to(torch.int32).permute(1, 2, 0)
        return cls(fmt, w_out.contiguous(), s_out.contiguous(), p, n, k)

    # -------------------------------------------------------------- torch mirrors of the kernel
    def _decoded(self, x: int) -> torch.Tensor:
        """fp32 [N/16, K/step, sub, 32 lanes, 4 words, 8] = weight * 2^-c in the kernel's order, with
        the kernel's own bit operations (decode masks, prmt/mad scale, bf16 product)."""
        w = self.w[x].to(torch.int64) & 0xFFFFFFFF                     # [T, S, sub, 32, 4]
        sw = self.s[x].to(torch.int64) & 0xFFFFFFFF                    # [T, S, 32]
        mul, add = (_NV_MUL, _NV_ADD) if self.fmt == "nvfp4" else (_MX_MUL, _MX_ADD)

        def bf16(bits16):
            return bits16.to(torch.int32).to(torch.int16).view(torch.bfloat16).float()

        def lo(v):
            return (v & 0xFFFF)

        pairs = [ptx.word_pair_bits(w, p_) for p_ in range(4)]     # A registers 0..3
        out = torch.empty(*w.shape, 8, dtype=torch.float32, device=w.device)
        for s in range(self.sub):
            q = s // (self.sub // 2)
            sg = ((((sw >> (16 * q)) & 0xFF) * mul + add) & 0xFFFF)     # row g   (byte 2q)
            sh = ((((sw >> (16 * q + 8)) & 0xFF) * mul + add) & 0xFFFF)  # row g+8 (byte 2q+1)
            for p_ in range(4):
                sc = bf16(sg if p_ % 2 == 0 else sh)[..., None]
                reg = pairs[p_][:, :, s]
                # e2m1 * scale has <= 6 significant bits: exact in bf16 and fp32
                out[:, :, s, :, :, p_] = bf16(lo(reg)) * sc
                out[:, :, s, :, :, p_ + 4] = bf16(reg >> 16) * sc
        return out

    def dequantize(self) -> torch.Tensor:
        """fp32 [E, N, K] from the fragment storage, through the kernel's decode arithmetic."""
        e = self.w.shape[0]
        rows, ks = _lane_maps(self.sub)
        rows, ks = rows.to(self.w.device), ks.to(self.w.device)
        step = STEP_K[self.fmt]
        out = torch.empty(e, self.n // 16, 16, self.k // step, step, dtype=torch.float32, device=self.w.device)
        for x in range(e):
            d = self._decoded(x).permute(2, 3, 4, 5, 0, 1)          # [sub, 32, 4, 8, T, S]
            o = out[x]
            o[:, rows, :, ks] = d
        out = out.view(e, self.n, self.k)
        half = self.n // 2
        out[:, :half] *= self.p[:, 0, None, None]
        out[:, half:] *= self.p[:, 1, None, None]
        return out


# ------------------------------------------------------------------------------- inline PTX
def _asm(nt: int, rt: int, q: int, mul: int, add: int) -> str:
    """One 64-K sub-step: decode rt weight words x 4 (rt row tiles) and run rt * nt * 4 MMAs.
    Operands: outputs acc[r][n] (4 f32 each); inputs w[r] (4), sw[r] (4), x[n] (8: K words 0-3, 4-7),
    then acc[r][n] again, tied to the outputs."""
    nout = 4 * rt * nt
    base = nout
    w = [[f"${base + 4 * r + j}" for j in range(4)] for r in range(rt)]
    base += 4 * rt
    sw = [f"${base + 4 * r}" for r in range(rt)]
    base += 4 * rt
    # activations: two [R, 4] words per token tile, words (2j, 2j + 1) = B registers of fragment j
    xlo = [[f"${base + 8 * n + 2 * j}" for j in range(4)] for n in range(nt)]
    xhi = [[f"${base + 8 * n + 2 * j + 1}" for j in range(4)] for n in range(nt)]
    base += 8 * nt
    acc_out = [[[f"${4 * (r * nt + n) + i}" for i in range(4)] for n in range(nt)] for r in range(rt)]
    sel_g, sel_h = 0x4040 + 0x0101 * (2 * q), 0x4040 + 0x0101 * (2 * q + 1)
    lines = ["{", ".reg .b32 z, sg, sh, v, a0, a1, a2, a3;", f"mov.b32 z, {ptx.NEG_ZERO2};"]
    for r in range(rt):
        lines += [f"prmt.b32 sg, {sw[r]}, 0, {sel_g:#x};", f"mad.lo.u32 sg, sg, {mul}, {add:#x};",
                  f"prmt.b32 sh, {sw[r]}, 0, {sel_h:#x};", f"mad.lo.u32 sh, sh, {mul}, {add:#x};"]
        for j in range(4):
            # A registers: rows g (scale sg), g+8 (sh), g, g+8; K +0, +0, +2, +2 (WORD_POS places the codes)
            for k in range(4):
                lines += ptx.word_pair(f"a{k}", w[r][j], k, "sh" if k % 2 else "sg")
            for n in range(nt):
                c = d = acc_out[r][n]   # acc_in is tied to acc_out (constraints "0", "1", ...)
                lines.append("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                             f"{{{', '.join(d)}}}, {{a0, a1, a2, a3}}, {{{xlo[n][j]}, {xhi[n][j]}}}, "
                             f"{{{', '.join(c)}}};")
    lines.append("}")
    return "\n".join(lines)


def _constraints(nt: int, rt: int) -> str:
    """Outputs, then weights, scales and activations; the accumulator inputs are tied to the outputs
    (the MMAs accumulate in place, no register copies)."""
    nout = 4 * rt * nt
    nin = 4 * rt + 4 * rt + 8 * nt
    return ",".join(["=r"] * nout + ["r"] * nin + [str(i) for i in range(nout)])


# ---------------------------------------------------------------------------------- kernel
@triton.jit
def _substep(w0, w1, w2, w3, s0, s1, s2, s3, xl0, xh0, xl1, xh1, a00, a01, a10, a11, a20, a21, a30, a31,
             ASM: tl.constexpr, CONS: tl.constexpr, NT: tl.constexpr, RT: tl.constexpr):
    """acc[r][n] += decoded w[r] (rt row tiles) x activations of token tile n, one 64-K sub-step.
    (rt, nt) in {1, 2, 4} x {1, 2}."""
    if RT == 1:
        if NT == 1:
            a00 = tl.inline_asm_elementwise(ASM, CONS, [w0, s0, xl0, xh0, a00], dtype=tl.float32, is_pure=True, pack=4)
        else:
            a00, a01 = tl.inline_asm_elementwise(ASM, CONS, [w0, s0, xl0, xh0, xl1, xh1, a00, a01],
                                                 dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
    elif RT == 2:
        if NT == 1:
            a00, a10 = tl.inline_asm_elementwise(ASM, CONS, [w0, w1, s0, s1, xl0, xh0, a00, a10],
                                                 dtype=(tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            a00, a01, a10, a11 = tl.inline_asm_elementwise(
                ASM, CONS, [w0, w1, s0, s1, xl0, xh0, xl1, xh1, a00, a01, a10, a11],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=4)
    else:
        if NT == 1:
            a00, a10, a20, a30 = tl.inline_asm_elementwise(
                ASM, CONS, [w0, w1, w2, w3, s0, s1, s2, s3, xl0, xh0, a00, a10, a20, a30],
                dtype=(tl.float32, tl.float32, tl.float32, tl.float32), is_pure=True, pack=4)
        else:
            a00, a01, a10, a11, a20, a21, a30, a31 = tl.inline_asm_elementwise(
                ASM, CONS, [w0, w1, w2, w3, s0, s1, s2, s3, xl0, xh0, xl1, xh1, a00, a01, a10, a11, a20, a21, a30, a31],
                dtype=(tl.float32,) * 8, is_pure=True, pack=4)
    return a00, a01, a10, a11, a20, a21, a30, a31


@triton.jit
def grouped_block(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    """Program id -> (token block, column block), GROUP_M token blocks (usually of one expert) per
    column sweep, so that their reads of the same weight columns meet in L2."""
    in_group = GROUP_M * num_pid_n
    first_m = (pid // in_group) * GROUP_M
    size_m = min(num_pid_m - first_m, GROUP_M)
    return first_m + (pid % in_group) % size_m, (pid % in_group) // size_m


@triton.jit
def _scales(sb, so, stride_st, ok0, ok1, ok2, ok3, RT: tl.constexpr):
    """The RT row tiles' 4-byte scale words of a loop step ([R, 1], broadcast over a lane's 4 words)."""
    s0 = tl.load(sb + so, mask=ok0, other=0)[:, None]
    s1, s2, s3 = s0, s0, s0
    if RT >= 2:
        s1 = tl.load(sb + stride_st + so, mask=ok1, other=0)[:, None]
    if RT == 4:
        s2 = tl.load(sb + 2 * stride_st + so, mask=ok2, other=0)[:, None]
        s3 = tl.load(sb + 3 * stride_st + so, mask=ok3, other=0)[:, None]
    return s0, s1, s2, s3


@triton.jit
def _words(wb, wo, stride_wt, ok0, ok1, ok2, ok3, RT: tl.constexpr):
    """The RT row tiles' 16 bytes per lane of one sub-step ([R, 4] int32, one 128-bit copy each)."""
    w0 = tl.load(wb[:, None] + wo, mask=ok0[:, None], other=0)
    w1, w2, w3 = w0, w0, w0
    if RT >= 2:
        w1 = tl.load(wb[:, None] + stride_wt + wo, mask=ok1[:, None], other=0)
    if RT == 4:
        w2 = tl.load(wb[:, None] + 2 * stride_wt + wo, mask=ok2[:, None], other=0)
        w3 = tl.load(wb[:, None] + 3 * stride_wt + wo, mask=ok3[:, None], other=0)
    return w0, w1, w2, w3


@triton.jit
def _coalesced_column(k, SUBS: tl.constexpr):
    """Column of logical K index k in the coalesced activation order (coalesce_activations): inside
    each loop step, 16-byte chunk t * 2*SUBS + q moves to q * 4 + t."""
    STEP: tl.constexpr = 64 * SUBS
    k_in = k % STEP
    c = k_in // 8
    return k - k_in + ((c % (2 * SUBS)) * 4 + c // (2 * SUBS)) * 8 + k_in % 8


@triton.jit
def gated_activation(g, u, ACT: tl.constexpr, alpha, limit):
    """The GEMM1 epilogue's activation on fp32 (gate, up): ACT 0 silu(g) * u; 1 gpt-oss's clamped
    SwiGLU (u + 1) * g' * sigmoid(alpha * g'), g' = min(g, limit), u clamped to [-limit, limit]
    (reference.activate is the definition)."""
    if ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        return (u + 1.0) * (g / (1.0 + tl.exp(-alpha * g)))
    return g / (1.0 + tl.exp(-g)) * u


@triton.jit
def _store_tile(acc_g, acc_u, c_ptr, stride_cm, pg, pu, slot0, tile_base, N,
                GATED: tl.constexpr, WN: tl.constexpr, WK: tl.constexpr, RT: tl.constexpr, RI: tl.constexpr,
                OPERM: tl.constexpr, SUBS: tl.constexpr, b_ptr, up_rows, alpha, limit,
                BIAS: tl.constexpr, ACT: tl.constexpr):
    """C fragment -> rows: lane (g, t) holds (row g, tokens 2t, 2t+1), (row g+8, tokens 2t, 2t+1) of
    its warp's row tile RI; the WK partial sums of a warp row are added here. OPERM: output columns
    in the coalesced activation order of the next fragment GEMM (see coalesce_activations).
    BIAS: b_ptr (this expert's fp32 bias row) [row] is added (gate/up: [row] and [up_rows + row])
    before the activation ACT (gated_activation)."""
    g3 = tl.sum(tl.reshape(acc_g, (WN, WK, 32, 4)), axis=1) * pg
    wn = tl.arange(0, WN)[:, None, None]
    lane = tl.arange(0, 32)[None, :, None]
    i = tl.arange(0, 4)[None, None, :]
    row = (tile_base + wn * RT + RI) * 16 + lane // 4 + 8 * (i // 2)
    slot = slot0 + 2 * (lane % 4) + i % 2
    if BIAS:
        g3 += tl.load(b_ptr + row, mask=row < N, other=0.0)
    if GATED:
        u3 = tl.sum(tl.reshape(acc_u, (WN, WK, 32, 4)), axis=1) * pu
        if BIAS:
            u3 += tl.load(b_ptr + up_rows + row, mask=row < N, other=0.0)
        out = gated_activation(g3, u3, ACT, alpha, limit)
    else:
        out = g3
    col = row
    if OPERM:
        col = _coalesced_column(row, SUBS)
    tl.store(c_ptr + slot.to(tl.int64) * stride_cm + col, out.to(c_ptr.dtype.element_ty), mask=row < N)


@triton.jit
def _arrive_and_finalize(c_ptr, stride_cm, w_ptr, s_ptr, out_ptr, count_ptr, routed_scale, pid_n, N,
                         TOP_K: tl.constexpr, ROWS: tl.constexpr, HAS_SHARED: tl.constexpr):
    """One token's finalize, fused into the pairwise down GEMM (FIN): the TOP_K programs of column
    block pid_n (one per pair, rows 8k of c) count their arrival; the last one adds the TOP_K rows of
    that block in slot order, exactly as the finalize kernel does (fp32, (w * routed_scale) * row,
    then the shared expert's row, one bf16 rounding) and resets the counter for the next forward.
    Ordering as in a split-K semaphore: the CTA barrier orders every thread's stores before thread
    0's acq_rel atomic at GPU scope (release), whose acquire side lets the last program read the
    other programs' rows; those reads bypass L1 (.cg)."""
    tl.debug_barrier()
    arrived = tl.atomic_add(count_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
    if arrived == TOP_K - 1:
        tl.store(count_ptr + pid_n, 0)
        offs = pid_n * ROWS + tl.arange(0, ROWS)
        ok = offs < N
        acc = tl.zeros([ROWS], dtype=tl.float32)
        for k in tl.static_range(TOP_K):
            w = tl.load(w_ptr + k).to(tl.float32) * routed_scale
            row = tl.load(c_ptr + (8 * k) * stride_cm + offs, mask=ok, other=0.0, cache_modifier=".cg")
            acc += w * row.to(tl.float32)
        if HAS_SHARED:
            acc += tl.load(s_ptr + offs, mask=ok, other=0.0).to(tl.float32)
        tl.store(out_ptr + offs, acc.to(tl.bfloat16), mask=ok)


@triton.jit
def frag_moe_kernel(
    a_ptr, stride_a32,             # activations bf16 [rows, K], row stride in int32 units
    w_ptr, stride_we, stride_wt,   # FragWeights.w (int32), strides per expert and per 16-row tile
    s_ptr, stride_se, stride_st,   # FragWeights.s (int32)
    p_ptr,                         # fp32 [E, 2] accumulator multipliers (first-half rows, second-half rows)
    c_ptr, stride_cm,
    sorted_ids_ptr, expert_ids_ptr, num_post_pad_ptr,
    N, num_steps, num_pairs, up_tiles, num_pid_m, num_experts,
    TOP_K: tl.constexpr, GATHER_A: tl.constexpr, GATED: tl.constexpr, SUBS: tl.constexpr,
    PAIRWISE: tl.constexpr, ROW_START: tl.constexpr, PDL: tl.constexpr,
    NT: tl.constexpr, RT: tl.constexpr, WN: tl.constexpr, WK: tl.constexpr, GROUP_M: tl.constexpr,
    PIPE: tl.constexpr, ASM0: tl.constexpr, ASM1: tl.constexpr, CONS: tl.constexpr,
    fin_w_ptr, fin_s_ptr, fin_out_ptr, fin_count_ptr, routed_scale,   # FIN only (see _arrive_and_finalize)
    XCO: tl.constexpr = False, OPERM: tl.constexpr = False, FIN: tl.constexpr = False,
    FIN_SHARED: tl.constexpr = False,
    bias_ptr=None, stride_be=0, alpha=1.0, limit=0.0, BIAS: tl.constexpr = False, ACT: tl.constexpr = 0,
):  # (bias_ptr: any tensor without BIAS)
    """C[token rows of one expert block, N tile] = A @ W[e]^T (GATED: silu(A Wg^T) * A Wu^T).
    Program = one block of 8*NT token rows x WN*RT*16 weight rows; warp (wn, wk) takes RT row tiles
    and every WK-th loop step; the WK partial sums are added at the end.
    PAIRWISE (NT=1, no alignment launches; for one token, whose top-k experts are distinct): block b
    is pair b alone, expert_ids_ptr is the flat topk_ids and pair b's row is slot 8b. Its sorted ids
    and padding are implicit; a pair whose expert is not in [0, E) (another rank's) writes a zero
    row in GEMM2, so that finalize's fixed row map needs no -1 entries.
    ROW_START: the blocks' rows start at num_post_pad_ptr[1] (mixed alignment: the 8-row blocks follow
    the 16-row ones); num_post_pad_ptr[0] is where they end.
    PDL: launched with programmatic dependent launch (pdl.py): wait for the previous kernel before
    the first global access, let the next one launch after the K loop.
    FIN (PAIRWISE down GEMM): the finalize of the one token is done here, by the last of the top-k
    programs of each column block (_arrive_and_finalize): one launch fewer on the decode path.
    BIAS: the expert's fp32 bias row (bias_ptr [E, N or 2N], stride_be) is added in the epilogue;
    ACT: GEMM1's activation (gated_activation; alpha, limit for gpt-oss's)."""
    if PDL:
        gdc_wait()
    BLOCK_M: tl.constexpr = 8 * NT
    R: tl.constexpr = 32 * WN * WK
    pid_m, pid_n = grouped_block(tl.program_id(0), num_pid_m, tl.cdiv(N, 16 * WN * RT), GROUP_M)
    r = tl.arange(0, R)
    lane = r % 32
    warp = r // 32
    wn = warp // WK
    wk = warp % WK
    t = lane % 4
    base_m = pid_m * BLOCK_M                       # first row (slot) of the token block
    if PAIRWISE:
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)
        if (e < 0) | (e >= num_experts):
            if not GATED:
                nothing = tl.zeros([R, 4], dtype=tl.float32)
                for ri in tl.static_range(RT):
                    _store_tile(nothing, nothing, c_ptr, stride_cm, 1.0, 1.0, base_m, pid_n * WN * RT, N,
                                False, WN, WK, RT, ri, OPERM, SUBS, bias_ptr, 0, alpha, limit, False, 0)
                if FIN:
                    _arrive_and_finalize(c_ptr, stride_cm, fin_w_ptr, fin_s_ptr, fin_out_ptr, fin_count_ptr,
                                         routed_scale, pid_n, N, TOP_K, 16 * WN * RT, FIN_SHARED)
            return
    else:
        if ROW_START:
            base_m += tl.load(num_post_pad_ptr + 1)
        if base_m >= tl.load(num_post_pad_ptr):
            return
        e = tl.load(expert_ids_ptr + pid_m).to(tl.int64)

    tile0 = (pid_n * WN + wn) * RT                 # first of the warp's RT row tiles
    ok_w0 = tile0 * 16 < N
    ok_w1 = (tile0 + 1) * 16 < N
    ok_w2 = (tile0 + 2) * 16 < N
    ok_w3 = (tile0 + 3) * 16 < N
    j4 = tl.arange(0, 4)[None, :]
    wb = w_ptr + e * stride_we + tile0.to(tl.int64) * stride_wt + lane * 4
    sb = s_ptr + e * stride_se + tile0.to(tl.int64) * stride_st + lane
    wbu = wb + up_tiles * stride_wt
    sbu = sb + up_tiles * stride_st

    # token rows of the two 8-row tiles (lane group g = lane // 4 is the MMA's N index)
    slot0 = base_m + lane // 4
    slot1 = slot0 + 8
    # padding slots (sorted id == num_pairs) fetch nothing: masked copies zero-fill
    if PAIRWISE:
        pair0 = tl.where(lane // 4 == 0, pid_m, num_pairs)
    else:
        pair0 = tl.load(sorted_ids_ptr + slot0)
    pair1 = pair0
    if NT == 2:
        pair1 = tl.load(sorted_ids_ptr + slot1)
    ok0 = pair0 < num_pairs
    ok1 = pair1 < num_pairs
    if GATHER_A:
        row0 = tl.where(ok0, pair0 // TOP_K, 0)
        row1 = tl.where(ok1, pair1 // TOP_K, 0)
    else:  # rows of the previous GEMM's output, in slot order
        row0 = slot0
        row1 = slot1
    a32 = a_ptr.to(tl.pointer_type(tl.int32))
    # int32 offsets of lane t's 16-byte chunks in a loop step: natural K order (lane t's 4*SUBS words
    # contiguous: each load instruction uses half of every 32-byte sector it touches) or coalesced
    # (XCO: chunk (sub-step s, half h) of lanes t = 0..3 side by side, two whole sectors per row)
    XT: tl.constexpr = 4 if XCO else 8 * SUBS
    XS: tl.constexpr = 32 if XCO else 8
    XH: tl.constexpr = 16 if XCO else 4
    xb0 = a32 + row0.to(tl.int64) * stride_a32 + t * XT
    xb1 = a32 + row1.to(tl.int64) * stride_a32 + t * XT

    zero = tl.zeros([R, 4], dtype=tl.float32)
    g00, g01, g10, g11, g20, g21, g30, g31 = zero, zero, zero, zero, zero, zero, zero, zero
    u00, u01, u10, u11, u20, u21, u30, u31 = zero, zero, zero, zero, zero, zero, zero, zero
    for it in tl.range(0, num_steps // WK, num_stages=PIPE):
        ls = it * WK + wk
        wo = (ls * (SUBS * 128))[:, None] + j4
        xo = (ls * (32 * SUBS))[:, None] + j4
        so = ls * 32
        sg0, sg1, sg2, sg3 = _scales(sb, so, stride_st, ok_w0, ok_w1, ok_w2, ok_w3, RT)
        su0, su1, su2, su3 = sg0, sg1, sg2, sg3
        if GATED:
            su0, su1, su2, su3 = _scales(sbu, so, stride_st, ok_w0, ok_w1, ok_w2, ok_w3, RT)
        for s in tl.static_range(SUBS):
            # activations: L1-allocating copies (.ca): the WN warps of a program, and the programs
            # of the same token block on this SM, read the same rows
            xl0 = tl.load(xb0[:, None] + xo + XS * s, mask=ok0[:, None], other=0, cache_modifier=".ca")
            xh0 = tl.load(xb0[:, None] + xo + (XS * s + XH), mask=ok0[:, None], other=0, cache_modifier=".ca")
            xl1 = xl0
            xh1 = xh0
            if NT == 2:
                xl1 = tl.load(xb1[:, None] + xo + XS * s, mask=ok1[:, None], other=0, cache_modifier=".ca")
                xh1 = tl.load(xb1[:, None] + xo + (XS * s + XH), mask=ok1[:, None], other=0, cache_modifier=".ca")
            wg0, wg1, wg2, wg3 = _words(wb, wo + s * 128, stride_wt, ok_w0, ok_w1, ok_w2, ok_w3, RT)
            if s < SUBS // 2:
                g00, g01, g10, g11, g20, g21, g30, g31 = _substep(wg0, wg1, wg2, wg3, sg0, sg1, sg2, sg3, xl0, xh0, xl1, xh1,
                                                        g00, g01, g10, g11, g20, g21, g30, g31, ASM0, CONS, NT, RT)
            else:
                g00, g01, g10, g11, g20, g21, g30, g31 = _substep(wg0, wg1, wg2, wg3, sg0, sg1, sg2, sg3, xl0, xh0, xl1, xh1,
                                                        g00, g01, g10, g11, g20, g21, g30, g31, ASM1, CONS, NT, RT)
            if GATED:
                wu0, wu1, wu2, wu3 = _words(wbu, wo + s * 128, stride_wt, ok_w0, ok_w1, ok_w2, ok_w3, RT)
                if s < SUBS // 2:
                    u00, u01, u10, u11, u20, u21, u30, u31 = _substep(wu0, wu1, wu2, wu3, su0, su1, su2, su3, xl0, xh0, xl1,
                                                            xh1, u00, u01, u10, u11, u20, u21, u30, u31, ASM0, CONS, NT, RT)
                else:
                    u00, u01, u10, u11, u20, u21, u30, u31 = _substep(wu0, wu1, wu2, wu3, su0, su1, su2, su3, xl0, xh0, xl1,
                                                            xh1, u00, u01, u10, u11, u20, u21, u30, u31, ASM1, CONS, NT, RT)

    if PDL:
        gdc_launch_dependents()
    pg = tl.load(p_ptr + e * 2)
    pu = tl.load(p_ptr + e * 2 + 1)
    tile_base = pid_n * WN * RT
    b_row = bias_ptr + e * stride_be
    up_rows = up_tiles * 16
    # warp wn's row tiles are tile_base + wn * RT + r: store tile r of every warp with WN-strided tiles
    _store_tile(g00, u00, c_ptr, stride_cm, pg, pu, base_m, tile_base, N, GATED, WN, WK, RT, 0, OPERM, SUBS,
                b_row, up_rows, alpha, limit, BIAS, ACT)
    if NT == 2:
        _store_tile(g01, u01, c_ptr, stride_cm, pg, pu, base_m + 8, tile_base, N, GATED, WN, WK, RT, 0, OPERM, SUBS,
                b_row, up_rows, alpha, limit, BIAS, ACT)
    if RT >= 2:
        _store_tile(g10, u10, c_ptr, stride_cm, pg, pu, base_m, tile_base, N, GATED, WN, WK, RT, 1, OPERM, SUBS,
                b_row, up_rows, alpha, limit, BIAS, ACT)
        if NT == 2:
            _store_tile(g11, u11, c_ptr, stride_cm, pg, pu, base_m + 8, tile_base, N, GATED, WN, WK, RT, 1, OPERM, SUBS,
                b_row, up_rows, alpha, limit, BIAS, ACT)
    if RT == 4:
        _store_tile(g20, u20, c_ptr, stride_cm, pg, pu, base_m, tile_base, N, GATED, WN, WK, RT, 2, OPERM, SUBS,
                b_row, up_rows, alpha, limit, BIAS, ACT)
        _store_tile(g30, u30, c_ptr, stride_cm, pg, pu, base_m, tile_base, N, GATED, WN, WK, RT, 3, OPERM, SUBS,
                b_row, up_rows, alpha, limit, BIAS, ACT)
        if NT == 2:
            _store_tile(g21, u21, c_ptr, stride_cm, pg, pu, base_m + 8, tile_base, N, GATED, WN, WK, RT, 2, OPERM, SUBS,
                b_row, up_rows, alpha, limit, BIAS, ACT)
            _store_tile(g31, u31, c_ptr, stride_cm, pg, pu, base_m + 8, tile_base, N, GATED, WN, WK, RT, 3, OPERM, SUBS,
                b_row, up_rows, alpha, limit, BIAS, ACT)
    if FIN:
        _arrive_and_finalize(c_ptr, stride_cm, fin_w_ptr, fin_s_ptr, fin_out_ptr, fin_count_ptr, routed_scale,
                             pid_n, N, TOP_K, 16 * WN * RT, FIN_SHARED)


def coalesce_activations(x: torch.Tensor, fmt: str) -> torch.Tensor:
    """Activations [rows, K] (bf16, K a multiple of the loop step) reordered for the fragment kernel's
    XCO loads: inside each step, the 16-byte chunk of lane t and (sub-step s, half h) moves from
    t * 2*SUB + 2s + h (natural K order: a lane's K range is contiguous) to (2s + h) * 4 + t, so that
    the four lanes of a token row read 64 contiguous bytes per load instruction. The kernel computes
    the same products; GEMM1 writes its output in this order directly (OPERM)."""
    step, sub = STEP_K[fmt], SUB[fmt]
    rows, k = x.shape
    return x.reshape(rows, k // step, 4, 2 * sub, 8).transpose(2, 3).reshape(rows, k)


def emulate(fw: FragWeights, expert: int, x: torch.Tensor) -> torch.Tensor:
    """fp32 [M, N] = x [M <= 8, K] @ W[expert]^T computed the way the kernel does: per (row tile, step,
    sub-step, word) an A fragment from the decoded lane registers, a B fragment from the activation
    addresses the kernel loads (lane t: K offset 16*SUB*t + 16*s + 4*j, +2 for the high register),
    the m16n8k16 products, and the per-half multipliers. Pure torch (CPU tests of the layout)."""
    sub, step = fw.sub, STEP_K[fw.fmt]
    dec = fw._decoded(expert)                                   # [T, S, sub, 32, 4, 8]
    tiles, steps = dec.shape[0], dec.shape[1]
    xb = torch.zeros(8, fw.k, dtype=torch.float32, device=x.device)
    xb[: x.shape[0]] = x.float()
    lane = torch.arange(32)
    g, t = lane // 4, lane % 4
    p = torch.arange(8) % 4
    e = torch.arange(8) // 4
    a_row = (g[:, None] + 8 * (p[None, :] % 2))                 # [32, 8]
    a_kpos = (2 * t[:, None] + 8 * (p[None, :] // 2) + e[None, :])
    out = torch.zeros(fw.n, 8, dtype=torch.float32, device=x.device)
    for ls in range(steps):
        for s in range(sub):
            for j in range(4):
                # B[kpos, col]: lane (col, t) registers x_lo (kpos 2t, 2t+1) and x_hi (2t+8, 2t+9)
                bmat = torch.zeros(16, 8, dtype=torch.float32, device=x.device)
                for tt in range(4):   # int32 word 2j (low register) and 2j + 1 (high) of the lane's 16 K
                    k0 = ls * step + 16 * sub * tt + 16 * s + 4 * j
                    bmat[2 * tt: 2 * tt + 2] = xb[:, k0: k0 + 2].T
                    bmat[2 * tt + 8: 2 * tt + 10] = xb[:, k0 + 2: k0 + 4].T
                for tile in range(tiles):
                    amat = torch.zeros(16, 16, dtype=torch.float32, device=x.device)
                    amat[a_row, a_kpos] = dec[tile, ls, s, :, j, :]
                    out[tile * 16: tile * 16 + 16] += amat @ bmat
    half = fw.n // 2
    out[:half] *= fw.p[expert, 0]
    out[half:] *= fw.p[expert, 1]
    return out[:, : x.shape[0]].T



@functools.lru_cache(maxsize=None)
def frag_asm_args(fmt: str, nt: int, rt: int) -> dict:
    """Constexpr PTX of the two scale-group halves of a loop step, and its constraint string.
    Cached: generating it takes ~0.25 ms, and every launch asks (callers only unpack the dict)."""
    if rt not in (1, 2, 4) or nt not in (1, 2):
        raise ValueError(f"fragment kernel takes rt in (1, 2, 4) and nt in (1, 2), got rt={rt}, nt={nt}")
    mul, add = (_NV_MUL, _NV_ADD) if fmt == "nvfp4" else (_MX_MUL, _MX_ADD)
    return dict(ASM0=_asm(nt, rt, 0, mul, add), ASM1=_asm(nt, rt, 1, mul, add), CONS=_constraints(nt, rt))
