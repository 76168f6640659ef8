"""FlashInfer MoE backends behind the common experts interface.

UNVERIFIED: the project has no Blackwell GPU and flashinfer is not installed on the H200 machine, so
none of this code has run. It follows flashinfer's documented API (formats-and-kernels.md section 2,
flashinfer `flashinfer/fused_moe/core.py` @0.6.18) and sglang's weight preparation; the runtime's
self-test (`moe_kernels.selftest`) runs each backend against the torch reference before it is used
and falls back to the next registry candidate on any failure. flashinfer is imported lazily, so this
module imports without it.

- FlashinferTrtllmExperts (SM100, NVFP4 W4A4): `trtllm_fp4_block_scale_routed_moe` with pre-routed
  (id << 16 | bf16 weight) packed top-k; activations quantised to NVFP4 with the checkpoint's static
  input scales (`w13_input_scale`, `w2_input_scale` in ExpertWeights.extras). Supports deferred
  finalize (do_finalize=False -> gemm2_out, bf16 expert weights, expanded_idx_to_permuted_idx).
  fp8/bf16 weights are listed in the registry entry but not wrapped yet: the constructor raises.
- FlashinferMxfp4Experts (SM90): `cutlass_fused_moe(use_w4_group_scaling=True)`, W4A16 with bf16
  activations, [up; gate] row order and the SM90 mixed-GEMM interleave. Other archs raise.
- FlashinferCutlassExperts (SM100/SM110/SM120, NVFP4 W4A4): `cutlass_fused_moe` with NVFP4 quant_scales.
"""

from __future__ import annotations

import torch

from .experts import ExpertWeights
from .finalize import DeferredMoEOutput
from .reference import _check_inputs, check_activation


def _flashinfer():
    try:
        import flashinfer  # noqa: F401
        import flashinfer.fused_moe as fused_moe
    except ImportError as exc:  # pragma: no cover - depends on the image
        raise ImportError("flashinfer-python is not installed") from exc
    return flashinfer, fused_moe


def _arch(device) -> int:
    major, minor = torch.cuda.get_device_capability(device)
    return major * 10 + minor


def _swap_gate_up(t: torch.Tensor) -> torch.Tensor:
    """[gate; up] -> [up; gate] along dim 1 (flashinfer's gated activation takes w3 first)."""
    half = t.shape[1] // 2
    return torch.cat((t[:, half:], t[:, :half]), dim=1).contiguous()


def _pack_topk(topk_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """flashinfer PackedPrecomputed routing: int32 (expert_id << 16) | bf16 bits of the weight."""
    wbits = weights.to(torch.bfloat16).view(torch.int16).to(torch.int32) & 0xFFFF
    return (topk_ids.to(torch.int32) << 16) | wbits


def _nvfp4_global(t) -> torch.Tensor:
    g = t.global_scale.float()
    return g if g.dim() == 1 else g[:, 0]  # one scale per expert; split gate/up scales not supported here


class _Base:
    supports_deferred = False
    # the wrappers run flashinfer's fused SiLU-gated MoE without expert biases (gpt-oss's clamped
    # SwiGLU and biases: TritonExperts / TorchExperts)
    activations = frozenset({"silu"})
    formats: frozenset[str] = frozenset()
    supports_bias = False

    def __init__(self, weights: ExpertWeights, *, activation: str = "silu", **activation_args):
        name = type(self).__name__
        check_activation(activation, self.activations, name)
        biases = sorted(k for k in ("w13_bias", "w2_bias") if k in weights.extras)
        if biases:
            raise ValueError(f"{name} does not add expert biases ({', '.join(biases)} given)")
        self.weights = weights
        self.E, self.H, self.I = weights.num_experts, weights.hidden_size, weights.intermediate_size

    def _finish(self, out, shared_output, routed_scale):
        out = out * routed_scale if routed_scale != 1.0 else out
        return (out.float() + shared_output.float()).to(torch.bfloat16) if shared_output is not None else out

    __call__ = lambda self, *a, **k: self.forward(*a, **k)  # noqa: E731


class FlashinferTrtllmExperts(_Base):
    """SM100 TRT-LLM-gen NVFP4 MoE (W4A4). Unverified (no Blackwell here)."""

    formats = frozenset({"nvfp4"})

    supports_deferred = True
    EPILOGUE_TILE_M = 128

    def __init__(self, weights: ExpertWeights, **kw):
        super().__init__(weights, **kw)
        if weights.format != "nvfp4":
            raise ValueError(f"flashinfer_trtllm loads nvfp4 experts only (registry weight_formats), not {weights.format}")
        if _arch(weights.device) // 10 != 10:
            raise RuntimeError("trtllm-gen MoE runs on SM100-family GPUs only")
        fi, _ = _flashinfer()
        ex = weights.extras
        if "w13_input_scale" not in ex or "w2_input_scale" not in ex:
            raise ValueError("NVFP4 W4A4 needs static activation scales w13_input_scale / w2_input_scale")
        w13, w2 = weights.w13, weights.w2
        # [gate; up] -> [up; gate], then the gated-activation row interleave and the epilogue shuffle.
        w13p, w13s = _swap_gate_up(w13.packed), _swap_gate_up(w13.block_scale.view(torch.uint8))
        g1w, g1s, g2w, g2s = [], [], [], []
        for e in range(self.E):
            rw = fi.reorder_rows_for_gated_act_gemm(w13p[e].clone())
            rs = fi.reorder_rows_for_gated_act_gemm(w13s[e].clone())
            g1w.append(fi.shuffle_matrix_a(rw.view(torch.uint8), self.EPILOGUE_TILE_M))
            g1s.append(fi.shuffle_matrix_sf_a(rs.view(torch.uint8), self.EPILOGUE_TILE_M))
            g2w.append(fi.shuffle_matrix_a(w2.packed[e].view(torch.uint8), self.EPILOGUE_TILE_M))
            g2s.append(fi.shuffle_matrix_sf_a(w2.block_scale[e].view(torch.uint8), self.EPILOGUE_TILE_M))
        self.g1w = torch.stack(g1w)
        self.g1s = torch.stack(g1s).view(torch.float8_e4m3fn).reshape(self.E, 2 * self.I, self.H // 16)
        self.g2w = torch.stack(g2w)
        self.g2s = torch.stack(g2s).view(torch.float8_e4m3fn).reshape(self.E, self.H, self.I // 16)
        a1 = ex["w13_input_scale"].float().max()  # amax/2688 of the layer input
        a2 = ex["w2_input_scale"].float().max()
        self.a1_quant = (1.0 / a1).reshape(1)
        g1_alpha = _nvfp4_global(w13) * a1
        self.out1_gate = g1_alpha.contiguous()
        self.out1 = (g1_alpha / a2).contiguous()
        self.out2 = (_nvfp4_global(w2) * a2).contiguous()

    def forward(self, x, topk_weights, topk_ids, *, shared_output=None, routed_scale=1.0, defer_finalize=False):
        _check_inputs(x, topk_weights, topk_ids, self.H)
        fi, fm = _flashinfer()
        k = topk_ids.shape[1]
        x_fp4, x_sf = fi.fp4_quantize(x.to(torch.bfloat16), self.a1_quant, 16, False, False)
        packed = _pack_topk(topk_ids, topk_weights.float() * routed_scale)  # scale folded into the weights
        res = fm.trtllm_fp4_block_scale_routed_moe(
            topk_ids=packed, routing_bias=None, hidden_states=x_fp4,
            hidden_states_scale=x_sf.view(torch.float8_e4m3fn).reshape(x.shape[0], -1),
            gemm1_weights=self.g1w, gemm1_weights_scale=self.g1s, gemm1_bias=None, gemm1_alpha=None,
            gemm1_beta=None, gemm1_clamp_limit=None, gemm2_weights=self.g2w, gemm2_weights_scale=self.g2s,
            gemm2_bias=None, output1_scale_scalar=self.out1, output1_scale_gate_scalar=self.out1_gate,
            output2_scale_scalar=self.out2, num_experts=self.E, top_k=k, n_group=None, topk_group=None,
            intermediate_size=self.I, local_expert_offset=0, local_num_experts=self.E,
            routed_scaling_factor=None, routing_method_type=1, do_finalize=not defer_finalize)
        if defer_finalize:
            gemm2_out, expert_weights, perm = res[0], res[1], res[2]
            return DeferredMoEOutput(gemm2_out, expert_weights, perm.to(torch.int32), 1.0)
        out = res[0] if isinstance(res, (list, tuple)) else res
        return self._finish(out, shared_output, 1.0)


class FlashinferMxfp4Experts(_Base):
    """SM90 CUTLASS mixed-input W4A16 MXFP4 MoE (flashinfer >= 0.6.11). Unverified (not installed here)."""

    formats = frozenset({"mxfp4"})

    def __init__(self, weights: ExpertWeights, **kw):
        super().__init__(weights, **kw)
        if weights.format != "mxfp4":
            raise ValueError(f"flashinfer_mxfp4 loads mxfp4 experts only, not {weights.format}")
        if _arch(weights.device) != 90:
            raise RuntimeError("flashinfer_mxfp4 runs the SM90 CUTLASS W4A16 path only (registry families: sm90)")
        _, fm = _flashinfer()
        w13, w2 = weights.w13, weights.w2
        self.w13 = fm.interleave_moe_weights_for_sm90_mixed_gemm(_swap_gate_up(w13.packed), "fp4")
        self.w2 = fm.interleave_moe_weights_for_sm90_mixed_gemm(w2.packed.contiguous(), "fp4")
        self.s13 = fm.interleave_moe_scales_for_sm90_mixed_gemm(_swap_gate_up(w13.scale), group_size=32)
        self.s2 = fm.interleave_moe_scales_for_sm90_mixed_gemm(w2.scale.contiguous(), group_size=32)

    def forward(self, x, topk_weights, topk_ids, *, shared_output=None, routed_scale=1.0, defer_finalize=False):
        _check_inputs(x, topk_weights, topk_ids, self.H)
        if defer_finalize:
            raise ValueError("flashinfer_mxfp4 cannot defer finalize (registry: deferred_finalize=False)")
        _, fm = _flashinfer()
        out = fm.cutlass_fused_moe(
            input=x.to(torch.bfloat16).contiguous(), token_selected_experts=topk_ids.to(torch.int32).contiguous(),
            token_final_scales=topk_weights.float().contiguous(), fc1_expert_weights=self.w13,
            fc2_expert_weights=self.w2, output_dtype=torch.bfloat16,
            quant_scales=[self.s13.view(torch.int32), self.s2.view(torch.int32)], use_w4_group_scaling=True)
        out = out[0] if isinstance(out, (list, tuple)) else out
        return self._finish(out, shared_output, routed_scale)


class FlashinferCutlassExperts(_Base):
    """Blackwell CUTLASS NVFP4 MoE (W4A4). Unverified (no Blackwell here)."""

    formats = frozenset({"nvfp4"})

    def __init__(self, weights: ExpertWeights, **kw):
        super().__init__(weights, **kw)
        if weights.format != "nvfp4":
            raise ValueError(f"flashinfer_cutlass loads nvfp4 experts only, not {weights.format}")
        if _arch(weights.device) < 100:
            raise RuntimeError("flashinfer CUTLASS NVFP4 MoE needs Blackwell (no NVFP4 on SM90)")
        _flashinfer()
        ex = weights.extras
        if "w13_input_scale" not in ex or "w2_input_scale" not in ex:
            raise ValueError("NVFP4 W4A4 needs static activation scales w13_input_scale / w2_input_scale")
        w13, w2 = weights.w13, weights.w2
        self.w13 = _swap_gate_up(w13.packed).view(torch.long)  # uint4x2 pairs, 8 bytes per long
        self.w2 = w2.packed.contiguous().view(torch.long)
        self.s13 = _swap_gate_up(w13.block_scale.view(torch.uint8)).view(torch.int32)
        self.s2 = w2.block_scale.view(torch.uint8).contiguous().view(torch.int32)
        a1 = ex["w13_input_scale"].float().max()
        a2 = ex["w2_input_scale"].float().max()
        self.a1_quant = (1.0 / a1).reshape(1)
        self.a2_quant = (1.0 / a2).reshape(1)
        self.alpha1 = (_nvfp4_global(w13) * a1).contiguous()
        self.alpha2 = (_nvfp4_global(w2) * a2).contiguous()

    def forward(self, x, topk_weights, topk_ids, *, shared_output=None, routed_scale=1.0, defer_finalize=False):
        _check_inputs(x, topk_weights, topk_ids, self.H)
        if defer_finalize:
            raise ValueError("flashinfer_cutlass cannot defer finalize (registry: deferred_finalize=False)")
        fi, fm = _flashinfer()
        x_fp4, x_sf = fi.fp4_quantize(x.to(torch.bfloat16), self.a1_quant, 16, False, True)
        out = fm.cutlass_fused_moe(
            input=x_fp4, token_selected_experts=topk_ids.to(torch.int32).contiguous(),
            token_final_scales=topk_weights.float().contiguous(), fc1_expert_weights=self.w13,
            fc2_expert_weights=self.w2, output_dtype=torch.bfloat16,
            quant_scales=[self.a1_quant, self.s13, self.alpha1, self.a2_quant, self.s2, self.alpha2],
            input_sf=x_sf)
        out = out[0] if isinstance(out, (list, tuple)) else out
        return self._finish(out, shared_output, routed_scale)
