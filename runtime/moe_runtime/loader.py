"""Checkpoint loading: strict validation of the safetensors headers, then the data with a progress
display, then the model.

Order matters for the operator: every check that can fail (unsupported architecture or format,
truncated/corrupt files, missing tensors, wrong shapes or dtypes) runs on headers alone, before a
byte of weight data is read, and raises RuntimeFailure naming the tensor and the file.
"""

from __future__ import annotations

import re
import sys
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

from .config_check import check_consistency, check_types
from .config_keys import normalize as normalize_config
from .errors import BadInput, RuntimeFailure
from .log import log as _log
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
    loads = BUNDLED.formats_for(info.architecture)  # per architecture (gpt-oss: bf16, mxfp4)
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
    """A checkpoint with tensors of more layers than num_hidden_layers (plus DeepSeek's MTP layers,
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

class Progress:
    """Bytes/s progress: a bar on a terminal, a structured log line per file always."""

    def __init__(self, total: int, log: Callable[..., None]):
        self.total, self.done, self.t0, self.log = total, 0, time.time(), log
        self.tty = sys.stderr.isatty()

    def advance(self, n: int) -> None:
        self.done += n
        if self.tty:
            el = max(time.time() - self.t0, 1e-9)
            pct = 100 * self.done / max(self.total, 1)
            print(f"\rloading weights {pct:5.1f}% {self.done / 1e9:.2f}/{self.total / 1e9:.2f} GB "
                  f"{self.done / el / 1e9:.2f} GB/s", end="", file=sys.stderr, flush=True)

    def file_done(self, name: str, i: int, n: int) -> None:
        el = max(time.time() - self.t0, 1e-9)
        if self.tty:
            print(file=sys.stderr)
        self.log("load_progress", f"shard {i}/{n} {name}", bytes_done=self.done, bytes_total=self.total,
                 gb_per_s=round(self.done / el / 1e9, 3), elapsed_s=round(el, 2))


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


# ------------------------------------------------------------------------------------------------
# Stacking routed experts into the kernels' ExpertWeights

def _stack_experts(t: dict[str, torch.Tensor], prefix: str, E: int, fmt: str, log) -> dict[str, torch.Tensor]:
    def get(e: int, proj: str, suffix: str) -> torch.Tensor:
        return t.pop(f"{prefix}experts.{e}.{proj}.{suffix}")

    def w13(suffix: str) -> torch.Tensor:
        return torch.stack([torch.cat([get(e, "gate_proj", suffix), get(e, "up_proj", suffix)], 0) for e in range(E)])

    def w2(suffix: str) -> torch.Tensor:
        return torch.stack([get(e, "down_proj", suffix) for e in range(E)])

    if fmt == "bf16" and f"{prefix}experts.gate_up_proj" in t:  # fused layout (model_spec.fused_expert_layers)
        return {"w13_weight": t.pop(f"{prefix}experts.gate_up_proj").to(torch.bfloat16).contiguous(),
                "w2_weight": t.pop(f"{prefix}experts.down_proj").to(torch.bfloat16).contiguous()}
    if fmt == "bf16":
        return {"w13_weight": w13("weight").to(torch.bfloat16), "w2_weight": w2("weight").to(torch.bfloat16)}
    if fmt == "mxfp4":
        return {"w13_weight": w13("weight"), "w13_weight_scale": w13("weight_scale"),
                "w2_weight": w2("weight"), "w2_weight_scale": w2("weight_scale")}
    if fmt == "nvfp4":
        gs = torch.stack([torch.stack([get(e, "gate_proj", "weight_scale_2").reshape(()),
                                       get(e, "up_proj", "weight_scale_2").reshape(())]) for e in range(E)]).float()
        for e in range(E):  # W4A16: static activation scales are not used by the weight-only kernels
            for proj in ("gate_proj", "up_proj", "down_proj"):
                t.pop(f"{prefix}experts.{e}.{proj}.input_scale", None)
        out = {"w13_weight": w13("weight"), "w13_weight_scale": w13("weight_scale"),
               "w2_weight": w2("weight"), "w2_weight_scale": w2("weight_scale"),
               "w2_weight_scale_2": torch.stack([get(e, "down_proj", "weight_scale_2").reshape(()) for e in range(E)]).float()}
        # ModelOpt gives gate and up one shared global scale; keep [E, 2] only when they differ
        out["w13_weight_scale_2"] = gs[:, 0].contiguous() if torch.equal(gs[:, 0], gs[:, 1]) else gs
        return out
    if fmt == "fp8":
        inter = t[f"{prefix}experts.0.gate_proj.weight"].shape[0]
        pad = -inter % 128
        if pad:
            # gate|up blocks would straddle the fused w13's 128-row grid: zero-pad I to a multiple of
            # 128 instead (exact: silu(0)*0 = 0 and the padded w2 columns are zero); real models have
            # I % 128 == 0 and take no padding
            log("load_pad", f"{prefix}experts: moe_intermediate_size {inter} zero-padded to {inter + pad} for the "
                "128x128 FP8 block grid")
            for e in range(E):
                for p in ("gate_proj", "up_proj"):
                    k = f"{prefix}experts.{e}.{p}.weight"
                    t[k] = torch.nn.functional.pad(t[k].view(torch.uint8), (0, 0, 0, pad)).view(torch.float8_e4m3fn)
                k = f"{prefix}experts.{e}.down_proj.weight"
                t[k] = torch.nn.functional.pad(t[k].view(torch.uint8), (0, pad)).view(torch.float8_e4m3fn)
        return {"w13_weight": w13("weight"), "w13_weight_scale_inv": w13("weight_scale_inv").float(),
                "w2_weight": w2("weight"), "w2_weight_scale_inv": w2("weight_scale_inv").float()}
    raise RuntimeFailure(f"unsupported expert weight format {fmt!r}")


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
    """`shard` (a moe_runtime.parallel.ShardPlan): read only this rank's slices (tensor/expert parallel)."""
    v = validated or validate_checkpoint(path)
    if v.ignored:
        log("load_ignored", f"{len(v.ignored)} tensors not used by the model (e.g. {v.ignored[0]})")
    if shard is not None:
        from .parallel import read_sharded

        raw, secs = read_sharded(v, device, log, shard, shard.lay.rank)
    else:
        raw, secs = read_tensors(v, device, log)
    log("load_done", f"{v.nbytes / 1e9:.3f} GB in {secs:.2f}s", gb_per_s=round(v.nbytes / max(secs, 1e-9) / 1e9, 3))
    cfg = v.config
    experts: dict[int, Any] = {}
    for i in range(cfg["num_hidden_layers"]):
        if is_moe_layer(cfg, i):
            E = shard.local_experts if shard is not None else num_experts(cfg)
            if v.arch == "gpt_oss":  # fused, transposed, interleaved, biased: its own layout
                from .models.gpt_oss import stack_experts as gpt_oss_stack

                # TP inside the experts: one rank of the expert group adds down's bias (the combine sums them)
                stacked = gpt_oss_stack(raw, f"model.layers.{i}.mlp.", v.expert_format, dtype,
                                        down_bias=shard is None or shard.lay.etp_rank == 0)
            else:
                stacked = _stack_experts(raw, f"model.layers.{i}.mlp.", E, v.expert_format, log)
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
    dense.update({n: t.to(dtype) for n, t in raw.items() if n.endswith((".bias", ".sinks"))})  # gpt-oss
    return LoadedCheckpoint(v, dense, experts, secs, v.nbytes)


def build_model(ck: LoadedCheckpoint, experts_factory: Callable[[Any], Any], deferred: bool):
    """Instantiate the architecture (moe_runtime.models) over loaded tensors. experts_factory(ExpertWeights) -> backend."""
    from . import models

    if ck.validated.arch in models.OWN_EXPERTS:  # the model computes its experts itself (models.OWN_EXPERTS)
        return models.build(ck.validated.arch, ck.config, ck.dense, lambda i: ck.experts[i], deferred)
    return models.build(ck.validated.arch, ck.config, ck.dense, lambda i: experts_factory(ck.experts[i]), deferred)
