"""The byte and FLOP limits of one serving step (bench_runtime.py), as pure functions.

Decode roofline of one step = bytes it must read / measured copy bandwidth, where the bytes are
- every dense tensor (attention, dense MLPs, shared experts, router, norms, final norm, lm_head);
  of the embedding only the B rows looked up;
- the routed experts the batch touches, in their checkpoint format (weights + scales + biases),
  in every MoE layer: E * (1 - (1 - k/E)^B) of them, the expectation under uniform routing
  (random weights route near-uniformly; the real count is not observable through the public API);
- the KV cache of every row once: its context (a sliding-window layer: at most its window) x
  that layer's KV bytes per token.
Activations and the KV write of the new token are left out (under 0.1% at these sizes).

Prefill FLOPs (model FLOPs, the MFU convention): 2 x matmul parameters per token (dense weights
without embedding and lm_head, plus k experts in each MoE layer), the lm_head for the last token
only (the engine computes no other logits), and causal attention 2 x heads x (qk dim + v dim) per
(query, attended key) pair (MLA in its non-absorbed form: qk = nope + rope, v = v_head_dim).

Weight bytes come from the checkpoint's safetensors headers (what the runtime loads); the attention
shape from config.json (the test checks the KV bytes against the model's own kv_bytes_per_block).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

EMBED = "model.embed_tokens.weight"
HEAD = "lm_head.weight"
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
# quantization side tensors: bytes that are read, but no multiply-adds of their own
_SCALE = ("weight_scale", "weight_scale_2", "input_scale", "weight_scale_inv", "_scales")
_PACKED = {"U8"}  # two FP4 values per byte (NVFP4 / MXFP4 weights and gpt-oss's _blocks)


@dataclass(frozen=True)
class ModelBytes:
    """What one step's limits need of a checkpoint (all integers: bytes, parameters, tokens)."""

    dense_bytes: int  # every non-expert tensor except the embedding (lm_head included)
    dense_matmul_params: int  # of those, the matrix weights except lm_head (prefill FLOPs)
    head_params: int  # lm_head (vocab x hidden), or the embedding when tied
    embed_row_bytes: int  # one embedding row (0 when tied: the whole matrix is in dense_bytes)
    expert_bytes: int  # one routed expert of one MoE layer, in its format
    expert_params: int  # its matmul parameters (unpacked)
    moe_layers: int
    experts: int  # routed experts per MoE layer
    top_k: int
    kv_bytes_per_token: tuple[int, ...]  # per layer
    windows: tuple[int | None, ...]  # per layer: sliding window (None: full attention)
    attn_flops_per_pair: tuple[int, ...]  # per layer: FLOPs of one (query, key) pair, all heads


@dataclass(frozen=True)
class Tensor:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int


def _is_expert(name: str) -> bool:
    return ".mlp.experts." in name  # routed only: shared experts are ".mlp.shared_experts."


def _params(t: Tensor) -> int:
    """Matmul parameters of a weight tensor: 0 for vectors, biases and quantization scales."""
    if len(t.shape) < 2 or t.name.endswith(_SCALE) or t.name.endswith(("bias", "_bias")):
        return 0
    n = 1
    for d in t.shape:
        n *= d
    return 2 * n if t.dtype in _PACKED else n


def attention_spec(cfg: dict[str, Any], kv_item_bytes: int = 2) -> tuple[tuple[int, ...], tuple[int | None, ...], tuple[int, ...]]:
    """(KV bytes per token, window, FLOPs per query-key pair) of each layer, from config.json."""
    layers = int(cfg["num_hidden_layers"])
    heads = int(cfg["num_attention_heads"])
    if cfg.get("kv_lora_rank"):  # MLA: the latent and the roped key are cached, shared by all heads
        kv = (int(cfg["kv_lora_rank"]) + int(cfg["qk_rope_head_dim"])) * kv_item_bytes
        qk = int(cfg["qk_nope_head_dim"]) + int(cfg["qk_rope_head_dim"])
        v = int(cfg["v_head_dim"])
    else:  # GQA: K and V of each KV head
        hd = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
        kv = 2 * int(cfg.get("num_key_value_heads") or heads) * hd * kv_item_bytes
        qk = v = hd
    types = cfg.get("layer_types") or []
    window = cfg.get("sliding_window")
    windows = tuple(int(window) if i < len(types) and types[i] == "sliding_attention" and window else None
                    for i in range(layers))
    return (kv,) * layers, windows, (2 * heads * (qk + v),) * layers


def _experts_of(cfg: dict[str, Any]) -> tuple[int, int]:
    for key in ("n_routed_experts", "num_experts", "num_local_experts"):
        if cfg.get(key):
            return int(cfg[key]), int(cfg["num_experts_per_tok"])
    return 0, 0


def model_bytes_from(tensors: Iterable[Tensor], cfg: dict[str, Any], kv_item_bytes: int = 2) -> ModelBytes:
    """ModelBytes of a checkpoint given its tensors (name, dtype, shape, nbytes) and config."""
    dense = matmul = head = embed_row = 0
    expert_b: dict[int, int] = {}
    expert_p: dict[int, int] = {}
    for t in tensors:
        if t.name == EMBED:
            if cfg.get("tie_word_embeddings"):  # the head is this matrix: read whole every step
                dense += t.nbytes
                head = _params(t)
            else:
                embed_row = t.nbytes // t.shape[0]
            continue
        if _is_expert(t.name):
            layer = int(_LAYER.match(t.name).group(1))
            expert_b[layer] = expert_b.get(layer, 0) + t.nbytes
            expert_p[layer] = expert_p.get(layer, 0) + _params(t)
            continue
        dense += t.nbytes
        if t.name == HEAD:
            head = _params(t)
        else:
            matmul += _params(t)
    E, k = _experts_of(cfg)
    if expert_b and len(set(expert_b.values())) != 1:
        raise ValueError(f"MoE layers of different expert sizes: {expert_b}")
    kv, windows, pair = attention_spec(cfg, kv_item_bytes)
    eb = next(iter(expert_b.values()), 0)
    ep = next(iter(expert_p.values()), 0)
    return ModelBytes(dense, matmul, head, embed_row, eb // E if E else 0, ep // E if E else 0, len(expert_b), E, k,
                      kv, windows, pair)


def model_bytes(ckpt: str | Path, kv_item_bytes: int = 2) -> ModelBytes:
    """ModelBytes of a checkpoint directory, from its safetensors headers and config.json."""
    from moe_core.checkpoint import read_safetensors_header

    root = Path(ckpt)
    cfg = json.loads((root / "config.json").read_text())
    metas = [m for f in sorted(root.glob("*.safetensors")) for m in read_safetensors_header(f)]
    return model_bytes_from([Tensor(m.name, m.dtype, tuple(m.shape), m.nbytes) for m in metas], cfg, kv_item_bytes)


def expected_touched(experts: int, top_k: int, batch: int) -> float:
    """Distinct experts B tokens pick, each k of E without replacement, uniformly: E(1 - (1 - k/E)^B)."""
    if experts == 0:
        return 0.0
    return experts * (1.0 - (1.0 - top_k / experts) ** batch)


def roofline_bytes(mb: ModelBytes, batch: int, ctx: float) -> dict[str, float]:
    """Bytes one decode step of `batch` rows at mean context `ctx` (tokens in the cache, this one
    included) must read: {"dense", "experts", "kv", "total"}. The head is dense: always read once.
    A windowed layer reads min(ctx, window) tokens per row."""
    dense = mb.dense_bytes + batch * mb.embed_row_bytes
    experts = mb.moe_layers * expected_touched(mb.experts, mb.top_k, batch) * mb.expert_bytes
    kv = batch * sum(per * (min(ctx, w) if w else ctx) for per, w in zip(mb.kv_bytes_per_token, mb.windows))
    return {"dense": float(dense), "experts": float(experts), "kv": float(kv), "total": float(dense + experts + kv)}


def prefill_flops(mb: ModelBytes, prompt: int) -> float:
    """Model FLOPs of prefilling one prompt of `prompt` tokens (causal, no cached prefix)."""
    linear = 2.0 * prompt * (mb.dense_matmul_params + mb.moe_layers * mb.top_k * mb.expert_params)
    head = 2.0 * mb.head_params  # the last position's logits only
    attn = 0.0
    for pair, w in zip(mb.attn_flops_per_pair, mb.windows):
        # query i (0-based) attends to keys max(0, i-w+1)..i: min(i+1, w) of them
        keys = prompt * (prompt + 1) / 2 if not w or w >= prompt else w * (w + 1) / 2 + (prompt - w) * w
        attn += pair * keys
    return linear + head + attn
