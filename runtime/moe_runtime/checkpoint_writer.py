"""`moe-runtime make-checkpoint`: random-weight checkpoints in the real Hugging Face on-disk layout.

Layouts written (formats-and-kernels.md section 4):
- bf16:  plain BF16 tensors, no quantization config.
- fp8:   DeepSeek-V3 style block FP8: every linear weight of the decoder layers (attention, dense MLP,
         shared and routed experts) is F8_E4M3 with a `weight_scale_inv` F32 tensor of
         [ceil(out/128), ceil(in/128)]; config.json `quantization_config = {quant_method: fp8,
         fmt: e4m3, activation_scheme: dynamic, weight_block_size: [128, 128]}`. Router, norms,
         embeddings and lm_head stay BF16 (as in the real checkpoint).
- nvfp4: ModelOpt NVFP4: routed experts only, per expert and projection `weight` U8 [out, in/2],
         `weight_scale` F8_E4M3 [out, in/16], `weight_scale_2` F32 scalar, `input_scale` F32 scalar;
         gate_proj and up_proj of one expert share weight_scale_2 and input_scale (ModelOpt fuses
         their amax because they are one GEMM at run time). Both `hf_quant_config.json` and the
         newer in-config `quantization_config {quant_method: modelopt, quant_algo: NVFP4, ...}`.
- mxfp4: OCP MXFP4 on routed experts only (our documented layout, per expert like ModelOpt):
         `weight` U8 [out, in/2] packed E2M1 (low nibble = even element), `weight_scale` U8 E8M0
         [out, in/32]; `quantization_config = {quant_method: mxfp4, modules_to_not_convert: [...]}`.
An architecture with a layout of its own (fused experts, its release's MXFP4 blocks, its release's
quantization_config) says so in its folder: Arch.quantize_tensor / Arch.quant_config; its config is
Arch.writer_config, its tensors Arch.dense_shapes, and it is written only in the formats the runtime
reads for it (moe_core.runtime).
Attention, dense MLPs, shared experts, router, norms and embeddings are BF16 except under fp8.

Sizes: `tiny` (hidden 64, a few layers, 8 experts; CPU tests in seconds) and `small` (each
architecture's real layer shapes over 4 layers: small enough to write and load in seconds on an
H200 host, big enough that decode reads are expert-dominated like the real model); each
architecture's folder holds its sizes.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any, Callable

import torch
from moe_core.runtime import BUNDLED
from moe_kernels.formats import quantize_fp8_block, quantize_mxfp4, quantize_nvfp4
from safetensors.torch import save_file

from . import models
from .errors import RuntimeFailure
from .model_spec import dense_shapes, is_fp8_linear, is_routed_expert_weight
from .tokenizer import build_tokenizer_files

# every architecture and checkpoint format the runtime serves (moe_core.runtime), and no other
ARCHS = models.names()
FORMATS = BUNDLED.checkpoint_formats
SIZES = ("tiny", "small")

_COMMON = {"rms_norm_eps": 1e-6, "hidden_act": "silu", "initializer_range": 0.02, "attention_bias": False,
           "attention_dropout": 0.0, "use_cache": True, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}

def make_config(arch: str, size: str) -> dict[str, Any]:
    """config.json of `arch` (a runtime module) at `size`: the architecture's own (Arch.writer_config)."""
    if arch not in ARCHS:
        raise RuntimeFailure(f"unknown --arch {arch!r}; choose one of {', '.join(ARCHS)}")
    return models.get(arch).writer_config(size, _COMMON)


# ------------------------------------------------------------------------------------------------
# Random weights (BF16 dense), named exactly as the HF checkpoints name them

def iter_dense_weights(cfg: dict[str, Any], gen: torch.Generator, device: str):
    """Yield (layer index or None, {name: tensor}) per decoder layer plus the ends (names/shapes from
    model_spec.dense_shapes). Scales keep activations O(1) so greedy decoding of a random model has
    clear argmax margins (needed for token-for-token comparisons with transformers)."""
    for layer, shapes in dense_shapes(cfg):
        t: dict[str, torch.Tensor] = {}
        for name, shape in shapes.items():
            if name == "model.embed_tokens.weight":
                v = torch.randn(*shape, generator=gen, device=device)
            elif name.endswith((".bias", "_proj_bias", ".sinks")):  # linear / expert biases and attention sinks
                v = (1.0 if name.endswith("sinks") else 0.1) * torch.randn(*shape, generator=gen, device=device)
            elif name.endswith("e_score_correction_bias"):
                # noaux_tc bias, kept F32 as its release stores it; positive so that HF's masking of
                # dropped groups cannot change the pick
                t[name] = 0.1 * torch.rand(*shape, generator=gen, device=device)
                continue
            elif len(shape) == 1:  # RMSNorm weights
                v = 1.0 + 0.1 * torch.randn(*shape, generator=gen, device=device)
            else:
                v = torch.randn(*shape, generator=gen, device=device) * (shape[1] ** -0.5)
            t[name] = v.to(torch.bfloat16)
        yield layer, t


# ------------------------------------------------------------------------------------------------
# Quantization of one layer's tensors into the on-disk layout of each format

def _to_cpu(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True).contiguous()  # own storage: safetensors refuses shared memory


def quantize_layer(tensors: dict[str, torch.Tensor], fmt: str, arch=None) -> dict[str, torch.Tensor]:
    """One layer's tensors in `fmt`'s on-disk layout; `arch` (a models Arch) may have its own for some
    tensors (Arch.quantize_tensor)."""
    out: dict[str, torch.Tensor] = {}
    if fmt == "bf16":
        return {k: _to_cpu(v) for k, v in tensors.items()}
    if fmt == "fp8":
        for k, v in tensors.items():
            if is_fp8_linear(k):
                q = quantize_fp8_block(v.float())
                out[k] = _to_cpu(q.weight)
                out[k[: -len("weight")] + "weight_scale_inv"] = _to_cpu(q.scale_inv.float())
            else:
                out[k] = _to_cpu(v)
        return out
    done: set[str] = set()
    for k, v in tensors.items():
        if k in done:
            continue
        if arch is not None and (own := arch.quantize_tensor(k, v, fmt)) is not None:
            out.update(own)
            continue
        if not is_routed_expert_weight(k):
            out[k] = _to_cpu(v)
            continue
        base = k.rsplit(".", 2)[0]  # ...experts.{e}
        if k.endswith("down_proj.weight"):
            groups = [[k]]
        else:
            groups = [[base + ".gate_proj.weight", base + ".up_proj.weight"]]
        for names in groups:
            w = torch.cat([tensors[n].float() for n in names], dim=0)  # gate+up share the global scale
            rows = [tensors[n].shape[0] for n in names]
            if fmt == "nvfp4":
                q = quantize_nvfp4(w)
                gs = torch.as_tensor(q.global_scale, dtype=torch.float32).reshape(())
                for n, packed, bs in zip(names, q.packed.split(rows), q.block_scale.split(rows)):
                    stem = n[: -len("weight")]
                    out[n] = _to_cpu(packed)
                    out[stem + "weight_scale"] = _to_cpu(bs)
                    out[stem + "weight_scale_2"] = _to_cpu(gs)
                    # static activation scale (W4A4 kernels); amax of a unit-RMS activation / (6*448)
                    out[stem + "input_scale"] = torch.tensor(4.0 / 2688.0, dtype=torch.float32)
            elif fmt == "mxfp4":
                q = quantize_mxfp4(w)
                for n, packed, sc in zip(names, q.packed.split(rows), q.scale.split(rows)):
                    out[n] = _to_cpu(packed)
                    out[n[: -len("weight")] + "weight_scale"] = _to_cpu(sc)
            else:
                raise RuntimeFailure(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
            done.update(names)
    return out


def quant_config(fmt: str, cfg: dict[str, Any]) -> tuple[dict[str, Any] | None, dict[str, Any] | None]:
    """(config.json quantization_config, hf_quant_config.json) as the real producers write them (the
    architecture's own release first: Arch.quant_config)."""
    if (own := models.arch_for(cfg).quant_config(fmt)) is not None:
        return own
    not_converted = ["lm_head", "model.embed_tokens", "*.mlp.gate", "*self_attn*", "*shared_experts*", "*mlp.gate_proj",
                     "*mlp.up_proj", "*mlp.down_proj"]
    if fmt == "bf16":
        return None, None
    if fmt == "fp8":
        return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}, None
    if fmt == "nvfp4":
        q = {"quant_method": "modelopt", "quant_algo": "NVFP4", "group_size": 16, "kv_cache_scheme": None,
             "ignore": not_converted, "producer": {"name": "modelopt", "version": "0.37.0"}}
        hf = {"producer": {"name": "modelopt", "version": "0.37.0"},
              "quantization": {"quant_algo": "NVFP4", "kv_cache_quant_algo": None, "group_size": 16,
                               "exclude_modules": not_converted}}
        return q, hf
    if fmt == "mxfp4":
        return {"quant_method": "mxfp4", "modules_to_not_convert": not_converted,
                "weight_layout": "per-expert weight U8 [out,in/2] + weight_scale U8 E8M0 [out,in/32]"}, None
    raise RuntimeFailure(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")


def make_checkpoint(out_dir: str | Path, arch: str, fmt: str, size: str = "tiny", seed: int = 0,
                    device: str = "cpu", shard_bytes: int | None = None,
                    log: Callable[[str], None] = lambda s: None, overrides: dict[str, Any] | None = None) -> Path:
    """`overrides` (Python API only) replaces config.json keys of the chosen size, e.g. for GPU tests
    that need kernel-friendly shapes without the `small` size's gigabytes."""
    if fmt not in FORMATS:
        raise RuntimeFailure(f"unknown --format {fmt!r}; choose one of {', '.join(FORMATS)}")
    if size not in SIZES:
        raise RuntimeFailure(f"unknown --size {size!r}; choose one of {', '.join(SIZES)}")
    cfg = make_config(arch, size)
    arch_obj = models.get(arch)
    if fmt not in BUNDLED.formats_for(cfg["architectures"][0]):
        raise RuntimeFailure(f"--arch {arch} is written in {', '.join(BUNDLED.formats_for(cfg['architectures'][0]))}, "
                             f"not {fmt} (the formats the runtime reads for it)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    cfg.update(overrides or {})
    ids = build_tokenizer_files(out, min(cfg["vocab_size"], 512), cfg["max_position_embeddings"])
    cfg.update(bos_token_id=ids["bos"], eos_token_id=ids["eos"], pad_token_id=ids["eos"])
    qc, hfq = quant_config(fmt, cfg)
    if qc is not None:
        cfg["quantization_config"] = qc
    (out / "config.json").write_text(json.dumps(cfg, indent=2))
    if hfq is not None:
        (out / "hf_quant_config.json").write_text(json.dumps(hfq, indent=2))
    (out / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": ids["bos"], "eos_token_id": ids["eos"], "do_sample": False}, indent=2))

    # Tiny checkpoints are split per layer so multi-shard loading is always exercised.
    shard_bytes = shard_bytes or (1 << 16 if size == "tiny" else 2 << 30)
    gen = torch.Generator(device=device).manual_seed(seed)
    shards: list[dict[str, torch.Tensor]] = [{}]
    t0 = time.time()
    for layer, dense in iter_dense_weights(cfg, gen, device):
        q = quantize_layer(dense, fmt, arch_obj)
        cur = sum(v.numel() * v.element_size() for v in shards[-1].values())
        if shards[-1] and cur + sum(v.numel() * v.element_size() for v in q.values()) > shard_bytes:
            shards.append({})
        shards[-1].update(q)
        log(f"make-checkpoint: {'layer ' + str(layer) if layer is not None else 'embeddings/head'} done ({time.time() - t0:.1f}s)")
    weight_map, total = {}, 0
    n = len(shards)
    for i, shard in enumerate(shards):
        name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        for k, v in shard.items():
            weight_map[k] = name
            total += v.numel() * v.element_size()
    (out / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}, indent=2))
    log(f"make-checkpoint: wrote {n} shards, {total / 1e9:.3f} GB to {out} in {time.time() - t0:.1f}s")
    return out
