"""Checkpoint loading: strict validation of the safetensors headers, then the data with a progress
display, then the model.

Order matters for the operator: every check that can fail (unsupported architecture or format,
truncated/corrupt files, missing tensors, wrong shapes or dtypes) runs on headers alone, before a
byte of weight data is read, and raises RuntimeFailure naming the tensor and the file.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
from moe_core import formats
from moe_core.checkpoint import InspectionError, inspect_dir, read_json, read_safetensors_header
from moe_core.runtime import BUNDLED
from moe_kernels.experts import ExpertWeights, dequantize
from moe_kernels.formats import Fp8BlockTensor, MxFp4Tensor, NvFp4Tensor

from . import models
from .config_check import check_consistency, check_types
from .config_keys import normalize as normalize_config
from .dist.reads import read_sharded
from .errors import BadInput, RuntimeFailure
from .models.common.spec import kv_scale_specs
from .log import log as _log
from .progress import Progress
from .model_spec import arch_of, fused_expert_layers, is_fp8_linear, is_moe_layer, is_routed_expert_weight, num_experts, tensor_specs

_TORCH_DTYPE = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "U8": torch.uint8,
                "F8_E4M3": torch.float8_e4m3fn}


@dataclass
class Validated:
    root: Path
    config: dict[str, Any]
    arch: str
    info: Any  # moe_core.checkpoint.CheckpointInfo
    expert_format: str
    files: dict[str, list[str]]  # file name -> tensor names needed from it
    specs: dict[str, Any]
    ignored: list[str] = field(default_factory=list)
    nbytes: int = 0


def validate_checkpoint(path: str | Path) -> Validated:
    """Headers-only validation. Raises RuntimeFailure with the file/tensor and the problem."""
    root = Path(path)
    try:
        info = inspect_dir(root)
    except InspectionError as e:
        raise RuntimeFailure(f"cannot load checkpoint: {e}") from None
    cfg_path = root / "config.json"
    try:
        config = read_json(cfg_path)  # (inspect_dir parsed it too: refusals name the line)
    except InspectionError as e:
        raise RuntimeFailure(f"cannot load checkpoint: {e}") from None
    check_types(config, cfg_path)  # typed before anything reads a value (config_check)
    arch = arch_of(config)
    config = normalize_config(config, arch)  # every spelling transformers has written (config_keys)
    check_consistency(config, arch, cfg_path)
    loads = BUNDLED.formats_for(info.architecture)  # per architecture (moe_core.runtime.arch_formats)
    if info.format not in loads:
        raise RuntimeFailure(
            f"{root}: unsupported checkpoint format {info.format!r} ({info.formatSource}); the bundled runtime "
            f"loads {', '.join(loads)} for {info.architecture} (moe_core.runtime)")
    expert_format = formats.expert_format(info.format)
    headers: dict[str, Any] = {}
    where: dict[str, str] = {}
    for f in sorted(root.glob("*.safetensors")):
        try:
            metas = read_safetensors_header(f)
        except InspectionError as e:
            raise RuntimeFailure(f"corrupt checkpoint: {e}") from None
        for m in metas:
            if m.name in headers:
                raise RuntimeFailure(f"tensor {m.name} appears in both {where[m.name]} and {f.name}")
            headers[m.name], where[m.name] = m, f.name
    check_layers_present(config, headers, where, cfg_path)
    packed = {"fp8": "F8_E4M3", "nvfp4": "U8", "mxfp4": "U8"}.get(expert_format)
    quantized = {n for n, m in headers.items() if m.dtype == packed and is_fp8_linear(n)
                 and not is_routed_expert_weight(n)} if packed else None
    specs = tensor_specs(config, expert_format, quantized, fused_expert_layers(config, headers))
    specs.update(kv_scale_specs(config))  # optional FP8 KV cache scales
    missing = [n for n, s in specs.items() if n not in headers and not s.optional]
    if missing:
        more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
        raise RuntimeFailure(f"{root}: checkpoint is missing tensor {missing[0]}{', ' + ', '.join(missing[1:3]) if len(missing) > 1 else ''}"
                             f"{more} required by {arch} with {expert_format} experts")
    for n, s in specs.items():
        m = headers.get(n)
        if m is None:
            continue
        if not s.shape_ok(m.shape):
            raise RuntimeFailure(f"{root / where[n]}: tensor {n} has shape {list(m.shape)}, expected {list(s.shape)} "
                                 f"(from config.json)")
        if m.dtype not in s.dtypes:
            raise RuntimeFailure(f"{root / where[n]}: tensor {n} has dtype {m.dtype}, expected {'/'.join(s.dtypes)}")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            wm = read_json(index).get("weight_map", {})
        except InspectionError as e:
            raise RuntimeFailure(str(e)) from None
        if not isinstance(wm, dict) or not all(isinstance(f, str) for f in wm.values()):
            raise RuntimeFailure(f"{index}: weight_map must map tensor names to file names, found {str(wm)[:80]}")
        for n, fname in wm.items():
            if n in specs and where.get(n) != fname:
                raise RuntimeFailure(f"{index}: maps {n} to {fname}, but it is in {where.get(n, 'no file')}")
    files: dict[str, list[str]] = {}
    for n in specs:
        if n in headers:
            files.setdefault(where[n], []).append(n)
    ignored = sorted(set(headers) - set(specs))
    nbytes = sum(headers[n].nbytes for n in specs if n in headers)
    return Validated(root, config, arch, info, expert_format, files, specs, ignored, nbytes)


_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def check_layers_present(config: dict[str, Any], headers: dict[str, Any], where: dict[str, str], cfg_path: Path) -> None:
    """A checkpoint with tensors of more layers than num_hidden_layers (plus the MTP layers,
    num_nextn_predict_layers, which follow the decoder's) would be served without them: refused.
    (Fewer layers than the config says are missing tensors, refused by the tensor specs.)"""
    served = config["num_hidden_layers"] + int(config.get("num_nextn_predict_layers") or 0)
    extra = sorted((int(m.group(1)), n) for n in headers if (m := _LAYER.match(n)) and int(m.group(1)) >= served)
    if extra:
        i, name = extra[0]
        raise BadInput(f"{cfg_path}: num_hidden_layers = {config['num_hidden_layers']}, but {where[name]} has tensors of "
                       f"layer {i} ({name}): that layer would be dropped; num_hidden_layers must count every layer")


# ------------------------------------------------------------------------------------------------
# Reading data

def read_tensors(v: Validated, device: str, log: Callable[..., None]) -> tuple[dict[str, torch.Tensor], float]:
    from safetensors import safe_open

    out: dict[str, torch.Tensor] = {}
    prog = Progress(v.nbytes, log)
    files = sorted(v.files)
    for i, fname in enumerate(files, 1):
        path = v.root / fname
        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for n in v.files[fname]:
                    t = f.get_tensor(n)
                    out[n] = t.to(device, non_blocking=True) if device != "cpu" else t
                    prog.advance(t.numel() * t.element_size())
        except RuntimeFailure:
            raise
        except Exception as e:  # safetensors raises its own error types for corrupt data
            raise RuntimeFailure(f"{path}: cannot read tensor data ({type(e).__name__}: {e})") from None
        prog.file_done(fname, i, len(files))
    if device.startswith("cuda"):
        torch.cuda.synchronize()
    return out, time.time() - prog.t0


@dataclass
class LoadedCheckpoint:
    validated: Validated
    dense: dict[str, torch.Tensor]
    experts: dict[int, Any]  # layer -> ExpertWeights
    seconds: float
    nbytes: int

    @property
    def config(self) -> dict[str, Any]:
        return self.validated.config


def load_checkpoint(path: str | Path, device: str = "cpu", dtype: torch.dtype = torch.bfloat16,
                    log: Callable[..., None] = _log, validated: Validated | None = None,
                    shard=None) -> LoadedCheckpoint:
    """`shard` (a moe_runtime.dist.shard.ShardPlan): read only this rank's slices (tensor/expert parallel)."""
    v = validated or validate_checkpoint(path)
    if v.ignored:
        log("load_ignored", f"{len(v.ignored)} tensors not used by the model (e.g. {v.ignored[0]})")
    if shard is not None:
        raw, secs = read_sharded(v, device, log, shard, shard.lay.rank)
    else:
        raw, secs = read_tensors(v, device, log)
    log("load_done", f"{v.nbytes / 1e9:.3f} GB in {secs:.2f}s", gb_per_s=round(v.nbytes / max(secs, 1e-9) / 1e9, 3))
    cfg = v.config
    experts: dict[int, Any] = {}
    arch = models.get(v.arch)
    for i in range(cfg["num_hidden_layers"]):
        if is_moe_layer(cfg, i):
            E = shard.local_experts if shard is not None else num_experts(cfg)
            # the architecture's layout (Arch.stack_experts); with TP inside the experts, biases that the
            # combine sums are added by the expert group's first rank only (expert_rank0)
            stacked = arch.stack_experts(raw, f"model.layers.{i}.mlp.", E, v.expert_format, dtype, log,
                                         shard is None or shard.lay.etp_rank == 0)
            experts[i] = ExpertWeights.from_quantized(v.expert_format, **stacked)
    dense: dict[str, torch.Tensor] = {}
    for n in [n for n in raw if n.endswith(".weight")]:
        t = raw.pop(n)
        stem = n[: -len("weight")]
        # quantized non-expert linears (attention/dense/shared): dequantised once at load
        if (sinv := raw.pop(stem + "weight_scale_inv", None)) is not None:
            t = dequantize(Fp8BlockTensor(t, sinv.float()), torch.float32)
        elif (bs := raw.pop(stem + "weight_scale", None)) is not None:
            if v.expert_format == "nvfp4":
                raw.pop(stem + "input_scale", None)
                t = dequantize(NvFp4Tensor(t, bs, raw.pop(stem + "weight_scale_2").float()), torch.float32)
            else:
                t = dequantize(MxFp4Tensor(t, bs), torch.float32)
        dense[n] = t.to(dtype)
    dense.update({n: t for n, t in raw.items() if n.endswith("e_score_correction_bias")})  # kept fp32
    dense.update({n: t.to(dtype) for n, t in raw.items() if n.endswith((".bias", ".sinks"))})  # biases, attention sinks
    dense.update({n: t.float() for n, t in raw.items()  # FP8 KV cache scales, fp32 (the attention layers pick them)
                  if ".self_attn." in n and n.rsplit(".", 1)[-1] in ("k_scale", "v_scale", "kv_scale")})
    return LoadedCheckpoint(v, dense, experts, secs, v.nbytes)


def build_model(ck: LoadedCheckpoint, experts_factory: Callable[[Any], Any], deferred: bool, group=None):
    """Instantiate the architecture (moe_runtime.models) over loaded tensors. experts_factory(ExpertWeights) -> backend.
    `group` (moe_runtime.dist.group.Group): the tensor/expert-parallel group the model's layers reduce over
    (None: one process). Each layer's backend is the architecture's choice over the factory (Arch.experts)."""
    arch = models.get(ck.validated.arch)
    return models.build(ck.validated.arch, ck.config, ck.dense,
                        lambda i: arch.experts(ck.config, ck.experts[i], experts_factory), deferred, group)
