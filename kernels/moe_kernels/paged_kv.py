"""The paged KV cache's storage: where a token's slot is, writing into it (FP8 quantization) and
gathering a row's prefix back (dequantized). Shared by the torch reference (moe_kernels.paged_attention)
and the Triton prefill (moe_kernels.attention_prefill), which sit above it.

Layout (one tensor per layer and kind): `[num_blocks, block_size, ...]`; a sequence's token t is at
`cache[block_table[t // block_size], t % block_size]`; `slot = block * block_size + row` indexes the
same cache viewed as `[num_blocks * block_size, ...]`. An FP8 (e4m3fn) cache holds value / scale.
"""

from __future__ import annotations

import math

import torch


def slot_mapping(block_tables: torch.Tensor, positions: torch.Tensor, block_size: int) -> torch.Tensor:
    """[B, S] flat cache slots of the tokens at `positions` [B, S]."""
    blk = torch.gather(block_tables, 1, torch.div(positions, block_size, rounding_mode="floor"))
    return blk * block_size + positions % block_size


FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # e4m3fn's largest finite value: torch's cast gives NaN beyond it, so writes saturate


def quantize_fp8(values: torch.Tensor, scale: float) -> torch.Tensor:
    """values / scale in e4m3, saturated at +-448."""
    return (values.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def write_kv(cache: torch.Tensor, slots: torch.Tensor, values: torch.Tensor, scale: float = 1.0) -> None:
    """cache [NB, bs, ...]; slots [B, S]; values [B, S, ...]. An fp8 cache stores values / scale."""
    flat = cache.view(-1, *cache.shape[2:])
    v = values.reshape(-1, *values.shape[2:])
    if cache.dtype == FP8:
        v = quantize_fp8(v, scale)
    elif scale != 1.0:
        raise ValueError(f"write_kv: a scale ({scale}) applies to an fp8 cache only, not {cache.dtype}")
    flat[slots.reshape(-1)] = v.to(cache.dtype)


def _dequant(x: torch.Tensor, dtype: torch.dtype, scale: float) -> torch.Tensor:
    """A gathered cache slice in the query's dtype (an fp8 slice times its scale, in fp32 first)."""
    if x.dtype == FP8:
        return (x.float() * scale).to(dtype)
    return x.to(dtype)


def gather_kv(cache: torch.Tensor, block_tables: torch.Tensor, kv_len: int) -> torch.Tensor:
    """[B, kv_len, ...]: each row's first kv_len cached tokens, read through its block table."""
    bs = cache.shape[1]
    nb = math.ceil(kv_len / bs)
    g = cache[block_tables[:, :nb]]  # [B, nb, bs, ...]
    return g.reshape(g.shape[0], nb * bs, *cache.shape[2:])[:, :kv_len]
