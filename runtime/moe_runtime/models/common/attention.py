"""The paged GQA attention shared by the GQA architectures: the K/V caches of a layer and the tail of
its forward (write this call's keys and values at their slots, then the Triton decode kernel for one
token per row on CUDA, or the torch reference over the block table), with optional per-head sinks
and a sliding window."""

from __future__ import annotations

import torch
from moe_kernels import paged_attention as pa


class GqaKvCache:
    """The paged K and V caches of a GQA attention layer: [blocks, block size, KV heads, head dim]
    each (the layer sets self.nkv and self.hd, its rank's KV heads and the head size)."""

    nkv: int
    hd: int
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None

    def kv_values_per_token(self) -> int:
        return 2 * self.nkv * self.hd

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        self.k_cache = torch.zeros(num_blocks, block_size, self.nkv, self.hd, dtype=dtype, device=device)
        self.v_cache = torch.zeros(num_blocks, block_size, self.nkv, self.hd, dtype=dtype, device=device)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx, scale: float,
               sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """q [B, S, heads, d], k/v [B, S, KV heads, d] (roped) -> [B, S, heads * d]: the new keys and
        values written at ctx.slots, each query attending to its sequence's cached positions."""
        B, S = q.shape[:2]
        pa.write_kv(self.k_cache, ctx.slots, k)
        pa.write_kv(self.v_cache, ctx.slots, v)
        extra = () if sinks is None and window is None else (sinks, window)
        if ctx.decode_kernel:
            o = pa.paged_decode_gqa(q[:, 0].contiguous(), self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                                    scale, *extra)[:, None]
        else:
            o = pa.paged_attention_gqa(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.positions, ctx.kv_len,
                                       scale, *extra)
        return o.reshape(B, S, -1)
