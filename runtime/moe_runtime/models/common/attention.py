"""The paged GQA attention shared by the GQA architectures: the K/V caches of a layer and the tail of
its forward (write this call's keys and values at their slots, then the Triton decode kernel for one
token per row on CUDA, or the torch reference over the block table), with optional per-head sinks
and a sliding window; and the checkpoint's FP8 KV-cache scales, which the MLA layer reads too.

KV cache dtypes (`--kv-cache-dtype`, vLLM's flag): "auto" is the model's dtype; "fp8" is e4m3 with one
scale per tensor (vLLM's k_scale / v_scale), values / scale stored and saturated at +-448 by
moe_kernels.paged_attention.write_kv."""

from __future__ import annotations

import torch
from moe_kernels import paged_attention as pa

KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")  # vLLM 0.11.0 config/cache.py CacheDType: "fp8 (=fp8_e4m3)"


def kv_cache_torch_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in ("fp8", "fp8_e4m3"):
        return pa.FP8
    raise ValueError(f"kv cache dtype {kv_cache_dtype!r}: expected one of {', '.join(KV_CACHE_DTYPES)}")


def checkpoint_kv_scales(w, p: str) -> tuple[float, float]:
    """(k_scale, v_scale) of attention prefix `p` (`model.layers.{i}.self_attn.`) as vLLM 0.11.0 reads
    them: `{p}k_scale` / `{p}v_scale`, or ModelOpt's `{p}k_proj.k_scale` / `{p}v_proj.v_scale`
    (weight_utils.py maybe_remap_kv_scale_name), or the deprecated single `{p}kv_scale` for both; one of
    the pair alone is used for both (the larger, BaseKVCacheMethod.process_weights_after_loading in
    quantization/kv_cache.py); none: 1.0 each."""
    def read(*names):
        for n in names:
            if w.has(p + n):
                t = w(p + n)
                if t.numel() != 1:
                    raise ValueError(f"{p + n}: a per-tensor KV-cache scale has one value, found shape {list(t.shape)}")
                v = float(t.float().reshape(()).item())
                if not v > 0 or v == float("inf"):
                    raise ValueError(f"{p + n}: KV-cache scale {v} must be a finite positive number")
                return v
        return None

    k, v = read("k_scale", "k_proj.k_scale"), read("v_scale", "v_proj.v_scale")
    if k is None and v is None:
        k = v = read("kv_scale")
    if k is None and v is None:
        return 1.0, 1.0
    if k is None or v is None:
        k = v = max(x for x in (k, v) if x is not None)
    return k, v


class GqaKvCache:
    """The paged K and V caches of a GQA attention layer: [blocks, block size, KV heads, head dim]
    each (the layer sets self.nkv and self.hd, its rank's KV heads and the head size)."""

    nkv: int
    hd: int
    k_cache: torch.Tensor | None = None
    v_cache: torch.Tensor | None = None
    kv_scales: tuple[float, float] = (1.0, 1.0)  # the checkpoint's (k_scale, v_scale): set by the layer
    k_scale, v_scale = 1.0, 1.0  # the scales in use: kv_scales with an fp8 cache, else 1.0 (as vLLM)

    def kv_values_per_token(self) -> int:
        return 2 * self.nkv * self.hd

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        self.k_cache = torch.zeros(num_blocks, block_size, self.nkv, self.hd, dtype=dtype, device=device)
        self.v_cache = torch.zeros(num_blocks, block_size, self.nkv, self.hd, dtype=dtype, device=device)
        self.k_scale, self.v_scale = self.kv_scales if dtype == pa.FP8 else (1.0, 1.0)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx, scale: float,
               sinks: torch.Tensor | None = None, window: int | None = None) -> torch.Tensor:
        """q [B, S, heads, d], k/v [B, S, KV heads, d] (roped) -> [B, S, heads * d]: the new keys and
        values written at ctx.slots, each query attending to its sequence's cached positions."""
        B, S = q.shape[:2]
        ks, vs = self.k_scale, self.v_scale
        pa.write_kv(self.k_cache, ctx.slots, k, scale=ks)
        pa.write_kv(self.v_cache, ctx.slots, v, scale=vs)
        if ctx.decode_kernel:
            o = pa.paged_decode_gqa(q[:, 0].contiguous(), self.k_cache, self.v_cache, ctx.block_tables, ctx.seq_lens,
                                    scale, sinks, window, k_scale=ks, v_scale=vs)[:, None]
        else:
            o = pa.paged_attention_gqa(q, self.k_cache, self.v_cache, ctx.block_tables, ctx.positions, ctx.kv_len,
                                       scale, sinks, window, k_scale=ks, v_scale=vs)
        return o.reshape(B, S, -1)
