"""vLLM's integer weight-only (GPTQ / AWQ / compressed-tensors WNA16) MoE oracle and its env-gated backends, as
validate rows over the plan's facts (they need CheckpointInfo.quantScheme: bits, group size, symmetry, activation
order, which engine_rules.Case does not carry). Pure.

Read from the released wheel vllm==0.33.0 (PyPI); paths are inside the wheel, lines are 0.33.0's. In the wheels of
0.30.0, 0.31.0 and 0.32.0 every function these rows read has the same AST as in 0.33.0 (int_wna16.py
_backend_incompatibility_reason / map_wna16_backend / select_wna16_moe_backend, AutoGPTQConfig / AutoAWQConfig /
MoeWNA16Config and their MoE methods, normalize_and_validate_gptq_desc_act, check_moe_marlin_supports_config,
CompressedTensorsWNA16MoEMethod.__init__, the WNA16 experts classes' _supports_current_device / _supports_quant_scheme,
is_flashinfer_mxint4_moe_available, AiterExperts and rocm_aiter_ops.is_fused_moe_enabled / is_enabled), except in
0.30.0 for CPU-only paths (ZEN_CPU), the compressed-tensors weight transposition and the order of a list; Humming's
move ahead of Marlin on capability 9.0 starts in 0.32.0.

0.27.0-0.29.0 (WNA16_READ; read from their wheels, lines are 0.29.0's where 0.27.0/0.28.0 agree) hold with ranged
differences (OLD_* below, each cited): no desc_act validation (auto_gptq.py:118-121 only normalizes group -1), so
GPTQ act-order groups build; act-order (GPTQ desc_act, compressed-tensors actorder group/dynamic) passes
allow_tile_padding=False (auto_gptq.py:247,495; compressed_tensors_moe_wna16.py:115,129) and Marlin then takes the
strict shape, per-rank intermediate % max(64, group) (utils/marlin_utils.py:376-384); a compressed-tensors non-Marlin
backend asserts actorder != 'group' (compressed_tensors_moe_wna16.py:136) after the oracle picked it; channelwise
compressed-tensors reaches the Marlin check with group_size None (TypeError, no -1 encoding before 0.30); no RDNA3
backend (map_wna16_backend oracle/int_wna16.py:182-196, _get_priority_backends :108-124). 0.27.0-0.28.0 further
assert 8-bit weights per channel (compressed_tensors_moe_wna16.py:85, moe_wna16.py:225) and symmetric weights on a
non-Marlin compressed-tensors backend (compressed_tensors_moe_wna16.py:126). Everything else these rows read has
the 0.30.0 AST there (AutoAWQConfig.get_quant_method differs in 0.27.x for CPU/XPU only).

0.22.0-0.26.0 are not judged (VQ0): the method path differs too much to carry these rows as ranges. In 0.26.0
select_wna16_moe_backend(config, weight_key) has no per-backend reasons and no Triton backend (explicit backends go
straight to the experts class; fused_moe/oracle/int_wna16.py:101-213), compressed-tensors WNA16 splits into
CompressedTensorsWNA16MoEMethod (Triton, own asserts) and CompressedTensorsWNA16MarlinMoEMethod (the oracle),
chosen in compressed_tensors_moe.py (~:100-178) by --moe-backend and the layer, and the Marlin check is only
check_moe_marlin_supports_layer (no check_moe_marlin_supports_config); map_wna16_backend is missing before 0.25.0
and auto_awq.py before 0.24.0.

How vLLM 0.33.0 builds a WNA16 MoE layer:
  * config: `quant_method: gptq` -> AutoGPTQConfig (auto_gptq.py:95-160: (bits, sym) in {(4, True), (8, True)},
    desc_act with groups refused by normalize_and_validate_gptq_desc_act, utils/gptq_utils.py:23-37);
    `awq` -> AutoAWQConfig (auto_awq.py:182-213: 4 bits only); compressed-tensors WNA16 groups ->
    CompressedTensorsWNA16MoEMethod (compressed_tensors_moe_wna16.py:60-130). No --quantization is needed: the
    override_quantization_method of AutoGPTQConfig / AutoAWQConfig resolves the checkpoint's method
    (auto_gptq.py:213-233, auto_awq.py:262-286; config/model.py:1394-1440);
  * layer: AutoGPTQ / AutoAWQ take AutoGPTQMoEMethod / AutoAWQMoEMethod when check_moe_marlin_supports_layer
    holds (utils/marlin_utils.py:356-388: CUDA, hidden % 128, per-rank intermediate % group, group in
    -1/32/64/128), else MoeWNA16Config's MoeWNA16Method (auto_gptq.py:235-257, auto_awq.py:336-359);
  * backend: select_wna16_moe_backend (fused_moe/oracle/int_wna16.py:256-363): map_wna16_backend for an
    explicit --moe-backend (:238-253), _backend_incompatibility_reason (:146-235), then the experts class's
    is_supported_config; auto walks _get_priority_backends (:126-143; Humming moves ahead of Marlin on
    capability 9.0 when installed, utils/humming/priority.py:13-45).
"""

from __future__ import annotations

from dataclasses import dataclass

from moe_core.checkpoint import QuantScheme

from ... import engine_rules
from ...selection import Check, Facts, truthy

READ = ("0.30.0", "0.31.0", "0.32.0", "0.33.0")  # releases the env-gated (AITER) rows were read for
# releases the WNA16 MoE rows hold for (0.27.0-0.29.0 with the ranged differences above)
WNA16_READ = ("0.27.0", "0.27.1", "0.28.0", "0.29.0") + READ
WNA16_FORMATS = frozenset({"gptq", "awq", "ct_wna16", "ct_int4_g32"})
# map_wna16_backend's keys (oracle/int_wna16.py:238-253, 0.33.0)
BACKENDS = ("triton", "marlin", "humming", "flashinfer_trtllm", "emulation", "rdna3")
OLD_BACKENDS = BACKENDS[:-1]  # no rdna3 before 0.30.0 (oracle/int_wna16.py:182-196, 0.29.0)
_PRIORITY = ("rdna3", "flashinfer_trtllm", "marlin", "triton", "humming", "emulation")  # :126-143
_NVIDIA = frozenset({"sm80", "sm89", "sm90", "sm100", "sm110", "sm120", "sm121"})
_O = "vllm/model_executor/layers/fused_moe/oracle/int_wna16.py"
_FALSY = ("0", "false", "no", "off")


def judged(version: str) -> bool:
    """The env-gated (AITER) rows: read for 0.30.0-0.33.0 only (0.29.0 has no AITER MXFP4 W4A16 experts)."""
    return engine_rules.read_as("vllm", version) in READ


def wna16_judged(version: str) -> bool:
    return engine_rules.read_as("vllm", version) in WNA16_READ


@dataclass(frozen=True)
class Layer:
    """What vLLM's WNA16 MoE path looks at for one layout."""

    fmt: str
    s: QuantScheme
    family: str
    hidden: int | None
    moe_inter: int | None
    moe_tp: int  # the MoE layer's tensor-parallel size (tp x dp without expert parallelism, else 1)
    env: dict
    ver: tuple = (0, 33)

    @property
    def old(self) -> bool:
        """0.27.0-0.29.0: the ranged differences of the module docstring."""
        return self.ver < (0, 30)

    @property
    def actorder(self) -> bool:
        """allow_tile_padding=False before 0.30.0: GPTQ desc_act (normalized off for group -1, auto_gptq.py:118-121)
        and compressed-tensors group/dynamic actorder on group strategy (compressed_tensors_moe_wna16.py:103-106, 0.29.0)."""
        if self.ct:
            return self.s.strategy in (None, "group") and self.s.actorder in ("group", "dynamic")
        return self.s.method == "gptq" and bool(self.s.descAct) and self.group != -1

    @property
    def rocm(self) -> bool:
        return self.family.startswith("gfx")

    @property
    def ct(self) -> bool:
        return self.s.method == "compressed-tensors"

    @property
    def group(self) -> int:
        return -1 if self.s.groupSize is None else self.s.groupSize


def layer(f: Facts) -> Layer | None:
    """The layer's facts, or None when these rows do not judge the plan (format, release, scheme unknown)."""
    s = f.ckpt.quantScheme
    if f.fmt not in WNA16_FORMATS or s is None or not wna16_judged(f.version):
        return None
    c = f.choices
    moe_tp = 1 if c.ep > 1 and c.tp * c.dp > 1 else c.tp * c.dp  # FusedMoEParallelConfig.make (config.py:1198-1225)
    return Layer(f.fmt, s, f.fam, f.ckpt.hiddenSize, f.ckpt.moeIntermediateSize, max(moe_tp, 1), dict(c.env),
                 tuple(f.ver[:2]))


def config_problem(x: Layer) -> str | None:
    """The checkpoint's quantization config fails to build (any backend, auto included)."""
    s = x.s
    if s.method == "gptq":
        if s.descAct and x.group != -1 and not x.old:  # before 0.30.0 desc_act builds (auto_gptq.py:118-121, 0.29.0)
            return ("GPTQ group activation ordering (desc_act=True) is no longer supported. Use a checkpoint with static "
                    "activation ordering or desc_act=False. (normalize_and_validate_gptq_desc_act, model_executor/layers/"
                    "quantization/utils/gptq_utils.py:23-37, from AutoGPTQConfig.__init__ auto_gptq.py:116). Works instead: "
                    "a GPTQ export with desc_act=False (or group_size -1)")
        if (s.bits, s.sym) not in ((4, True), (8, True)):
            return (f"Unsupported quantization config: bits={s.bits}, sym={s.sym} (AutoGPTQConfig.__init__, "
                    "model_executor/layers/quantization/auto_gptq.py:150-155; --quantization moe_wna16 builds its linear "
                    "layers with AutoGPTQConfig too, moe_wna16.py:214-216). Works instead: a symmetric 4- or 8-bit GPTQ "
                    "export (sym=true)")
    if s.method == "awq" and s.bits != 4:
        return (f"Unsupported num_bits = {s.bits}. Supported num_bits = 4 (AutoAWQConfig.__init__, "
                "model_executor/layers/quantization/auto_awq.py:204-210). Works instead: a 4-bit AWQ export")
    if x.ct and s.bits not in (4, 8):
        return (f"compressed-tensors WNA16 MoE takes 4- or 8-bit weights, got {s.bits} (WNA16_SUPPORTED_TYPES_MAP, "
                "compressed_tensors_moe_wna16.py:60-80)")
    if x.ver < (0, 29) and s.bits == 8 and x.group != -1 and (x.ct or method(x) == "MoeWNA16Method"):
        where = "compressed_tensors_moe_wna16.py:85" if x.ct else "moe_wna16.py:225 (MoeWNA16Method.__init__)"
        return (f"AssertionError: group_size == -1 (8-bit MoE weights per channel only in vLLM 0.27.0-0.28.0, {where}, "
                "vLLM 0.28.0; lifted in 0.29.0). Works instead: an 8-bit per-channel export, or vLLM 0.29.0+")
    return None


def marlin_layer_ok(x: Layer) -> bool:
    """check_moe_marlin_supports_config(..., allow_tile_padding=True) (utils/marlin_utils.py:356-388): never on ROCm;
    sizes not in config.json are not held against it. Before 0.30.0 act-order takes the strict shape
    (allow_tile_padding=False: per-rank intermediate % max(64, group), utils/marlin_utils.py:380-384, 0.29.0)."""
    if x.rocm:
        return False
    ispp = x.moe_inter // x.moe_tp if x.moe_inter is not None else None
    if x.old and x.actorder:
        shape = (x.hidden is None or x.hidden % 128 == 0) and (ispp is None or ispp % max(64, x.group) == 0)
    else:
        shape = (x.hidden is None or x.hidden % 128 == 0) and (x.group <= 0 or ispp is None or ispp % x.group == 0)
    return shape and x.group in (-1, 32, 64, 128)


def method(x: Layer) -> str:
    """The MoE method: AutoGPTQMoEMethod / AutoAWQMoEMethod (Marlin layout), MoeWNA16Method, or
    CompressedTensorsWNA16MoEMethod."""
    if x.ct:
        return "CompressedTensorsWNA16MoEMethod"
    if marlin_layer_ok(x):
        return "AutoGPTQMoEMethod" if x.s.method == "gptq" else "AutoAWQMoEMethod"
    return "MoeWNA16Method"


def _may_have_zp_bias(x: Layer) -> tuple[bool, bool]:
    """(may_have_zp, may_have_bias) the method passes to select_wna16_moe_backend: AutoGPTQMoEMethod (not sym, True;
    auto_gptq.py:472-479), AutoAWQMoEMethod (zero_point, True; auto_awq.py:538-545), MoeWNA16Method (has_zp, False;
    moe_wna16.py:258-264), compressed-tensors (not symmetric, False; compressed_tensors_moe_wna16.py:102-109)."""
    m = method(x)
    zp = bool(x.s.zeroPoint) if x.s.zeroPoint is not None else x.s.sym is False
    return zp, m in ("AutoGPTQMoEMethod", "AutoAWQMoEMethod")


def env_off(env: dict, key: str) -> bool:
    v = env.get(key)
    return v is not None and v.strip().lower() in _FALSY


def backend_problem(x: Layer, backend: str, flashinfer: str | None = "pinned") -> str | None:
    """Why vLLM refuses `backend` for this layer (the engine's words and where), or None. Env gates that the plan
    renders (VLLM_USE_FLASHINFER_MOE_INT4) count as set unless the user turned them off."""
    return oracle_problem(x, backend, flashinfer) or post_problem(x, backend)


def post_problem(x: Layer, backend: str) -> str | None:
    """The compressed-tensors method's asserts after select_wna16_moe_backend returned `backend` (auto does not try
    the next one: start-up fails)."""
    if backend == "marlin" or not x.ct:
        return None
    if x.s.strategy == "channel":
        return ("AssertionError: weight_quant.strategy == 'group' (non-Marlin compressed-tensors WNA16 MoE takes group "
                "scales only; compressed_tensors_moe_wna16.py:119-126)")
    if x.old and x.s.actorder == "group":
        return (f"AssertionError: weight_quant.actorder != 'group' (grouped actorder isn't supported by the non-Marlin "
                f"kernel '{backend}'; compressed_tensors_moe_wna16.py:136, vLLM 0.29.0; :124 in 0.27.0-0.28.0; the "
                "assert goes in 0.30.0)")
    if x.ver < (0, 29) and x.s.sym is False:
        return (f"AssertionError: Only symmetric quantization is supported for MoE (non-Marlin '{backend}'; "
                "compressed_tensors_moe_wna16.py:126, vLLM 0.27.0-0.28.0; gone in 0.29.0)")
    return None


def oracle_problem(x: Layer, backend: str, flashinfer: str | None = "pinned") -> str | None:
    """select_wna16_moe_backend's refusal of `backend` (map, _backend_incompatibility_reason, the experts class)."""
    known = OLD_BACKENDS if x.old else BACKENDS
    if backend not in known:
        return (f"moe_backend='{backend}' is not supported for WNA16 MoE. Expected one of {list(known)}. "
                f"(map_wna16_backend, {_O}:" + ("182-196, vLLM 0.29.0)" if x.old else "238-253)"))
    if x.old and backend == "marlin" and x.ct and x.s.strategy == "channel" and not x.rocm:
        return ("TypeError: '<=' not supported between instances of 'NoneType' and 'int' (channelwise compressed-tensors "
                "reaches check_moe_marlin_supports_config with group_size None: _backend_incompatibility_reason "
                f"{_O}:162-170, utils/marlin_utils.py:376-379, vLLM 0.29.0; 0.30.0 encodes it as -1)")
    m = method(x)
    zp, bias = _may_have_zp_bias(x)
    why = None
    if backend == "flashinfer_trtllm" and (zp or bias):
        why = "zero points and bias are not supported", "155"
    elif backend == "rdna3":
        why = ("only compressed-tensors checkpoints are supported", "158") if not x.ct else (
            "kernel does not support current device (RDNA3 gfx1100 only; here " + x.family + ")",
            "experts/rdna3_moe.py _supports_current_device")
    elif backend == "triton" and bias:
        why = "expert bias is not supported", "196"
    elif backend == "triton" and x.ct and x.s.actorder == "group":
        why = "group activation ordering is not supported", "203-205"
    elif backend in ("marlin", "emulation") and m == "MoeWNA16Method":
        why = "the MoeWNA16 checkpoint layout is not supported", "228-233"
    elif backend == "marlin" and not marlin_layer_ok(x):
        why = "Marlin not supported for this layer", "209-226"
    if why:
        where = why[1] if "/" in why[1] else f"_backend_incompatibility_reason, {_O}:{why[1]}"
        return (f"WNA16 MoE backend '{backend.upper()}' does not support the deployment configuration since {why[0]}. "
                f"({m}; {where})")
    # the experts classes' is_supported_config (modular_kernel.py:580-633)
    if backend == "flashinfer_trtllm":
        if x.family != "sm100" or flashinfer == "none":  # the env gate: VQ-INT4ENV (the plan renders it)
            return ("WNA16 MoE backend 'FLASHINFER_TRTLLM' does not support the deployment configuration since kernel "
                    f"does not support current device (TrtLlmMxint4ExpertsMonolithic: CUDA 10.x family, FlashInfer "
                    f"TRT-LLM fused MoE and VLLM_USE_FLASHINFER_MOE_INT4=1; here {x.family}, "
                    f"VLLM_USE_FLASHINFER_MOE_INT4={x.env.get('VLLM_USE_FLASHINFER_MOE_INT4', 'unset')}, FlashInfer "
                    f"{flashinfer or 'pinned'}; experts/trtllm_mxint4_moe.py:45-55, "
                    "utils/flashinfer_mxint4_moe.py:24-31)")
        if (x.s.bits, x.group) != (4, 32):
            return ("WNA16 MoE backend 'FLASHINFER_TRTLLM' does not support the deployment configuration since kernel "
                    f"does not support quantization scheme (INT4 group 32 only, kInt4Static32; here {x.s.bits}-bit group "
                    f"{x.group}; experts/trtllm_mxint4_moe.py:62-66)")
    if backend in ("marlin", "humming") and x.family not in _NVIDIA:
        return (f"WNA16 MoE backend '{backend.upper()}' does not support the deployment configuration since kernel does "
                f"not support current device (CUDA capability >= 7.5; here {x.family}; experts/marlin_moe.py:592-594, "
                "fused_humming_moe.py:403-409)")
    if backend == "emulation" and x.s.bits != 4:
        return ("WNA16 MoE backend 'EMULATION' does not support the deployment configuration since kernel does not "
                f"support quantization scheme (INT4 only; here {x.s.bits}-bit; experts/int4_emulation_moe.py:62-72)")
    return None


def auto_backend(x: Layer, flashinfer: str | None = "pinned") -> str | None:
    """What --moe-backend auto runs: the first of _get_priority_backends that passes (oracle/int_wna16.py:126-143,
    :332-359); auto does not set VLLM_USE_FLASHINFER_MOE_INT4, so FlashInfer's MxInt4 runs only with it set.
    Humming (optional package, preferred on capability 9.0) is left out: the image decides. EMULATION (INT4 dequantized
    to BF16 on Triton, experts/int4_emulation_moe.py) is the list's last resort."""
    return auto_pick(x, flashinfer)[0]


def auto_pick(x: Layer, flashinfer: str | None = "pinned") -> tuple[str | None, str | None]:
    """(backend auto runs, None) or (None, why start-up fails: the oracle raised, or the method's assert on the
    backend it picked; None when nothing passed)."""
    env_set = truthy(x.env.get("VLLM_USE_FLASHINFER_MOE_INT4"))
    for b in _PRIORITY:
        if b == "flashinfer_trtllm" and not env_set:
            continue
        if b == "humming" or (b == "rdna3" and x.old):  # no RDNA3 before 0.30.0 (:108-124, 0.29.0)
            continue
        p = oracle_problem(x, b, flashinfer)
        if p is None:
            post = post_problem(x, b)
            return (None, post) if post else (b, None)
        if p.startswith("TypeError"):  # raised inside the priority walk
            return None, p
    return None, None


def _refuses(f: Facts, r: str) -> str | None:
    x = layer(f)
    if x is None or config_problem(x) is not None:
        return None
    if r == "auto":
        return None if auto_backend(x, f.choices.flashinfer_version) else "none"
    return backend_problem(x, r, f.choices.flashinfer_version)


def _cfg(f: Facts) -> str | None:
    x = layer(f)
    return config_problem(x) if x else None


# The refusals as validate rows: they run on the final runner (explicit or auto) and an explicit runner's "works
# instead" asks them too (selection.run_checks planner_ok). The message's detail is the engine's own, per case,
# through VQ_DETAIL below (Check messages are static), so the rows' texts name the upstream function.
CHECKS: tuple[Check, ...] = (
    Check("VQ1", lambda f, r: _cfg(f) is not None, "reject",
          "vLLM {version} cannot build this {fmt} checkpoint's quantization config at start-up (any --moe-backend)"),
    Check("VQ2", lambda f, r: r != "auto" and _refuses(f, r) is not None, "reject",
          "vLLM {version} refuses --moe-backend {value} for this {fmt} checkpoint on {gpu} at start-up "
          "(select_wna16_moe_backend, model_executor/layers/fused_moe/oracle/int_wna16.py:256-363, vLLM 0.33.0; "
          "the same code in 0.30.0-0.32.0, ranged differences in 0.27.0-0.29.0: engines/vllm/quant.py)"),
    Check("VQ3", lambda f, r: r == "auto" and _refuses(f, r) is not None, "reject",
          "No WNA16 MoE backend supports the deployment configuration. ({fmt} on {gpu}: select_wna16_moe_backend, "
          "model_executor/layers/fused_moe/oracle/int_wna16.py:361-363, vLLM 0.33.0; the same code in 0.30.0-0.32.0, "
          "ranged differences in 0.27.0-0.29.0: engines/vllm/quant.py)"),
)


def detail(f: Facts, runner: str) -> dict[str, str]:
    """Check id -> the engine's own reason for this case (appended to the row's text by plan_moe)."""
    x = layer(f)
    if x is None:
        return {}
    if (cfg := config_problem(x)) is not None:
        return {"VQ1": cfg}
    if runner != "auto" and (p := backend_problem(x, runner, f.choices.flashinfer_version)):
        return {"VQ2": p}
    if runner == "auto" and (p := auto_pick(x, f.choices.flashinfer_version)[1]):
        return {"VQ3": p}
    return {}


def plan_notes(f: Facts, runner: str) -> tuple[list[str], list[tuple[str, str, str, str]], list[tuple[str, str, str]]]:
    """(warnings, env to render [(key, value, rule, reason)], decisions [(key, value, reason)]) for a WNA16
    checkpoint or an env-gated backend."""
    warnings: list[str] = []
    env: list[tuple[str, str, str, str]] = []
    decisions: list[tuple[str, str, str]] = []
    if f.fmt in WNA16_FORMATS and not wna16_judged(f.version):
        warnings.append(f"[VQ0] vLLM {f.version}: the GPTQ / AWQ / compressed-tensors WNA16 MoE rules were read from "
                        f"vLLM {', '.join(WNA16_READ)} only; not judged for this release (no rule is inferred across "
                        "releases; 0.22.0-0.26.0 build the MoE method another way)")
        decisions.append(("quant.judged", "no", f"vLLM {f.version} not among the releases the WNA16 MoE rules were read "
                                                f"for ({', '.join(WNA16_READ)})"))
    x = layer(f)
    if x is None and f.fmt in WNA16_FORMATS and f.ckpt.quantScheme is None and wna16_judged(f.version):
        warnings.append(f"[VQ4] {f.fmt} without its quantization parameters (bits, group size, symmetry: the checkpoint "
                        "was not inspected, e.g. spec.model.format set by hand): the WNA16 MoE checks are not judged")
    if x is not None and config_problem(x) is None:
        if runner == "auto" and (b := auto_backend(x, f.choices.flashinfer_version)):
            decisions.append(("quant.moeMethod", f"{method(x)}/{b}",
                              f"vLLM {f.version} builds {method(x)} and --moe-backend auto takes {b} for this {f.fmt} "
                              f"checkpoint on {f.gpu_name} (select_wna16_moe_backend priority, {_O}:126-143"
                              + ("; Humming first where installed on capability 9.0" if f.fam == "sm90" and b == "marlin"
                                 and f.ver >= (0, 32) else "") + ")"))
        if runner == "flashinfer_trtllm" and backend_problem(x, runner, f.choices.flashinfer_version) is None:
            env.append(("VLLM_USE_FLASHINFER_MOE_INT4", "1", "VQ-ENV",
                        "FlashInfer's MxInt4 MoE (TrtLlmMxint4ExpertsMonolithic) runs only with VLLM_USE_FLASHINFER_MOE_INT4=1 "
                        "(is_flashinfer_mxint4_moe_available, model_executor/layers/quantization/utils/"
                        "flashinfer_mxint4_moe.py:24-31, vLLM 0.33.0)"))
    if judged(f.version) and f.rocm and runner in AITER_ENV:
        for key in AITER_ENV[runner]:
            env.append((key, "1", "VQ-AITER",
                        f"--moe-backend {runner} runs only with {' and '.join(AITER_ENV[runner])} set "
                        "(rocm_aiter_ops.is_fused_moe_enabled / is_enabled, vllm/_aiter_ops.py:2288-2322; "
                        "experts/rocm_aiter_moe.py:512-513, aiter_mxfp4_w4a16_moe.py:349-351, aiter_mxfp4_w4a4_moe.py:254-256,"
                        " vLLM 0.33.0)"))
    return warnings, env, decisions


# AMD AITER backends and the env their experts classes' _supports_current_device read (vLLM 0.33.0):
# AiterExperts needs VLLM_ROCM_USE_AITER and VLLM_ROCM_USE_AITER_MOE (default True; _aiter_ops.py:2321-2322),
# the AITER Triton MXFP4 experts VLLM_ROCM_USE_AITER (:2288-2289; oracle/mxfp4.py:386-388 maps the values).
AITER_ENV = {
    "aiter": ("VLLM_ROCM_USE_AITER", "VLLM_ROCM_USE_AITER_MOE"),
    "aiter_triton_mxfp4_bf16": ("VLLM_ROCM_USE_AITER",),
    "aiter_triton_mxfp4_mxfp4": ("VLLM_ROCM_USE_AITER",),
}


def _aiter_off(f: Facts, r: str) -> bool:
    return judged(f.version) and f.rocm and r in AITER_ENV and any(env_off(dict(f.choices.env), k) for k in AITER_ENV[r])


def _int4_env_off(f: Facts, r: str) -> bool:
    return (r == "flashinfer_trtllm" and layer(f) is not None
            and env_off(dict(f.choices.env), "VLLM_USE_FLASHINFER_MOE_INT4"))


ENV_CHECKS: tuple[Check, ...] = (
    Check("VQ-AITER", _aiter_off, "reject",
          "--moe-backend {value} on {gpu}: AITER MoE is not enabled — set VLLM_ROCM_USE_AITER=1 and "
          "VLLM_ROCM_USE_AITER_MOE=1 to enable it (the user's env turns it off; experts/rocm_aiter_moe.py:497-513, "
          "vllm/_aiter_ops.py:2288-2322, vLLM 0.33.0; the same code in 0.30.0-0.32.0)"),
    Check("VQ-INT4ENV", _int4_env_off, "reject",
          "--moe-backend flashinfer_trtllm for a WNA16 checkpoint needs VLLM_USE_FLASHINFER_MOE_INT4=1 and the user's env "
          "sets it off (is_flashinfer_mxint4_moe_available, model_executor/layers/quantization/utils/"
          "flashinfer_mxint4_moe.py:24-31, vLLM 0.33.0; the same code in 0.30.0-0.32.0)"),
)
