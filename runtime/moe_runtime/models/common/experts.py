"""Stacking one MoE layer's routed experts, as the per-expert Hugging Face layout stores them, into the
kernels' ExpertWeights contract (w13 = [gate; up], w2 = down, each format's scales)."""

from __future__ import annotations

import torch

from ...errors import RuntimeFailure


def stack_per_expert(t: dict[str, torch.Tensor], prefix: str, E: int, fmt: str, log) -> dict[str, torch.Tensor]:
    """One MoE layer's routed experts (popped from `t`, per expert or fused) as ExpertWeights.from_quantized
    keywords: w13 [E, 2I, H] = [gate; up] rows, w2 [E, H, I], with each format's scales."""
    def get(e: int, proj: str, suffix: str) -> torch.Tensor:
        return t.pop(f"{prefix}experts.{e}.{proj}.{suffix}")

    def w13(suffix: str) -> torch.Tensor:
        return torch.stack([torch.cat([get(e, "gate_proj", suffix), get(e, "up_proj", suffix)], 0) for e in range(E)])

    def w2(suffix: str) -> torch.Tensor:
        return torch.stack([get(e, "down_proj", suffix) for e in range(E)])

    if fmt == "bf16" and f"{prefix}experts.gate_up_proj" in t:  # fused layout (ArchBase.fused_expert_layers)
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
