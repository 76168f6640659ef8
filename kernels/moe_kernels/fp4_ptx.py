"""PTX text of the in-register E2M1 -> bf16x2 decode, shared by the Triton FP4 kernels.

A code c placed as bf16 bits (c & 8) << 12 | (c & 7) << 6 is exactly value * 2^-126 (e = 0 codes are
bf16 subnormals, which fma.rn.bf16x2 keeps), so one bf16x2 FMA by S = scale * 2^(126 - k) gives the
weight * 2^-k, two per instruction. Two ways to place a pair of codes (one per 16-bit half):
- `pair_mul`: codes at bits 0-3 / 16-19 (or 4-7 / 20-23, `high`) of src: (src & mask) * 0x1040
  (0x104) puts c & 7 at bits 6-8 and c & 8 at bit 15 of each half without carries; one mask keeps them.
- `pair_shift`: codes at bits 0-3 / 16-19 after a shift of 6 (or 4-7 / 20-23 and 2): two shifts, two
  masks and an or (the older kernels' form).
"""

from __future__ import annotations

KEEP = "0x81C081C0"     # bf16 bits 15 (sign) and 6-8 (exponent/mantissa of the code) in both halves
NEG_ZERO2 = "0x80008000"  # -0 in both halves: the FMA addend that leaves products (and signed zeros) exact


def pair_mul(dst: str, src: str, high: bool, scale: str, tmp: str = "a", zero: str = "z") -> list[str]:
    mask, mul = ("0x00F000F0", "0x104") if high else ("0x000F000F", "0x1040")
    return [f"and.b32 {tmp}, {src}, {mask};", f"mul.lo.u32 {tmp}, {tmp}, {mul};", f"and.b32 {tmp}, {tmp}, {KEEP};",
            f"fma.rn.bf16x2 {dst}, {tmp}, {scale}, {zero};"]


def pair_shift(dst: str, src: str, high: bool, scale: str) -> list[str]:
    s = 2 if high else 6
    return [f"shl.b32 a, {src}, {s};", f"shl.b32 b, {src}, {s + 6};", "and.b32 a, a, 0x01C001C0;",
            "and.b32 b, b, 0x80008000;", "or.b32 a, a, b;", f"fma.rn.bf16x2 {dst}, a, {scale}, z;"]


def block(regs: str, body: list[str]) -> str:
    """One inline-asm string: scoped register declarations, the -0 constant, the body."""
    return "\n".join(["", "{", f".reg .b32 {regs};", f"mov.b32 z, {NEG_ZERO2};", *body, "}", ""])


# The fragment kernel's word layout (triton_frag.py): the packing puts the 8 codes of a 32-bit word
# wherever these four integer ops need them, so one word becomes the 4 bf16x2 registers of an A
# fragment with 1 + 2 + 2 + 3 integer instructions (a nibble layout needs 3 per register, + a shift).
# Three rotations of KEEP cannot tile 32 bits (checked exhaustively), so the fourth register takes
# the multiply form: bits (0,1,3,4) -> (7,8,15,6) of each half, no carries.
WORD_OPS = (("and",), ("rotr", 3), ("rotr", 6), ("mul", 0x001B001B, 0x1084))


def word_pair(dst: str, src: str, k: int, scale: str, tmp: str = "v", zero: str = "z") -> list[str]:
    """PTX: A register k (0..3) of the word `src` as bf16x2, times the scale pair."""
    op = WORD_OPS[k]
    if op[0] == "and":
        ints = [f"and.b32 {tmp}, {src}, {KEEP};"]
    elif op[0] == "rotr":
        ints = [f"shf.r.wrap.b32 {tmp}, {src}, {src}, {op[1]};", f"and.b32 {tmp}, {tmp}, {KEEP};"]
    else:
        ints = [f"and.b32 {tmp}, {src}, {op[1]:#010x};", f"mul.lo.u32 {tmp}, {tmp}, {op[2]:#x};",
                f"and.b32 {tmp}, {tmp}, {KEEP};"]
    return ints + [f"fma.rn.bf16x2 {dst}, {tmp}, {scale}, {zero};"]


def word_pair_bits(w, k: int):
    """The integer part of `word_pair` on unsigned 32-bit values (int, or an int64 torch tensor):
    the bf16x2 bits of register k before the scale. The packing and the CPU mirror use it."""
    op = WORD_OPS[k]
    m32 = 0xFFFFFFFF
    keep = int(KEEP, 16)
    if op[0] == "and":
        return w & keep
    if op[0] == "rotr":
        r = op[1]
        return (((w >> r) | (w << (32 - r))) & m32) & keep
    return (((w & op[1]) * op[2]) & m32) & keep
