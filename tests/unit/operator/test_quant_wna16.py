"""GPTQ / AWQ / compressed-tensors WNA16 checkpoints (issue 30 item 3): what inspection reads from config.json,
and the plan each engine's released code accepts for every method x engine x GPU family
(engines/sglang/quant.py, sglang 0.5.23; engines/vllm/quant.py, vLLM 0.33.0).

The config.json shapes are those of public checkpoints (repo ids named on each); they were written from the
published files, not fetched by this test. The expectations are written out by hand from the upstream code the
rows cite, not computed by the rows."""

import copy

import pytest

from moe_core.checkpoint import classify
from moe_core.gpu import from_name
from moe_operator.engines.command import Launch
from moe_operator.engines.sglang import command as sg_command
from moe_operator.planner import Choices, plan

# Qwen/Qwen3-30B-A3B-GPTQ-Int4 (config.json: quantization_config as AutoGPTQ writes it)
QWEN3_GPTQ = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48,
    "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
    "quantization_config": {"bits": 4, "damp_percent": 0.01, "desc_act": False, "group_size": 128,
                            "quant_method": "gptq", "static_groups": False, "sym": True, "true_sequential": True},
}
_MIXTRAL = {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
            "intermediate_size": 14336, "num_local_experts": 8, "num_experts_per_tok": 2, "num_hidden_layers": 32,
            "num_attention_heads": 32, "num_key_value_heads": 8}
# TheBloke/Mixtral-8x7B-Instruct-v0.1-GPTQ (main branch: act-order groups)
MIXTRAL_GPTQ_ACT = {**_MIXTRAL, "quantization_config": {
    "bits": 4, "group_size": 128, "damp_percent": 0.1, "desc_act": True, "sym": True, "true_sequential": True,
    "model_name_or_path": None, "model_file_base_name": "model", "quant_method": "gptq"}}
# TheBloke/Mixtral-8x7B-Instruct-v0.1-AWQ
MIXTRAL_AWQ = {**_MIXTRAL, "quantization_config": {
    "quant_method": "awq", "zero_point": True, "group_size": 128, "bits": 4, "version": "gemm"}}
# RedHatAI/Qwen3-30B-A3B-quantized.w4a16 (llm-compressor W4A16, group 128)
QWEN3_CT_W4A16 = {**{k: v for k, v in QWEN3_GPTQ.items() if k != "quantization_config"}, "quantization_config": {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                              "group_size": 128, "num_bits": 4, "observer": "minmax",
                                              "strategy": "group", "symmetric": True, "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
    "quant_method": "compressed-tensors", "quantization_status": "compressed"}}
# moonshotai/Kimi-K2-Thinking (compressed-tensors INT4 group 32)
KIMI_K2_THINKING = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "kimi_k2", "hidden_size": 7168,
    "moe_intermediate_size": 2048, "n_routed_experts": 384, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "num_hidden_layers": 61, "num_attention_heads": 64, "num_key_value_heads": 64, "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "quantization_config": {"config_groups": {"group_0": {
        "input_activations": None, "output_activations": None, "targets": ["Linear"],
        "weights": {"actorder": None, "dynamic": False, "group_size": 32, "num_bits": 4, "observer": "minmax",
                    "strategy": "group", "symmetric": True, "type": "int"}}},
        "format": "pack-quantized", "ignore": ["lm_head"], "quant_method": "compressed-tensors"}}


def _variant(cfg, **q):
    out = copy.deepcopy(cfg)
    out["quantization_config"].update(q)
    return out


def _ct_variant(cfg, **w):
    out = copy.deepcopy(cfg)
    out["quantization_config"]["config_groups"]["group_0"]["weights"].update(w)
    return out


# Derived layouts (not published checkpoints): the same Qwen3 GPTQ with asymmetric weights, and the RedHatAI one
# with activation-order groups / group 64.
QWEN3_GPTQ_ASYM = _variant(QWEN3_GPTQ, sym=False)
QWEN3_CT_ACTORDER = _ct_variant(QWEN3_CT_W4A16, actorder="group")
QWEN3_CT_G64 = _ct_variant(QWEN3_CT_W4A16, group_size=64)


# ---- inspection -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("cfg,fmt,scheme", [
    (QWEN3_GPTQ, "gptq", dict(method="gptq", bits=4, groupSize=128, sym=True, descAct=False, zeroPoint=False)),
    (MIXTRAL_GPTQ_ACT, "gptq", dict(method="gptq", bits=4, groupSize=128, sym=True, descAct=True)),
    (QWEN3_GPTQ_ASYM, "gptq", dict(sym=False, zeroPoint=True)),
    (MIXTRAL_AWQ, "awq", dict(method="awq", bits=4, groupSize=128, zeroPoint=True, sym=False)),
    (QWEN3_CT_W4A16, "ct_wna16", dict(method="compressed-tensors", bits=4, groupSize=128, sym=True, actorder=None,
                                      checkpointFormat="pack-quantized", strategy="group")),
    (QWEN3_CT_ACTORDER, "ct_wna16", dict(actorder="group", descAct=True)),
    (KIMI_K2_THINKING, "ct_int4_g32", dict(method="compressed-tensors", bits=4, groupSize=32, sym=True)),
])
def test_inspection_reads_the_quantization_scheme(cfg, fmt, scheme):
    ck = classify(cfg, None, [])
    assert ck.format == fmt
    assert ck.quantScheme is not None
    got = ck.quantScheme.model_dump()
    assert {k: got[k] for k in scheme} == scheme
    assert ck.quantMethod == cfg["quantization_config"]["quant_method"]


def test_channelwise_compressed_tensors_and_other_methods():
    chan = _ct_variant(QWEN3_CT_W4A16, strategy="channel", group_size=None, num_bits=8)
    ck = classify(chan, None, [])
    assert ck.format == "ct_wna16" and ck.quantScheme.groupSize == -1 and ck.quantScheme.bits == 8
    # W8A8 INT (input activations quantized) is not weight-only
    w8a8 = copy.deepcopy(QWEN3_CT_W4A16)
    w8a8["quantization_config"]["config_groups"]["group_0"]["input_activations"] = {"num_bits": 8, "type": "int"}
    assert classify(w8a8, None, []).format == "other"
    assert classify(w8a8, None, []).quantScheme is None
    # formats that are not WNA16 carry no scheme
    fp8 = {**_MIXTRAL, "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}
    assert classify(fp8, None, []).quantScheme is None


# ---- the matrix -------------------------------------------------------------------------------------------------

GPUS = {"sm80": "A100", "sm89": "L40S", "sm90": "H200", "sm100": "B200", "sm110": "thor", "sm120": "rtx-pro-6000",
        "sm121": "GB10", "gfx942": "MI300X", "gfx950": "MI355X"}
ROCM = ("gfx942", "gfx950")
LAYOUTS = {"qwen3_gptq": QWEN3_GPTQ, "mixtral_gptq_act": MIXTRAL_GPTQ_ACT, "qwen3_gptq_asym": QWEN3_GPTQ_ASYM,
           "mixtral_awq": MIXTRAL_AWQ, "qwen3_ct": QWEN3_CT_W4A16, "qwen3_ct_actorder": QWEN3_CT_ACTORDER,
           "kimi_k2_thinking": KIMI_K2_THINKING}


def expected(engine: str, layout: str, fam: str, version: str = ""):
    """(refusal id or None, --quantization value or None, the MoE kernel auto runs): written from the code cited."""
    rocm = fam in ROCM
    if engine == "vllm":
        old = version in ("0.27.0", "0.27.1", "0.28.0", "0.29.0")
        # desc_act with groups: gptq_utils.py:23-37 from 0.30.0; before, auto_gptq.py:118-121 only normalizes group
        # -1 and the act-order checkpoint builds (Mixtral 14336 % max(64, 128) == 0: Marlin's strict shape holds)
        if layout == "mixtral_gptq_act" and old:
            return None, None, ("triton" if rocm else "marlin")
        # asymmetric GPTQ: AutoGPTQConfig.__init__ auto_gptq.py:150-155 (the same in 0.27.0-0.29.0)
        if layout in ("mixtral_gptq_act", "qwen3_gptq_asym"):
            return "VQ1", None, None
        # 0.27.0-0.29.0: the oracle picks EMULATION, then the method asserts actorder != 'group'
        # (compressed_tensors_moe_wna16.py:136, 0.29.0)
        if rocm and layout == "qwen3_ct_actorder" and old:
            return "VQ3", None, None
        # ROCm: no Marlin (marlin_utils.py:369-370) -> MoeWNA16Method / compressed-tensors on Triton
        # NVIDIA: Marlin (FLASHINFER_TRTLLM needs VLLM_USE_FLASHINFER_MOE_INT4, not set under auto); activation-order
        # groups refuse Triton (int_wna16.py:203-205), so ROCm falls to the INT4 emulation (int4_emulation_moe.py:58-72)
        if rocm and layout == "qwen3_ct_actorder":
            return None, None, "emulation"
        return None, None, ("triton" if rocm else "marlin")
    # sglang: ROCm has no GPTQ / AWQ MoE (model_config.py:2002-2016,2156-2160; awq.py:136-160)
    if layout in ("qwen3_gptq", "mixtral_gptq_act", "qwen3_gptq_asym", "mixtral_awq") and rocm:
        return "SQ1", None, None
    if layout in ("qwen3_gptq", "mixtral_gptq_act"):  # Marlin-compatible, desc_act allowed (gptq.py:459-482)
        return None, "gptq_marlin", "marlin"
    if layout == "qwen3_gptq_asym":  # not Marlin-compatible, no desc_act: moe_wna16 (moe_wna16.py:170-192)
        return None, "moe_wna16", "triton"
    if layout == "mixtral_awq":
        return None, "awq_marlin", "marlin"
    # compressed-tensors (compressed_tensors.py:912-951): ROCm Triton; SM100 auto Triton for sym INT4 g32/128
    # without actorder; else Marlin
    if layout == "kimi_k2_thinking" and fam == "sm100":
        return None, None, None  # the planner's S4 picks flashinfer_trtllm (CompressedTensorsMxInt4MoE)
    if rocm or (fam == "sm100" and layout != "qwen3_ct_actorder"):
        return None, None, "triton"
    return None, None, "marlin"


MATRIX = [(e, v, layout, fam) for e, v in (("sglang", "0.5.23"), ("sglang", "0.5.22"), ("vllm", "0.33.0"),
                                          ("vllm", "0.30.0"), ("vllm", "0.29.0"), ("vllm", "0.28.0"), ("vllm", "0.27.0"))
          for layout in LAYOUTS for fam in GPUS]


def _plan(cfg, engine, version, gpu, runner="auto", env=None, tp=1):
    ck = classify(cfg, None, [])
    return plan(ck, from_name(gpu), Choices(runner_backend=runner, tp=tp, env=env or {}), engine=engine,
                engine_version=version)


def _q(p):
    return p.args[p.args.index("--quantization") + 1] if "--quantization" in p.args else None


def _kernel(p):
    d = [d.value for d in p.decisions if d.key in ("quant.moeKernel", "quant.moeMethod")]
    return d[0].split("/")[-1] if d else None


@pytest.mark.parametrize("engine,version,layout,fam", MATRIX, ids=[f"{e}{v}-{lay}-{fam}" for e, v, lay, fam in MATRIX])
def test_matrix(engine, version, layout, fam):
    refusal, quantization, kernel = expected(engine, layout, fam, version)
    p = _plan(LAYOUTS[layout], engine, version, GPUS[fam])
    if refusal:
        assert any(e.startswith(f"[{refusal}]") for e in p.errors), p.errors
        assert "--quantization" not in p.args
        return
    assert not p.errors, p.errors
    assert _q(p) == quantization
    if kernel is not None:
        assert _kernel(p) == kernel, p.decisions
    if layout == "kimi_k2_thinking" and fam == "sm100" and engine == "sglang":
        assert p.moe.runnerBackend == "flashinfer_trtllm"


# ---- explicit runners -------------------------------------------------------------------------------------------

EXPLICIT = [
    # vLLM 0.33.0: AutoGPTQMoEMethod passes may_have_bias=True (auto_gptq.py:472-479): Triton and FlashInfer refused
    ("vllm", QWEN3_GPTQ, "H200", "triton", None, "VQ2", "expert bias is not supported"),
    ("vllm", QWEN3_GPTQ, "H200", "marlin", None, None, None),
    ("vllm", QWEN3_GPTQ, "B200", "flashinfer_trtllm", None, "VQ2", "zero points and bias are not supported"),
    ("vllm", QWEN3_GPTQ, "H200", "deep_gemm", None, "VQ2", "is not supported for WNA16 MoE"),
    ("vllm", MIXTRAL_AWQ, "H200", "triton", None, "VQ2", "expert bias is not supported"),
    # ROCm: Marlin is CUDA-only (check_moe_marlin_supports_config, marlin_utils.py:369-370)
    ("vllm", QWEN3_GPTQ, "MI355X", "marlin", None, "VQ2", "the MoeWNA16 checkpoint layout is not supported"),
    ("vllm", QWEN3_GPTQ, "MI355X", "triton", None, None, None),
    ("vllm", QWEN3_CT_W4A16, "H200", "triton", None, None, None),
    ("vllm", QWEN3_CT_ACTORDER, "H200", "triton", None, "VQ2", "group activation ordering is not supported"),
    # FlashInfer MxInt4: INT4 group 32 only (trtllm_mxint4_moe.py:62-66), SM100 family (:45-55)
    ("vllm", QWEN3_CT_W4A16, "B200", "flashinfer_trtllm", None, "VQ2", "kInt4Static32"),
    ("vllm", KIMI_K2_THINKING, "B200", "flashinfer_trtllm", None, None, None),
    ("vllm", KIMI_K2_THINKING, "B200", "flashinfer_trtllm", {"VLLM_USE_FLASHINFER_MOE_INT4": "0"}, "VQ-INT4ENV", None),
    # sglang 0.5.23: the Marlin MoE schemes assert runner auto (gptq_kernels.py:309, awq_moe.py:132)
    ("sglang", QWEN3_GPTQ, "H200", "triton", None, "SQ2", "is_auto()"),
    ("sglang", MIXTRAL_AWQ, "B200", "marlin", None, "SQ2", "is_auto()"),
    ("sglang", QWEN3_GPTQ_ASYM, "H200", "triton", None, None, None),  # MoeWNA16Method runs Triton
    ("sglang", QWEN3_GPTQ_ASYM, "H200", "flashinfer_cutlass", None, "SQ2", "Invalid quantization 'moe_wna16'"),
    ("sglang", QWEN3_CT_W4A16, "H200", "triton", None, None, None),
    ("sglang", QWEN3_CT_G64, "H200", "triton", None, "SQ2", "group_size=32 or 128"),
]


@pytest.mark.parametrize("engine,cfg,gpu,runner,env,refusal,words", EXPLICIT)
def test_explicit_runner(engine, cfg, gpu, runner, env, refusal, words):
    version = {"sglang": "0.5.23", "vllm": "0.33.0"}[engine]
    p = _plan(cfg, engine, version, gpu, runner, env)
    if refusal is None:
        assert not p.errors, p.errors
        return
    hits = [e for e in p.errors if e.startswith(f"[{refusal}]")]
    assert hits, p.errors
    assert words is None or words in hits[0], hits[0]
    assert "Works instead:" in hits[0]  # an explicit choice's refusal says what works


def test_works_instead_offers_only_what_passes():
    p = _plan(QWEN3_GPTQ, "vllm", "0.33.0", "H200", "triton")
    tail = p.errors[0].split("Works instead:", 1)[1]
    assert "marlin" in tail and "triton" not in tail.split(":", 1)[1].split("(")[0]
    for r in ("marlin",):
        assert not _plan(QWEN3_GPTQ, "vllm", "0.33.0", "H200", r).errors


def test_ignored_runner_is_a_warning():
    p = _plan(QWEN3_GPTQ_ASYM, "sglang", "0.5.23", "H200", "deep_gemm")
    assert any(w.startswith("[SQ3]") and "Triton" in w for w in p.warnings), p.warnings


def test_flashinfer_int4_env_is_rendered():
    p = _plan(KIMI_K2_THINKING, "vllm", "0.33.0", "B200", "flashinfer_trtllm")
    assert p.env.get("VLLM_USE_FLASHINFER_MOE_INT4") == "1"
    assert not _plan(KIMI_K2_THINKING, "vllm", "0.33.0", "B200").env.get("VLLM_USE_FLASHINFER_MOE_INT4")


# ---- env-gated backends -----------------------------------------------------------------------------------------

BF16_QWEN3 = {k: v for k, v in QWEN3_GPTQ.items() if k != "quantization_config"}


def test_vllm_aiter_env_rendered_on_rocm():
    p = _plan(BF16_QWEN3, "vllm", "0.33.0", "MI355X", "aiter")
    assert not p.errors, p.errors
    assert p.env.get("VLLM_ROCM_USE_AITER") == "1" and p.env.get("VLLM_ROCM_USE_AITER_MOE") == "1"


def test_vllm_aiter_turned_off_by_the_user_is_refused():
    p = _plan(BF16_QWEN3, "vllm", "0.33.0", "MI355X", "aiter", env={"VLLM_ROCM_USE_AITER_MOE": "0"})
    assert any(e.startswith("[VQ-AITER]") for e in p.errors), p.errors
    assert p.env.get("VLLM_ROCM_USE_AITER_MOE") == "0"  # the user's env is never overridden


def test_sglang_aiter_env_rendered_for_unquantized_experts():
    p = _plan(BF16_QWEN3, "sglang", "0.5.23", "MI355X", "aiter")
    assert not p.errors, p.errors
    assert p.env.get("SGLANG_USE_AITER") == "1"
    off = _plan(BF16_QWEN3, "sglang", "0.5.23", "MI355X", "aiter", env={"SGLANG_USE_AITER": "0"})
    assert off.env["SGLANG_USE_AITER"] == "0" and any(w.startswith("[SQ-AITER]") for w in off.warnings)
    assert "SGLANG_USE_AITER" not in _plan(BF16_QWEN3, "sglang", "0.5.23", "MI355X").env  # auto: not asked


# ---- releases not read, and the command line ---------------------------------------------------------------------

@pytest.mark.parametrize("engine,version,cfg,note", [
    ("sglang", "0.5.13", MIXTRAL_GPTQ_ACT, "[SQ0]"),  # GPTQ / AWQ rows: 0.5.14-0.5.23
    ("sglang", "0.5.14", QWEN3_CT_G64, "[SQ0]"),  # compressed-tensors rows: 0.5.15-0.5.23
    ("vllm", "0.22.1", MIXTRAL_GPTQ_ACT, "[VQ0]"),  # WNA16 rows: 0.30.0-0.33.0
    ("vllm", "0.26.0", MIXTRAL_GPTQ_ACT, "[VQ0]"),  # 0.22.0-0.26.0: another method path (quant.py docstring)
    ("vllm", "0.24.0", QWEN3_CT_W4A16, "[VQ0]"),
])
def test_release_not_read_for_these_rows_is_not_judged(engine, version, cfg, note):
    p = _plan(cfg, engine, version, "H200", "triton" if cfg is QWEN3_CT_G64 else "auto")
    assert any(w.startswith(note) for w in p.warnings), p.warnings
    assert not [e for e in p.errors if e.startswith(("[SQ", "[VQ"))]
    assert "--quantization" not in p.args


@pytest.mark.parametrize("version", ["0.5.14", "0.5.15.post1", "0.5.17", "0.5.19", "0.5.20", "0.5.22"])
def test_sglang_gptq_rows_hold_from_0_5_14(version):
    """The GPTQ / AWQ / moe_wna16 functions read have the same code from 0.5.14 (engines/sglang/quant.py)."""
    assert _q(_plan(QWEN3_GPTQ, "sglang", version, "H200")) == "gptq_marlin"
    assert _q(_plan(QWEN3_GPTQ_ASYM, "sglang", version, "H200")) == "moe_wna16"
    rocm = _plan(QWEN3_GPTQ_ASYM, "sglang", version, "MI355X").errors
    # 0.5.14-0.5.19 list 'gptq' as ROCm-supported: the layer's TypeError; from 0.5.20 the ROCm check itself
    words = "GPTQ Method does not support MoE" if version < "0.5.20" else "is currently not supported in ROCm"
    assert any(e.startswith("[SQ1]") and words in e for e in rocm), rocm


def test_unjudged_release_and_moe_wna16_are_decisions():
    """Recorded as decisions (rule SQ0 / VQ0, SQ-Q moe_wna16, VQ-AUTO MoeWNA16Method) for admission to report."""
    assert [d.value for d in _plan(QWEN3_GPTQ_ASYM, "sglang", "0.5.23", "H200").decisions if d.rule == "SQ-Q"] == ["moe_wna16"]
    assert [d.rule for d in _plan(QWEN3_GPTQ, "sglang", "0.5.13", "H200").decisions if d.key == "quant.judged"] == ["SQ0"]
    assert [d.rule for d in _plan(QWEN3_GPTQ, "vllm", "0.22.1", "H200").decisions if d.key == "quant.judged"] == ["VQ0"]
    rocm = _plan(QWEN3_GPTQ, "vllm", "0.33.0", "MI355X")
    assert [d.value for d in rocm.decisions if d.rule == "VQ-AUTO"] == ["MoeWNA16Method/triton"]


@pytest.mark.parametrize("version,gate", [("0.5.15", False), ("0.5.17", False), ("0.5.18", False), ("0.5.19", True),
                                          ("0.5.21", True)])
def test_sglang_compressed_tensors_triton_gate_from_0_5_19(version, gate):
    """0.5.15-0.5.18: an explicit triton takes any WNA16 scheme and SM100 auto runs Marlin; from 0.5.19 the
    Triton scheme gate and the SM100 auto-Triton default (compressed_tensors.py:925-947 in 0.5.23)."""
    g64 = _plan(QWEN3_CT_G64, "sglang", version, "H200", "triton")
    assert bool([e for e in g64.errors if e.startswith("[SQ2]")]) == gate, g64.errors
    assert _kernel(_plan(QWEN3_CT_W4A16, "sglang", version, "B200")) == ("triton" if gate else "marlin")


@pytest.mark.parametrize("version", ["0.30.0", "0.31.0", "0.32.0"])
def test_vllm_0_30_to_0_32_have_the_same_wna16_code(version):
    from moe_operator import engine_rules
    p = _plan(MIXTRAL_GPTQ_ACT, "vllm", version, "H200")
    if engine_rules.read_as("vllm", version):
        assert any(e.startswith("[VQ1]") for e in p.errors), p.errors
    else:  # 0.32.0 not among the releases read by engine_rules: not judged at all
        assert not [e for e in p.errors if e.startswith("[VQ")]


@pytest.mark.parametrize("engine,version,note", [("sglang", "0.5.23", "[SQ4]"), ("vllm", "0.33.0", "[VQ4]")])
def test_format_without_inspection_is_not_judged(engine, version, note):
    from moe_core.checkpoint import CheckpointInfo
    ck = CheckpointInfo(architecture="Qwen3MoeForCausalLM", format="gptq", formatSource="spec.model.format", numExperts=128)
    p = plan(ck, from_name("H200"), Choices(runner_backend="triton"), engine=engine, engine_version=version)
    assert any(w.startswith(note) for w in p.warnings), p.warnings
    assert not [e for e in p.errors if e.startswith(("[SQ", "[VQ"))] and "--quantization" not in p.args


def test_quantization_reaches_the_sglang_command():
    p = _plan(QWEN3_GPTQ_ASYM, "sglang", "0.5.23", "B200")
    _, args = sg_command.command(Launch(model="/models/m", extra=[], plan_args=p.args, nodes=1, role="single",
                                        port=8000, plan_file="/plan/plan.json", dist_port=29500))
    assert args[args.index("--quantization") + 1] == "moe_wna16"


# ---- vLLM 0.27.0-0.29.0: the ranged differences (engines/vllm/quant.py docstring) --------------------------------

OLD = ["0.27.0", "0.27.1", "0.28.0", "0.29.0"]
# Derived layouts: act-order / plain GPTQ group 32 (per-rank intermediate 768 / 8 = 96: % 32 == 0, % 64 != 0), the
# RedHatAI W4A16 with act-order group 32, 8-bit groups, asymmetric weights, per-channel scales.
QWEN3_GPTQ_ACT_G32 = _variant(QWEN3_GPTQ, desc_act=True, group_size=32)
QWEN3_GPTQ_G32 = _variant(QWEN3_GPTQ, group_size=32)
QWEN3_CT_ACTORDER_G32 = _ct_variant(QWEN3_CT_W4A16, actorder="group", group_size=32)
QWEN3_CT_W8_G128 = _ct_variant(QWEN3_CT_W4A16, num_bits=8)
QWEN3_CT_ASYM = _ct_variant(QWEN3_CT_W4A16, symmetric=False)
QWEN3_CT_CHANNEL = _ct_variant(QWEN3_CT_W4A16, strategy="channel", group_size=None)


def _method(p):
    d = [d.value for d in p.decisions if d.key == "quant.moeMethod"]
    return d[0] if d else None


def _ids(p, prefix="[VQ"):
    return [e.split("]")[0] + "]" for e in p.errors if e.startswith(prefix)]


@pytest.mark.parametrize("version", OLD + ["0.30.0"])
def test_vllm_gptq_act_order_builds_before_0_30(version):
    """auto_gptq.py:118-121 (0.27.0-0.29.0) vs normalize_and_validate_gptq_desc_act (0.30.0+)."""
    p = _plan(MIXTRAL_GPTQ_ACT, "vllm", version, "H200")
    if version in OLD:
        assert not p.errors, p.errors
        assert _method(p) == "AutoGPTQMoEMethod/marlin"
        assert _method(_plan(MIXTRAL_GPTQ_ACT, "vllm", version, "MI355X")) == "MoeWNA16Method/triton"
    else:
        assert _ids(p) == ["[VQ1]"], p.errors


@pytest.mark.parametrize("version", OLD)
def test_vllm_act_order_takes_marlins_strict_shape_before_0_30(version):
    """allow_tile_padding=not desc_act (auto_gptq.py:247,495): 96 % max(64, 32) != 0 -> MoeWNA16Method on Triton;
    the same layout without act-order passes the padded shape (96 % 32 == 0) and runs Marlin."""
    act = _plan(QWEN3_GPTQ_ACT_G32, "vllm", version, "H200", tp=8)
    assert not act.errors, act.errors
    assert _method(act) == "MoeWNA16Method/triton"
    assert _method(_plan(QWEN3_GPTQ_G32, "vllm", version, "H200", tp=8)) == "AutoGPTQMoEMethod/marlin"
    assert _method(_plan(QWEN3_GPTQ_ACT_G32, "vllm", version, "H200", tp=4)) == "AutoGPTQMoEMethod/marlin"  # 192


@pytest.mark.parametrize("version", OLD + ["0.30.0", "0.33.0"])
def test_vllm_compressed_tensors_actorder_before_0_30(version):
    """Strict shape refuses Marlin, Triton refuses group actorder, EMULATION is picked and the method asserts
    actorder != 'group' (compressed_tensors_moe_wna16.py:136, 0.29.0); from 0.30.0 Marlin pads (and ROCm emulates)."""
    cuda = _plan(QWEN3_CT_ACTORDER_G32, "vllm", version, "H200", tp=8)
    rocm = _plan(QWEN3_CT_ACTORDER, "vllm", version, "MI355X")
    if version in OLD:
        assert _ids(cuda) == ["[VQ3]"] and "actorder != 'group'" in cuda.errors[0], cuda.errors
        assert _ids(rocm) == ["[VQ3]"] and "AssertionError" in rocm.errors[0], rocm.errors
        explicit = _plan(QWEN3_CT_ACTORDER, "vllm", version, "MI355X", "emulation")
        assert _ids(explicit) == ["[VQ2]"] and "actorder != 'group'" in explicit.errors[0], explicit.errors
    else:
        assert not cuda.errors and _method(cuda) == "CompressedTensorsWNA16MoEMethod/marlin", cuda.errors
        assert not rocm.errors and _method(rocm) == "CompressedTensorsWNA16MoEMethod/emulation", rocm.errors


@pytest.mark.parametrize("version", OLD + ["0.30.0"])
def test_vllm_rdna3_backend_from_0_30(version):
    p = _plan(QWEN3_CT_W4A16, "vllm", version, "MI355X", "rdna3")
    assert _ids(p) == ["[VQ2]"], p.errors
    if version in OLD:  # map_wna16_backend without rdna3 (oracle/int_wna16.py:182-196, 0.29.0)
        assert "is not supported for WNA16 MoE" in p.errors[0] and "'rdna3'" not in p.errors[0].split("Expected")[1]
    else:
        assert "RDNA3 gfx1100 only" in p.errors[0], p.errors


@pytest.mark.parametrize("version", OLD + ["0.30.0"])
def test_vllm_8bit_groups_and_asymmetric_ct_before_0_29(version):
    """0.27.0-0.28.0 assert 8-bit per channel (compressed_tensors_moe_wna16.py:85) and symmetric weights off Marlin
    (:126); 0.29.0 lifts both."""
    w8 = _plan(QWEN3_CT_W8_G128, "vllm", version, "H200")
    asym = _plan(QWEN3_CT_ASYM, "vllm", version, "MI355X")
    if version in ("0.27.0", "0.27.1", "0.28.0"):
        assert _ids(w8) == ["[VQ1]"] and "group_size == -1" in w8.errors[0], w8.errors
        assert _ids(asym) == ["[VQ3]"] and "symmetric" in asym.errors[0], asym.errors
    else:
        assert not w8.errors and _method(w8) == "CompressedTensorsWNA16MoEMethod/marlin", w8.errors
        assert not asym.errors and _method(asym) == "CompressedTensorsWNA16MoEMethod/triton", asym.errors


@pytest.mark.parametrize("version", OLD + ["0.30.0"])
def test_vllm_channelwise_ct_reaches_marlin_with_group_none_before_0_30(version):
    p = _plan(QWEN3_CT_CHANNEL, "vllm", version, "H200")
    if version in OLD:  # group_size None <= 0 (utils/marlin_utils.py:376-379, 0.29.0)
        assert _ids(p) == ["[VQ3]"] and "TypeError" in p.errors[0], p.errors
    else:  # 0.30.0 encodes per-channel as -1
        assert not p.errors and _method(p) == "CompressedTensorsWNA16MoEMethod/marlin", p.errors
