"""The shared model top of every architecture: the causal LM (embeddings, decoder layers, final
norm, lm_head, cache allocation), the decoder-layer assembly, RMSNorm, the SwiGLU MLP and the
attention context of one forward call. An architecture's folder supplies its attention and its
routing; no architecture imports another's.

Batching model: a paged KV cache (moe_runtime.kv_cache keeps the books). A forward call takes
`input_ids [B, S]`, `positions [B, S]` and `block_tables [B, nb]` (each row's block ids); new
keys/values are written at their slot (`block_tables[b, p // bs] * bs + p % bs`) and each query attends
to its own sequence's positions `<= its own position`, read through its block table
(moe_kernels.paged_attention: the torch reference on CPU and for prefill chunks, the Triton decode
kernels on GPU). One code path serves prefill chunks over a cached prefix (B=1, S=chunk) and batched
decode (B=running, S=1).
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.nn.functional as F
from torch import nn
from moe_kernels import paged_attention as pa

from ...dist.layers import RowParallelLinear, embed, gather_vocab
from ...model_spec import is_moe_layer
from .attention import kv_cache_torch_dtype
from .rope import Rope


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # fp32 statistics, output cast back before the weight multiply (HF's order, so fp32/bf16 match it)
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


class RMSNorm(nn.Module):
    def __init__(self, weight: torch.Tensor, eps: float):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)


class Linear(nn.Module):
    """A bias-free linear over an already-loaded weight [out, in]."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SwiGLU(nn.Module):
    """Dense MLP / shared expert: down(silu(gate(x)) * up(x)). `reduce` ("world"): the weights are this
    rank's intermediate slice and down's output is all-reduced over `group` (dist.layers.RowParallelLinear);
    None: the caller reduces (the shared expert, inside the MoE block's one all-reduce)."""

    def __init__(self, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor, reduce: str | None = None,
                 group=None):
        super().__init__()
        self.gate_proj, self.up_proj = Linear(gate), Linear(up)
        self.down_proj = RowParallelLinear(down, reduce, group) if reduce else Linear(down)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


# ------------------------------------------------------------------------------------------------
# Attention context: what every layer's attention needs of one forward call

class AttnContext:
    """positions [B, S], block_tables [B, nb], slots [B, S] (where this call's tokens are written),
    kv_len (positions attended, host int), seq_lens [B] (decode: position + 1), and whether the
    Triton decode kernels run (CUDA, one token per row)."""

    def __init__(self, positions: torch.Tensor, block_tables: torch.Tensor, block_size: int, kv_len: int):
        self.positions, self.block_tables, self.kv_len = positions, block_tables, kv_len
        self.slots = pa.slot_mapping(block_tables, positions, block_size)
        self.decode_kernel = positions.is_cuda and positions.shape[1] == 1 and pa.triton is not None
        self.seq_lens = positions[:, -1] + 1


# ------------------------------------------------------------------------------------------------
# Decoder layers and the causal LM

class DecoderLayer(nn.Module):
    norm = RMSNorm  # an architecture with its own norm (gpt-oss) sets its class here

    def __init__(self, attn: nn.Module, mlp: nn.Module, ln1: torch.Tensor, ln2: torch.Tensor, eps: float):
        super().__init__()
        self.self_attn, self.mlp = attn, mlp
        self.input_layernorm, self.post_attention_layernorm = self.norm(ln1, eps), self.norm(ln2, eps)

    def forward(self, x, ctx: AttnContext, cos_sin):
        x = x + self.self_attn(self.input_layernorm(x), ctx, cos_sin)
        h = self.post_attention_layernorm(x)
        B, S, H = h.shape
        return x + self.mlp(h.reshape(B * S, H)).reshape(B, S, H)


class CausalLM(nn.Module):
    """Shared top: embeddings, layers, final norm, lm_head, paged-cache allocation and forward. `group`
    (moe_runtime.dist.group.Group, None for one process): the vocab-parallel embedding and LM head's."""

    def __init__(self, cfg: dict[str, Any], w: Callable[[str], torch.Tensor], layers: list[nn.Module], rope: Rope,
                 group=None):
        super().__init__()
        self.cfg, self.group = cfg, group
        self.embed_tokens = nn.Parameter(w("model.embed_tokens.weight"), requires_grad=False)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(w("model.norm.weight"), cfg.get("rms_norm_eps", 1e-6))
        head = self.embed_tokens if cfg.get("tie_word_embeddings") else w("lm_head.weight")
        self.lm_head = Linear(head)
        # the rope table lives with the weights: a CPU buffer would mean a host->device copy (and a
        # sync, which CUDA-graph capture refuses) in every forward
        rope.inv_freq = rope.inv_freq.to(self.embed_tokens.device)
        self.rope = rope
        self.block_size = 0

    def kv_bytes_per_block(self, block_size: int, kv_cache_dtype: str = "auto") -> int:
        """Bytes of KV cache one block of `block_size` tokens takes over all layers, in the cache's
        element size (`kv_cache_dtype` "fp8": one byte, half of bf16's)."""
        item = torch.empty((), dtype=kv_cache_torch_dtype(kv_cache_dtype, self.embed_tokens.dtype)).element_size()
        return sum(layer.self_attn.kv_values_per_token() for layer in self.layers) * block_size * item

    def allocate_kv(self, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto") -> None:
        """Every layer's paged cache: [num_blocks, block_size, ...] (the previous one is dropped first),
        in the model's dtype ("auto") or e4m3 with the layer's checkpoint scales ("fp8")."""
        dtype, device = kv_cache_torch_dtype(kv_cache_dtype, self.embed_tokens.dtype), self.embed_tokens.device
        for layer in self.layers:
            layer.self_attn.allocate(0, block_size, dtype, device)
        for layer in self.layers:
            layer.self_attn.allocate(num_blocks, block_size, dtype, device)
        self.block_size = block_size

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
                last_only: bool = False, last_index: torch.Tensor | None = None,
                kv_len: int | None = None) -> torch.Tensor:
        """input_ids/positions [B, S], block_tables [B, nb] -> logits fp32 [B, S, V]; [B, 1, V] with
        `last_only` (the last column) or `last_index` [B] (each row's own last token). `kv_len` fixes how
        many cache positions are attended (CUDA graphs: no host sync, static shapes); by default the
        longest position in the batch + 1."""
        x = embed(input_ids, self.embed_tokens, self.group)  # vocab-parallel under tensor parallelism
        ctx = AttnContext(positions, block_tables, self.block_size, kv_len or int(positions.max()) + 1)
        cos_sin = self.rope.cos_sin(positions, x.dtype)
        for layer in self.layers:
            x = layer(x, ctx, cos_sin)
        if last_index is not None:
            x = x[torch.arange(x.shape[0], device=x.device), last_index][:, None]
        elif last_only:
            x = x[:, -1:]
        return gather_vocab(self.lm_head(self.norm(x)), self.group).float()


def build_layers(cfg: dict[str, Any], w: Callable[[str], torch.Tensor], make_attn: Callable[[str], nn.Module],
                 make_moe: Callable[[int, str], nn.Module], group=None) -> list[DecoderLayer]:
    """Decoder layers of either family: attention by `make_attn(prefix)`, MoE or dense SwiGLU MLP."""
    eps = cfg.get("rms_norm_eps", 1e-6)
    layers = []
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        if is_moe_layer(cfg, i):
            mlp = make_moe(i, p + "mlp.")
        else:
            mlp = SwiGLU(w(p + "mlp.gate_proj.weight"), w(p + "mlp.up_proj.weight"), w(p + "mlp.down_proj.weight"),
                         reduce="world", group=group)
        layers.append(DecoderLayer(make_attn(p), mlp, w(p + "input_layernorm.weight"),
                                   w(p + "post_attention_layernorm.weight"), eps))
    return layers
