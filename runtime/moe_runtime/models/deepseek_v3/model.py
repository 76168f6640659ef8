"""DeepseekV3ForCausalLM (also Kimi-K2): MLA attention, dense first layers, grouped-routing MoE with
shared experts. Compact inference-only implementation over a paged latent KV cache.

MLA is computed in the "absorbed" form: the cache holds the normalised latent `c_kv` [kv_lora] and
the roped `k_rot` [rope_dim] per position (576 values per token for the real model instead of
128 heads x 320), and `kv_b_proj` is folded into the query and the output. Mathematically identical
to HF's expanded form.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn

from moe_kernels import paged_attention as pa

from ...dist.layers import RowParallelLinear
from ...errors import RuntimeFailure
from ..common.attention import checkpoint_kv_scales
from ..common.layers import AttnContext, CausalLM, Linear, RMSNorm, SwiGLU, build_layers
from ..common.moe import MoEBlock, RoutingConfig
from ..common.rope import Rope, rope_parameters


class MLAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], w: Callable[[str], torch.Tensor], p: str, rope: Rope, softmax_mult: float,
                 group=None):
        super().__init__()
        self.nope, self.rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.v_dim, self.kv_lora = cfg["v_head_dim"], cfg["kv_lora_rank"]
        # heads on this rank, from the (possibly tensor-parallel) slice the loader gave
        self.nh = w(p + "kv_b_proj.weight").shape[0] // (self.nope + self.v_dim)
        eps = cfg.get("rms_norm_eps", 1e-6)
        self.q_lora = bool(cfg.get("q_lora_rank"))
        if self.q_lora:
            self.q_a_proj = Linear(w(p + "q_a_proj.weight"))
            self.q_a_layernorm = RMSNorm(w(p + "q_a_layernorm.weight"), eps)
            self.q_b_proj = Linear(w(p + "q_b_proj.weight"))
        else:
            self.q_proj = Linear(w(p + "q_proj.weight"))
        self.kv_a_proj_with_mqa = Linear(w(p + "kv_a_proj_with_mqa.weight"))
        self.kv_a_layernorm = RMSNorm(w(p + "kv_a_layernorm.weight"), eps)
        kv_b = w(p + "kv_b_proj.weight").view(self.nh, self.nope + self.v_dim, self.kv_lora)
        self.w_uk = nn.Parameter(kv_b[:, : self.nope].contiguous(), requires_grad=False)  # [h, nope, c]
        self.w_uv = nn.Parameter(kv_b[:, self.nope:].contiguous(), requires_grad=False)  # [h, v, c]
        self.o_proj = RowParallelLinear(w(p + "o_proj.weight"), "attn", group)
        self.rope = rope
        self.scale = (self.nope + self.rope_dim) ** -0.5 * softmax_mult
        self.cache_ckv: torch.Tensor | None = None
        self.cache_krot: torch.Tensor | None = None
        # one scale for the latent cache (c_kv and k_rot): vLLM 0.11.0's MLA writes it with the layer's
        # k_scale (v1/attention/backends/mla/common.py, concat_and_cache_mla(..., scale=layer._k_scale))
        self.ckpt_kv_scale = checkpoint_kv_scales(w, p)[0]
        self.kv_scale = 1.0  # in use: ckpt_kv_scale with an fp8 cache, else 1.0

    def kv_values_per_token(self) -> int:
        return self.kv_lora + self.rope_dim  # the compressed latent + the roped key, shared by all heads

    def allocate(self, num_blocks: int, block_size: int, dtype: torch.dtype, device) -> None:
        self.cache_ckv = torch.zeros(num_blocks, block_size, self.kv_lora, dtype=dtype, device=device)
        self.cache_krot = torch.zeros(num_blocks, block_size, self.rope_dim, dtype=dtype, device=device)
        self.kv_scale = self.ckpt_kv_scale if dtype == pa.FP8 else 1.0

    def forward(self, x: torch.Tensor, ctx: AttnContext, cos_sin) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(B, S, self.nh, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        ckv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        ckv = self.kv_a_layernorm(ckv)
        cos, sin = cos_sin
        q_rot = self.rope.apply(q_rot, cos, sin)
        k_rot = self.rope.apply(k_rot[:, :, None, :], cos, sin)[:, :, 0]
        pa.write_kv(self.cache_ckv, ctx.slots, ckv, scale=self.kv_scale)
        pa.write_kv(self.cache_krot, ctx.slots, k_rot, scale=self.kv_scale)
        if ctx.decode_kernel:
            q_abs = torch.einsum("bshd,hdc->bshc", q_nope, self.w_uk)
            o_lat = pa.paged_decode_mla(q_abs[:, 0].contiguous(), q_rot[:, 0].contiguous(), self.cache_ckv,
                                        self.cache_krot, ctx.block_tables, ctx.seq_lens, self.scale,
                                        kv_scale=self.kv_scale)[:, None]
            o = torch.einsum("bshc,hvc->bshv", o_lat, self.w_uv)
        else:  # prefill/extend: the absorbed or the non-absorbed form, whichever needs fewer FLOPs (on CUDA)
            o = pa.paged_attention_mla_heads(q_nope, q_rot, self.cache_ckv, self.cache_krot, self.w_uk, self.w_uv,
                                             ctx.block_tables, ctx.positions, ctx.kv_len, self.scale,
                                             kv_scale=self.kv_scale)
        return self.o_proj(o.reshape(B, S, self.nh * self.v_dim))


def routing(cfg: dict[str, Any]) -> RoutingConfig:
    """noaux_tc grouped top-k over sigmoid scores with the e_score_correction_bias; routed_scaling_factor
    is applied in the finalize."""
    if cfg.get("scoring_func", "sigmoid") != "sigmoid" or cfg.get("topk_method", "noaux_tc") != "noaux_tc":
        raise RuntimeFailure(f"DeepSeek routing scoring_func={cfg.get('scoring_func')} topk_method="
                             f"{cfg.get('topk_method')} is not supported (sigmoid/noaux_tc only)")
    return RoutingConfig("grouped", cfg["num_experts_per_tok"], bool(cfg.get("norm_topk_prob", True)),
                         int(cfg.get("n_group") or 1), int(cfg.get("topk_group") or 1),
                         float(cfg.get("routed_scaling_factor") or 1.0))


def build(cfg: dict[str, Any], w: Callable[[str], torch.Tensor], experts: Callable[[int], Any],
          deferred: bool, group=None) -> CausalLM:
    """`w(name)` returns a loaded dense tensor (`w.get(name)` one that may be absent); `experts(layer)`
    the experts backend of an MoE layer; `deferred`: fuse the shared expert into the finalize."""
    r = routing(cfg)

    def make_moe(i: int, p: str) -> MoEBlock:
        shared = None
        if w.has(p + "shared_experts.gate_proj.weight"):
            shared = SwiGLU(w(p + "shared_experts.gate_proj.weight"), w(p + "shared_experts.up_proj.weight"),
                            w(p + "shared_experts.down_proj.weight"))
        return MoEBlock(w(p + "gate.weight"), w(p + "gate.e_score_correction_bias"), r, experts(i), shared, deferred,
                        group)

    inv_freq, cs_scale, softmax_mult = rope_parameters(cfg, cfg["qk_rope_head_dim"])
    rope = Rope(inv_freq, cs_scale, interleave=cfg.get("rope_interleave", True))
    layers = build_layers(cfg, w, lambda p: MLAttention(cfg, w, p + "self_attn.", rope, softmax_mult, group),
                          make_moe, group)
    return CausalLM(cfg, w, layers, rope, group)
