"""DeepseekV3ForCausalLM (also Kimi-K2): MLA attention, dense first layers, grouped-routing MoE with
shared experts. Compact inference-only implementation over a slot-indexed latent KV cache.

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

from .model_common import (Linear, RMSNorm, Rope, SwiGLU, causal_slot_mask, masked_softmax_attention,
                           rope_parameters)
from .model_spec import is_moe_layer


class MLAttention(nn.Module):
    def __init__(self, cfg: dict[str, Any], w: Callable[[str], torch.Tensor], p: str, rope: Rope, softmax_mult: float):
        super().__init__()
        self.nh = cfg["num_attention_heads"]
        self.nope, self.rope_dim = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"]
        self.v_dim, self.kv_lora = cfg["v_head_dim"], cfg["kv_lora_rank"]
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
        self.o_proj = Linear(w(p + "o_proj.weight"))
        self.rope = rope
        self.scale = (self.nope + self.rope_dim) ** -0.5 * softmax_mult
        self.cache_ckv: torch.Tensor | None = None
        self.cache_krot: torch.Tensor | None = None

    def allocate(self, slots: int, max_len: int, dtype: torch.dtype, device) -> None:
        self.cache_ckv = torch.zeros(slots, max_len, self.kv_lora, dtype=dtype, device=device)
        self.cache_krot = torch.zeros(slots, max_len, self.rope_dim, dtype=dtype, device=device)

    def forward(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, cos_sin, kv_len: int) -> torch.Tensor:
        B, S, _ = x.shape
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q = q.view(B, S, self.nh, self.nope + self.rope_dim)
        q_nope, q_rot = q.split([self.nope, self.rope_dim], dim=-1)
        ckv, k_rot = self.kv_a_proj_with_mqa(x).split([self.kv_lora, self.rope_dim], dim=-1)
        ckv = self.kv_a_layernorm(ckv)
        cos, sin = cos_sin
        q_rot = self.rope.apply(q_rot, cos, sin)
        k_rot = self.rope.apply(k_rot[:, :, None, :], cos, sin)[:, :, 0]
        self.cache_ckv[slots[:, None], positions] = ckv.to(self.cache_ckv.dtype)
        self.cache_krot[slots[:, None], positions] = k_rot.to(self.cache_krot.dtype)
        c = self.cache_ckv[slots, :kv_len]  # [B, L, c]
        kr = self.cache_krot[slots, :kv_len]  # [B, L, r]
        q_abs = torch.einsum("bshd,hdc->bhsc", q_nope, self.w_uk)
        scores = torch.einsum("bhsc,blc->bhsl", q_abs, c) + torch.einsum("bshr,blr->bhsl", q_rot, kr)
        probs = masked_softmax_attention(scores * self.scale, causal_slot_mask(positions, kv_len)).to(x.dtype)
        o_lat = torch.einsum("bhsl,blc->bshc", probs, c)
        o = torch.einsum("bshc,hvc->bshv", o_lat, self.w_uv).reshape(B, S, self.nh * self.v_dim)
        return self.o_proj(o)


class DecoderLayer(nn.Module):
    def __init__(self, attn: nn.Module, mlp: nn.Module, ln1: torch.Tensor, ln2: torch.Tensor, eps: float):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(ln1, eps), RMSNorm(ln2, eps)

    def forward(self, x, positions, slots, cos_sin, kv_len):
        x = x + self.self_attn(self.input_layernorm(x), positions, slots, cos_sin, kv_len)
        h = self.post_attention_layernorm(x)
        B, S, H = h.shape
        return x + self.mlp(h.reshape(B * S, H)).reshape(B, S, H)


class CausalLM(nn.Module):
    """Shared top: embeddings, layers, final norm, lm_head, cache allocation and forward."""

    def __init__(self, cfg: dict[str, Any], w: Callable[[str], torch.Tensor], layers: list[nn.Module], rope: Rope):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Parameter(w("model.embed_tokens.weight"), requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(w("model.norm.weight"), cfg.get("rms_norm_eps", 1e-6))
        head = self.embed_tokens if cfg.get("tie_word_embeddings") else w("lm_head.weight")
        self.lm_head = Linear(head)
        # the rope table lives with the weights: a CPU buffer would mean a host->device copy (and a
        # sync, which CUDA-graph capture refuses) in every forward
        rope.inv_freq = rope.inv_freq.to(self.embed_tokens.device)
        self.rope = rope
        self.max_len = 0

    def allocate_cache(self, slots: int, max_len: int) -> None:
        dtype, device = self.embed_tokens.dtype, self.embed_tokens.device
        for layer in self.layers:
            layer.self_attn.allocate(slots, max_len, dtype, device)
        self.max_len = max_len

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                last_only: bool = False, last_index: torch.Tensor | None = None,
                kv_len: int | None = None) -> torch.Tensor:
        """input_ids/positions [B, S], slots [B] -> logits fp32 [B, S, V]; [B, 1, V] with `last_only`
        (the last column) or `last_index` [B] (each row's own last real token: right-padded prefill).
        `kv_len` fixes how many cache positions are attended (CUDA graphs: no host sync, static shapes);
        by default the longest position in the batch."""
        x = F.embedding(input_ids, self.embed_tokens)
        kv_len = kv_len or int(positions.max()) + 1
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, positions, slots, cos_sin, kv_len)
        if last_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last_index][:, None]
        elif last_only:
            x = x[:, -1:]
        return self.lm_head(self.norm(x)).float()


def build(cfg: dict[str, Any], w: Callable[[str], torch.Tensor], make_moe: Callable[[int, str], nn.Module]) -> CausalLM:
    """`w(name)` returns a loaded dense tensor; `make_moe(layer, prefix)` builds the MoE block."""
    inv_freq, cs_scale, softmax_mult = rope_parameters(cfg, cfg["qk_rope_head_dim"])
    rope = Rope(inv_freq, cs_scale, interleave=cfg.get("rope_interleave", True))
    layers = build_layers(cfg, w, lambda p: MLAttention(cfg, w, p + "self_attn.", rope, softmax_mult), make_moe)
    return CausalLM(cfg, w, layers, rope)


def build_layers(cfg: dict[str, Any], w: Callable[[str], torch.Tensor], make_attn: Callable[[str], nn.Module],
                 make_moe: Callable[[int, str], nn.Module]) -> list[DecoderLayer]:
    """Decoder layers of either family: attention by `make_attn(prefix)`, MoE or dense SwiGLU MLP."""
    eps = cfg.get("rms_norm_eps", 1e-6)
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if is_moe_layer(cfg, i):
            mlp = make_moe(i, p + "mlp.")
        else:
            mlp = SwiGLU(w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"), w(p + "mlp.down_proj.weight"))
        layers.append(DecoderLayer(make_attn(p), mlp, w(p + "input_layernorm.weight"),
                                   w(p + "post_attention_layernorm.weight"), eps))
    return layers
