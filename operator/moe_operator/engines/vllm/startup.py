"""vLLM's start-up checks of `--moe-backend` (and `--all2all-backend` with it), as rows.

Read from the released wheels of every vLLM release 0.22.0-0.33.0 on PyPI (data/vllm.json); paths are
inside the wheel, lines are 0.33.0's unless a row says otherwise. What differs between releases is data:
the CLI choices and each oracle's accepted values are extracted per release (`RELEASES`); the capability
windows and name sets a row reads by hand are ranged (`_WINDOWS`: where the code changed, found by the
per-function digests of `Source.reads`). A release not read is not judged (engine_rules.coverage_note).

How an explicit `--moe-backend` is checked (0.33.0):
  1. argparse: the value must be one of the `MoEBackend` Literal (vllm/config/kernel.py:122-147; the
     CLI's choices come from it, vllm/engine/arg_utils.py:1843-1845);
  2. `KernelConfig` post-init: model restrictions and the all2all pairing
     (vllm/config/kernel.py:195-243);
  3. at layer build the checkpoint's quantization picks an oracle
     (vllm/model_executor/layers/fused_moe/oracle/{fp8,nvfp4,mxfp4,mxfp8,unquantized}.py); its
     `map_*_backend` raises ValueError for a value the oracle has no backend for, and the explicit
     path (`_return_or_raise`) raises ValueError unless one of the backend's experts classes passes
     `is_supported_config` (modular_kernel.py:580-633: `_supports_current_device`,
     `_supports_quant_scheme`, `_supports_activation`, `_supports_parallel_config`, ...);
  4. the FlashInfer package: the FlashInfer experts classes' `_supports_current_device` probe it
     (has_flashinfer_*), the FlashInfer all2all managers assert it (VL-FI-ABSENT, VL-FI-ABSENT-A2A, for an
     image declared without it: engine.flashinferVersion none).
The MoE split checks that hold for every backend (FusedMoEConfig's intermediate % tp assert, block-FP8
shards) are the planner's WK40, the attention-head split (ModelConfig.verify_with_parallel_config) its WK41;
both run on automatic choices too and size placement's layouts (planner.split_refusal).
"""

from __future__ import annotations

from ...engine_rules import Case, Rule, Source, read_as, recorded, release_key

A2A_FLAG = "--all2all-backend"

V = "0.33.0"

NVIDIA = frozenset({"sm80", "sm89", "sm90", "sm100", "sm110", "sm120", "sm121"})
FAMILY_100 = frozenset({"sm100"})  # is_device_capability_family(100): 10.x
FAMILY_120 = frozenset({"sm120", "sm121"})  # is_device_capability_family(120): 12.x

# Per release read: the CLI choices (MoEBackend and All2AllBackend Literals, vllm/config/kernel.py and
# config/parallel.py, minus the "passthrough" the CLI removes) and each oracle's map_*_backend keys (the WNA16
# one from 0.25.0) come from the wheel (data/vllm.json, scripts/engine_rules_extract.py). The capability windows
# and name sets below are read by hand, as ranged rows: (first release read with this reading, value); a release
# read takes the newest entry at or below it. Every release's digest of the functions these are read from is
# recorded (Source.reads), and a digest that differs from every other release's was read and its finding noted
# with the release (data/vllm.json "reviewed"/"note"), so a range starts where the code changed.
_WINDOWS: dict[str, tuple[tuple[str, object], ...]] = {
    # platforms/cuda.py CudaPlatformBase.support_deep_gemm: 9.0 or family 100 (0.22.0-0.23.0, cuda.py:557-559),
    # also family 120 from 0.24.0 (0.33.0 cuda.py:691-697)
    "deep_gemm": (("0.22.0", frozenset({"sm90"}) | FAMILY_100), ("0.24.0", frozenset({"sm90"}) | FAMILY_100 | FAMILY_120)),
    # experts/deep_gemm_moe.py DeepGemmFP4Experts._supports_current_device: family 100; from 0.24.0 100 or 120
    "deep_gemm_mxfp4": (("0.22.0", FAMILY_100), ("0.24.0", FAMILY_100 | FAMILY_120)),
    # experts/gpt_oss_triton_kernels_moe.py _triton_kernel_moe_supports_current_device: CUDA 9.0 <= cap < 11.0
    # (0.22.0-0.31.0), < 13.0 from 0.32.0; ROCm gfx9 (or gfx1x, no family here) throughout
    "triton_mxfp4": (("0.22.0", frozenset({"sm90", "sm100", "gfx942", "gfx950"})),
                     ("0.32.0", frozenset({"sm90", "sm100", "sm110", "sm120", "sm121", "gfx942", "gfx950"}))),
    # hpc_moe.py HPCExperts._supports_current_device: 9.0 or family 100 (0.25.0-0.27.1), 9.0 only from 0.28.0
    "hpc": (("0.25.0", frozenset({"sm90"}) | FAMILY_100), ("0.28.0", frozenset({"sm90"}))),
    # config/kernel.py validate_flashinfer_moe_ep_model: the backends it restricts (FLASHINFER_MOE_EP_BACKENDS,
    # 0.29.0-0.31.0; FLASHINFER_MOE_EP_DEEP_GEMM alone from 0.32.0) and the architectures it allows
    # (FLASHINFER_MOE_EP_ARCHITECTURES; DeepseekV41ForCausalLM from 0.30.0)
    "ep_arch_backends": (("0.29.0", frozenset({"flashinfer_moe_ep_mega_deep_gemm", "flashinfer_moe_ep_mega_cutedsl"})),
                         ("0.32.0", frozenset({"flashinfer_moe_ep_mega_deep_gemm"}))),
    "ep_archs": (("0.29.0", frozenset({"DeepseekV4ForCausalLM", "DeepSeekV4MTPModel"})),
                 ("0.30.0", frozenset({"DeepseekV4ForCausalLM", "DeepSeekV4MTPModel", "DeepseekV41ForCausalLM"}))),
}


def window(name: str, version: str):
    """The hand-read value `name` has in this read release (empty before its first entry: the rows
    that read it do not apply there anyway, their functions are absent)."""
    key = release_key(read_as("vllm", version) or version)
    at = [(first, value) for first, value in _WINDOWS[name] if release_key(first) <= key]
    return at[-1][1] if at else frozenset()


def _release_data(r: dict) -> dict:
    out = {"choices": tuple(r["runner_choices"]["values"]), "all2all": tuple(r["a2a_choices"]["values"])}
    out.update({q: set(keys) for q, keys in r["oracles"].items() if keys is not None})
    return out


# Every release recorded (a release not recorded is not judged).
RELEASES = {v: _release_data(r) for v, r in recorded.releases("vllm").items()}


def release(version: str) -> dict:
    """The data of this very release (read releases only: a release not read is not judged)."""
    key = read_as("vllm", version)
    if key is None or key not in RELEASES:
        raise ValueError(f"vllm {version} was not read: its start-up checks are not judged")
    return RELEASES[key]


def choices(version: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    return release(version)["choices"], release(version)["all2all"]


# Which oracle a checkpoint format goes through (the quantization method's MoE path).
ORACLE = {
    "bf16": "unquantized",
    "fp8": "fp8", "modelopt_fp8": "fp8", "dsv4_fp8": "fp8",
    "mxfp8": "mxfp8",
    "nvfp4": "nvfp4", "ct_nvfp4": "nvfp4", "mixed": "nvfp4", "dsv4_nvfp4": "nvfp4",
    "mxfp4": "mxfp4", "dsv4_fp4": "mxfp4", "ct_mxfp4_pack": "mxfp4",
    "ct_int4_g32": "wna16",  # compressed-tensors int4 (Kimi-K2 thinking): CompressedTensorsWNA16MoEMethod
}
_O = "vllm/model_executor/layers/fused_moe/oracle/"
_E = "vllm/model_executor/layers/fused_moe/experts/"
# oracle -> where its map_*_backend is (the accepted values per release are in RELEASES)
MAPPINGS: dict[str, Source] = {
    "fp8": Source(_O + "fp8.py", "271-289", "map_fp8_backend", V, "0.22.1", "is not supported for FP8 MoE"),
    "nvfp4": Source(_O + "nvfp4.py", "163-182", "map_nvfp4_backend", V, "0.22.1", "is not supported for NvFP4 MoE"),
    "mxfp4": Source(_O + "mxfp4.py", "352-399", "map_mxfp4_backend", V, "0.22.1", "is not supported for MXFP4 MoE"),
    "mxfp8": Source(_O + "mxfp8.py", "34-42,117-125", "select_mxfp8_moe_backend (_BACKEND_NAME_MAP)", V, "0.22.1",
                    "_BACKEND_NAME_MAP.get(runner_backend)"),
    "unquantized": Source(_O + "unquantized.py", "180-194", "map_unquantized_backend", V, "0.22.1",
                          "is not supported for unquantized MoE"),
    # the int_wna16 oracle has map_wna16_backend from 0.25.0 (none before: no mapping row there)
    "wna16": Source(_O + "int_wna16.py", "238-253", "map_wna16_backend (compressed_tensors_moe_wna16.py:102)", V, "0.25.0",
                    "is not supported for WNA16 MoE"),
}


def _oracle(c: Case) -> str | None:
    return ORACLE.get(c.fmt)


def _mapped(c: Case) -> bool:
    o = _oracle(c)
    return o is not None and c.runner in release(c.version).get(o, ())


def _src(file: str, lines: str, function: str, since: str = "0.22.1", marker: str = "",
         reads: tuple[str, ...] = ()) -> Source:
    return Source(file=file, lines=lines, function=function, version=V, since=since, marker=marker, reads=reads)


_NAMES = {"fp8": "FP8", "nvfp4": "NvFP4", "mxfp4": "MXFP4", "mxfp8": "MXFP8", "unquantized": "unquantized",
          "wna16": "WNA16"}


def _mapping_rule(oracle: str) -> Rule:
    return Rule(f"VL-MAP-{oracle.upper()}", "vllm",
                lambda c, o=oracle: _oracle(c) == o and o in release(c.version) and c.runner != "auto"
                and c.runner in release(c.version)["choices"] and c.runner not in release(c.version)[o],
                "moe_backend='{runner}' is not supported for " + _NAMES[oracle] + " MoE. Expected one of {expected}.",
                MAPPINGS[oracle],
                extra=lambda c, o=oracle: {"expected": sorted(release(c.version)[o])})


def _device(name: str, families, file: str, lines: str, function: str, oracles: tuple[str, ...],
            what: str, reads: tuple[str, ...], same_as: tuple[str, ...] = (), suffix: str = "",
            since: str = "0.22.1") -> Rule:
    fams = families if callable(families) else (lambda c, f=families: f)
    return Rule(f"VL-DEV-{name.upper()}{suffix}", "vllm",
                lambda c: _oracle(c) in oracles and _mapped(c) and c.runner == name and c.family not in fams(c),
                f"{{fmt}} MoE backend '{name}' does not support the deployment configuration since kernel does not "
                f"support current device ({what}; here {{family}})",
                _src(file, lines, function, since, reads=reads), same_as=same_as)


# Backends whose experts classes all have FusedMoEActivationFormat.Standard (read in every release 0.22.0-0.33.0:
# each class's activation_format, and the oracles' batched remaps, the same in all fifteen): FlashInferExperts
# (experts/flashinfer_cutlass_moe.py:64), TrtLlm*Experts (trtllm_*_moe.py), MarlinExperts (marlin_moe.py:681),
# CutlassExpertsFp4 (cutlass_moe.py:701), TritonExperts (triton_moe.py:67), OAITriton*Experts
# (gpt_oss_triton_kernels_moe.py:1017-1505).
_STANDARD_ONLY = {
    "fp8": ("flashinfer_trtllm", "flashinfer_cutlass", "marlin"),
    "nvfp4": ("flashinfer_trtllm", "flashinfer_cutlass", "cutlass", "marlin"),
    "mxfp4": ("flashinfer_trtllm", "flashinfer_cutlass", "triton", "triton_unfused"),
    # (triton is remapped to BATCHED_TRITON under the batched format: oracle/unquantized.py:311-315)
    "unquantized": ("flashinfer_trtllm", "flashinfer_cutlass"),
}

_ALL = ("fp8", "nvfp4", "mxfp4", "mxfp8", "unquantized", "wna16")
# the OpenAI Triton MXFP4 window: the experts classes' checks and the module function they call
_TRITON_MXFP4 = ("BaseOAITritonExperts._supports_current_device", "OAITritonMxfp4ExpertsMonolithic._supports_current_device",
                 "_triton_kernel_moe_supports_current_device")

RULES: tuple[Rule, ...] = (
    Rule("VL-CHOICE", "vllm", lambda c: c.runner not in release(c.version)["choices"],
         "argument --moe-backend: invalid choice: '{runner}' (choose from the MoEBackend values)",
         _src("vllm/config/kernel.py", "122-147", "MoEBackend (argparse choices, engine/arg_utils.py:1843-1845)")),
    Rule("VL-A2A", "vllm", lambda c: c.a2a not in release(c.version)["all2all"],
         "argument --all2all-backend: invalid choice: '{a2a}' (choose from the All2AllBackend values)",
         _src("vllm/config/parallel.py", "45-60", "All2AllBackend (argparse choices, engine/arg_utils.py:1157-1161)"),
         flag="a2a"),
    Rule("VL-EP-ARCH", "vllm",
         lambda c: c.runner in window("ep_arch_backends", c.version) and c.arch not in window("ep_archs", c.version),
         "moe_backend='{runner}' is only supported for DeepSeek-V4 models ({archs}), but the model is ['{arch}'].",
         _src("vllm/config/kernel.py", "231-243", "validate_flashinfer_moe_ep_model", "0.29.0",
              reads=("validate_flashinfer_moe_ep_model", "FLASHINFER_MOE_EP_BACKENDS", "FLASHINFER_MOE_EP_ARCHITECTURES")),
         extra=lambda c: {"archs": sorted(window("ep_archs", c.version))}),
    # 0.29.0-0.31.0: the FlashInfer MoE-EP megakernels' capability check at config time (called from the
    # DeepSeek-V4 model, models/deepseek_v4/nvidia/model.py:810); from 0.32.0 it is the experts class's
    # supports_current_device (VL-DEV-FLASHINFER_MOE_EP_CUTEDSL)
    Rule("VL-FI-MOE-EP-CC", "vllm",
         lambda c: c.runner in ("flashinfer_moe_ep_mega_deep_gemm", "flashinfer_moe_ep_mega_cutedsl")
         and (c.family not in FAMILY_100 or (c.cc is not None and c.cc not in ("10.0", "10.3"))),
         "moe_backend='{runner}' is only supported on compute capability 10.0, 10.3 (SM100/SM103), but this device "
         "is {family}.",
         Source("vllm/utils/flashinfer_moe_ep.py", "79-99", "validate_fi_moe_ep_config", "0.31.0", "0.29.0",
                reads=("validate_fi_moe_ep_config", "FI_MOE_EP_SUPPORTED_CAPABILITIES"))),
    Rule("VL-EP-A2A", "vllm",
         lambda c: c.runner in ("flashinfer_moe_ep_cutedsl", "flashinfer_moe_ep_mega_deep_gemm")
         and c.a2a not in ("none", "allgather_reducescatter"),
         "moe_backend='{runner}' dispatches and combines itself and cannot be paired with all2all_backend='{a2a}'; "
         "leave --all2all-backend unset.",
         _src("vllm/config/kernel.py", "195-215", "bind_passthrough_all2all_backend", "0.32.0",
              reads=("bind_passthrough_all2all_backend",)), flag="both"),
    *(_mapping_rule(o) for o in _ALL),
    # experts classes' _supports_current_device (CUDA capability gates)
    _device("flashinfer_trtllm", FAMILY_100, _E + "trtllm_fp8_moe.py", "165-171",
            "TrtLlm*Experts._supports_current_device (also trtllm_nvfp4_moe.py:204-211, trtllm_mxfp4_moe.py:121-123, "
            "trtllm_bf16_moe.py:95-102)", _ALL, "Blackwell SM100 family only",
            ("TrtLlmFp8ExpertsBase._supports_current_device", "TrtLlmNvFp4ExpertsBase._supports_current_device",
             "TrtLlmMxfp4ExpertsBase._supports_current_device", "TrtLlmBf16ExpertsBase._supports_current_device"), same_as=("K14",)),
    _device("flashinfer_cutlass", frozenset({"sm90"}) | FAMILY_100 | FAMILY_120, _E + "flashinfer_cutlass_moe.py", "128-139",
            "FlashInferExperts._supports_current_device", _ALL,
            "capability 9.0 or the 10.x / 12.x families; SM110 excluded (flashinfer-ai/flashinfer#3134)",
            ("FlashInferExperts._supports_current_device",), same_as=("WV1",)),
    _device("flashinfer_cutedsl", FAMILY_100, _E + "flashinfer_cutedsl_moe.py", "88-94",
            "FlashInferCuteDSLExperts._supports_current_device", ("nvfp4",), "10.x family only",
            ("FlashInferCuteDSLExperts._supports_current_device",)),
    _device("flashinfer_b12x", FAMILY_120, _E + "flashinfer_b12x_moe.py", "165-171",
            "FlashInferB12xExperts._supports_current_device", ("nvfp4",), "12.x family only",
            ("FlashInferB12xExperts._supports_current_device",)),
    _device("b12x", FAMILY_120, "vllm/model_executor/layers/fused_moe/b12x.py", "499-507",
            "B12xExperts._supports_current_device", ("nvfp4", "mxfp4"), "12.x family only",
            ("B12xExperts._supports_current_device",), since="0.29.0"),
    _device("cutlass", FAMILY_100 | {"sm110"} | FAMILY_120, _E + "cutlass_moe.py", "716-722",
            "CutlassExpertsFp4._supports_current_device", ("nvfp4",), "10.x, 11.x or 12.x family",
            ("CutlassExpertsFp4._supports_current_device",)),
    _device("deep_gemm", lambda c: window("deep_gemm", c.version), "vllm/platforms/cuda.py", "691-697",
            "CudaPlatform.support_deep_gemm (via is_deep_gemm_supported, vllm/utils/deep_gemm.py:113-118)",
            ("fp8", "mxfp8"), "Hopper 9.0 or the 10.x family (from 0.24.0 also 12.x)",
            ("DeepGemmExperts._supports_current_device", "is_deep_gemm_supported", "CudaPlatformBase.support_deep_gemm")),
    _device("deep_gemm", lambda c: window("deep_gemm_mxfp4", c.version), _E + "deep_gemm_moe.py", "474-479",
            "DeepGemmMxfp4Experts._supports_current_device", ("mxfp4",), "10.x family (from 0.24.0 or 12.x), MXFP4 DeepGEMM",
            ("DeepGemmFP4Experts._supports_current_device",), suffix="-MXFP4"),
    _device("marlin", NVIDIA, _E + "marlin_moe.py", "592-594", "MarlinExperts._supports_current_device", _ALL,
            "CUDA capability >= 7.5", ("MarlinExpertsBase._supports_current_device",)),
    _device("humming", NVIDIA, _E + "fused_humming_moe.py", "403-409", "Humming*Experts._supports_current_device", _ALL,
            "CUDA capability >= 7.5 with humming installed", ("HummingExpertsBase._supports_current_device",)),
    _device("triton", lambda c: window("triton_mxfp4", c.version),
            _E + "gpt_oss_triton_kernels_moe.py", "41-62", "_triton_kernel_moe_supports_current_device", ("mxfp4",),
            "OpenAI Triton MXFP4 kernels: CUDA 9.0 <= capability < 11.0 (from 0.32.0 < 13.0), or ROCm gfx9", _TRITON_MXFP4,
            suffix="-MXFP4"),
    Rule("VL-DEV-AITER", "vllm",
         lambda c: _mapped(c) and c.runner.startswith("aiter") and not c.rocm,
         "{fmt} MoE backend '{runner}' does not support the deployment configuration since kernel does not support "
         "current device (AMD AITER kernels: rocm_aiter_ops on ROCm; here {family})",
         _src(_E + "rocm_aiter_moe.py", "513-514", "AiterExperts._supports_current_device (also aiter_mxfp4_w4a16_moe.py:"
              "349-354, aiter_mxfp4_w4a8_moe.py:211-215, aiter_mxfp8_moe.py:47-55)",
              reads=("AiterExperts._supports_current_device", "AiterW4A16ExpertsMonolithic._supports_current_device",
                     "AiterW4A8ExpertsMonolithic._supports_current_device",
                     "AiterMxfp8Experts._supports_current_device"))),
    _device("hpc", lambda c: window("hpc", c.version), "vllm/model_executor/layers/fused_moe/hpc_moe.py", "63-65",
            "HPCExperts._supports_current_device", ("fp8",),
            "capability 9.0 only (Tencent HPC-Ops; 0.25.0-0.27.1 also the 10.x family)",
            ("HPCExperts._supports_current_device",), since="0.25.0"),
    _device("flashinfer_moe_ep_cutedsl", FAMILY_100, "vllm/model_executor/layers/fused_moe/flashinfer_moe_ep.py", "40-47",
            "supports_current_device (FlashInferMoeEpExperts)", ("nvfp4", "mxfp4"), "capability 10.0 or 10.3",
            ("supports_current_device", "FlashInferMoeEpExperts._supports_current_device"), since="0.32.0"),
    _device("triton_unfused", lambda c: window("triton_mxfp4", c.version),
            _E + "gpt_oss_triton_kernels_moe.py", "41-62", "_triton_kernel_moe_supports_current_device "
            "(UnfusedOAITritonExperts, :1179)", ("mxfp4",),
            "OpenAI Triton MXFP4 kernels: CUDA 9.0 <= capability < 11.0 (from 0.32.0 < 13.0), or ROCm gfx9", _TRITON_MXFP4,
            suffix="-MXFP4"),
    # An image without FlashInfer (engine.flashinferVersion none; vLLM's wheel pins flashinfer-python, so only a custom
    # image lacks it): every FlashInfer experts class's _supports_current_device ends in a has_flashinfer_* probe
    # (vllm/utils/flashinfer.py:88-106 has_flashinfer: find_spec("flashinfer"), then the submodule/function probes
    # :433-610), so is_supported_config fails with "current device" (modular_kernel.py:590-591) and the explicit path's
    # _return_or_raise raises ValueError (oracle/fp8.py:438-452; nvfp4.py:258, mxfp4.py:595, unquantized.py:283).
    # Under auto the oracles' loop logs and tries the next backend (oracle/fp8.py:525-539): auto passes over them.
    # FlashInferMoeEp (flashinfer_moe_ep_*) checks only the capability and raises RuntimeError when its
    # flashinfer.moe_ep import fails (flashinfer_moe_ep.py:243-259 _FlashInferMoeEpApi). Same probes in 0.22.1
    # (flashinfer_cutlass_moe.py:135-145, trtllm_fp8_moe.py:64-70, trtllm_nvfp4_moe.py:113-119, ...).
    Rule("VL-FI-ABSENT", "vllm",
         lambda c: c.flashinfer == "none" and c.runner.startswith("flashinfer") and _mapped(c),
         "{fmt} MoE backend '{runner}' does not support the deployment configuration since kernel does not support "
         "current device: its experts class needs FlashInfer (has_flashinfer_*) and the image has none "
         "(engine.flashinferVersion none); --moe-backend auto passes over the FlashInfer backends",
         _src(_E + "flashinfer_cutlass_moe.py", "128-139", "FlashInferExperts._supports_current_device (also "
              "trtllm_fp8_moe.py:165-171, trtllm_nvfp4_moe.py:204-210, trtllm_mxfp4_moe.py:121-123, trtllm_bf16_moe.py:"
              "95-101, flashinfer_cutedsl_moe.py:88-93, flashinfer_b12x_moe.py:165-170, flashinfer_moe_ep.py:243-259; "
              "raised by _return_or_raise, oracle/fp8.py:438-452)", "0.22.1", "has_flashinfer")),
    Rule("VL-FI-ABSENT-A2A", "vllm",
         lambda c: c.flashinfer == "none" and c.a2a in ("flashinfer_all2allv", "flashinfer_nvlink_two_sided",
                                                          "flashinfer_nvlink_one_sided"),
         "all2all_backend {a2a} needs FlashInfer and the image has none (engine.flashinferVersion none): "
         "'flashinfer all2all module not found. Please install/check flashinfer' / 'FlashInfer MoEEpCommunication "
         "NVLink one-sided API not found'",
         _src("vllm/distributed/device_communicators/all2all.py", "658-661,762-766",
              "FlashInferNVLinkTwoSidedManager.__init__ / FlashInferNVLinkOneSidedManager.__init__", "0.22.1",
              "flashinfer all2all module not found"), flag="a2a"),
    Rule("VL-FP8-CUTLASS", "vllm",
         lambda c: c.runner == "cutlass" and c.fmt in ("fp8", "modelopt_fp8", "dsv4_fp8"),
         "vLLM CUTLASS FP8 MoE backend is disabled for this configuration. (Fp8MoEMethod and ModelOptFp8MoEMethod "
         "select with allow_vllm_cutlass=False: vllm/model_executor/layers/quantization/fp8.py:523-528, modelopt.py:501-505)",
         _src(_O + "fp8.py", "467-477", "select_fp8_moe_backend", "0.22.1",
              "vLLM CUTLASS FP8 MoE backend is disabled for this configuration.")),
    # deepep_low_latency / nixl_ep dispatch in the batched activation format (fused_moe/config.py:1066-1067); an
    # explicit backend is remapped to its batched variant only for fp8 deep_gemm/triton/cutlass (oracle/fp8.py:459-465),
    # NVFP4 flashinfer_cutedsl (oracle/nvfp4.py:282-286) and MXFP4 marlin (oracle/mxfp4.py:679-683); humming's
    # list starts with a batched class. These backends' experts classes are Standard-format only.
    Rule("VL-BATCHED", "vllm",
         lambda c: c.a2a in ("deepep_low_latency", "nixl_ep") and _mapped(c)
         and c.runner in _STANDARD_ONLY.get(_oracle(c) or "", ()),
         "{fmt} MoE backend '{runner}' does not support the deployment configuration since kernel does not support "
         "batched activation format (all2all_backend {a2a} dispatches batched)",
         _src("vllm/model_executor/layers/fused_moe/modular_kernel.py", "627-628", "FusedMoEExperts.is_supported_config",
              "0.22.0", reads=("FusedMoEExperts.is_supported_config",)), flag="both"),
    # experts classes' _supports_quant_scheme
    Rule("VL-QS-FICUTLASS-FP8", "vllm",
         lambda c: _oracle(c) == "fp8" and c.runner == "flashinfer_cutlass" and c.fmt in ("fp8", "dsv4_fp8")
         and c.family in FAMILY_100 | FAMILY_120,
         "FP8 MoE backend 'FLASHINFER_CUTLASS' does not support the deployment configuration since kernel does not "
         "support quantization scheme kFp8Static128BlockSym x kFp8Dynamic128Sym (block FP8 only on capability 9.0; "
         "here {family})",
         _src(_E + "flashinfer_cutlass_moe.py", "146-180", "FlashInferExperts._supports_quant_scheme",
              reads=("FlashInferExperts._supports_quant_scheme",))),
    Rule("VL-QS-FICUTLASS-NVFP4", "vllm",
         lambda c: _oracle(c) == "nvfp4" and c.runner == "flashinfer_cutlass" and c.family == "sm90",
         "NvFp4 MoE backend 'FLASHINFER_CUTLASS' does not support the deployment configuration since kernel does not "
         "support quantization scheme kNvfp4Static x kNvfp4Dynamic (needs capability >= 10.0; here {family})",
         _src(_E + "flashinfer_cutlass_moe.py", "146-180", "FlashInferExperts._supports_quant_scheme",
              reads=("FlashInferExperts._supports_quant_scheme",))),
)


def quant(case: Case) -> str | None:
    """The quantization the rows' messages name: config.json's quant_method as written."""
    return case.quant_method
