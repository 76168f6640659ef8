"""Every engine release in the supported range is read, from its wheel, into data (issue 30 items 1-2):
engine_rules/data/<engine>.json is written by scripts/engine_rules_extract.py, the rows read it, and a
check whose code differs from every other release read was read by a person (its review is recorded)."""

from __future__ import annotations

import json
import sys
import textwrap
from pathlib import Path

import pytest

from moe_operator import engine_rules, planner
from moe_operator.engine_rules import Case, judge, recorded
from moe_operator.engines.sglang import startup as sg_rules
from moe_operator.engines.vllm import startup as vl_rules

sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
import engine_rules_extract as extract  # noqa: E402

# PyPI's sglang releases from 0.5.10 to 0.5.23, post releases included (pip index versions sglang,
# 2026-12-01); vLLM's from 0.22.0 to 0.33.0 (pip index versions vllm, 2026-12-02: no post releases in the range).
SGLANG_RANGE = ("0.5.10", "0.5.10.post1", "0.5.11", "0.5.12", "0.5.12.post1", "0.5.13", "0.5.13.post1", "0.5.14",
                "0.5.15", "0.5.15.post1", "0.5.16", "0.5.17", "0.5.18", "0.5.19", "0.5.20", "0.5.21", "0.5.22",
                "0.5.23")


VLLM_RANGE = ("0.22.0", "0.22.1", "0.23.0", "0.24.0", "0.25.0", "0.25.1", "0.26.0", "0.27.0", "0.27.1", "0.28.0",
              "0.29.0", "0.30.0", "0.31.0", "0.32.0", "0.33.0")


def test_every_vllm_release_in_the_range_was_read():
    assert tuple(recorded.releases("vllm")) == VLLM_RANGE == engine_rules.VERSIONS_READ["vllm"]
    for v in VLLM_RANGE:
        assert engine_rules.coverage_note("vllm", v) is None, v
        r = recorded.release("vllm", v)
        assert r["runner_choices"]["values"] and r["a2a_choices"]["values"] and r["flashinfer_pin"], v
        # every function a row reads was looked for, by qualified name
        assert set(r["functions"]) == {q for rule in vl_rules.RULES for q in rule.source.reads}, v
    assert vl_rules.choices("0.27.1")[0] == tuple(recorded.release("vllm", "0.27.1")["runner_choices"]["values"])


def test_vllm_ranged_rows_follow_the_code_release_by_release():
    ids = lambda case: {r.rule.id for r in judge.check(case)}  # noqa: E731
    import dataclasses
    # support_deep_gemm gains family 120 in 0.24.0 (platforms/cuda.py)
    dg = Case("vllm", "0.23.0", "fp8", "Qwen3MoeForCausalLM", "sm120", "deep_gemm")
    assert "VL-DEV-DEEP_GEMM" in ids(dg) and "VL-DEV-DEEP_GEMM" not in ids(dataclasses.replace(dg, version="0.24.0"))
    # the OpenAI Triton MXFP4 window widens from < 11.0 to < 13.0 in 0.32.0
    tr = Case("vllm", "0.31.0", "mxfp4", "GptOssForCausalLM", "sm120", "triton")
    assert "VL-DEV-TRITON-MXFP4" in ids(tr) and "VL-DEV-TRITON-MXFP4" not in ids(dataclasses.replace(tr, version="0.32.0"))
    # HPC-Ops: 9.0 or family 100 in 0.25.0-0.27.1, 9.0 only from 0.28.0; no hpc check before 0.25.0
    hpc = Case("vllm", "0.27.1", "fp8", "DeepseekV3ForCausalLM", "sm100", "hpc")
    assert "VL-DEV-HPC" not in ids(hpc) and "VL-DEV-HPC" in ids(dataclasses.replace(hpc, version="0.28.0"))
    [row] = [r for r in vl_rules.RULES if r.id == "VL-DEV-HPC"]
    assert recorded.has_check("vllm", "0.24.0", row.id, row.source.reads) is False
    [text] = [r.text for r in judge.check(dataclasses.replace(hpc, version="0.28.0", family="sm120"))
              if r.rule.id == "VL-DEV-HPC"]
    assert "present since vllm 0.25.0" in text
    # validate_flashinfer_moe_ep_model: both megakernels 0.29.0-0.31.0, the DeepGEMM one only from 0.32.0;
    # DeepseekV41ForCausalLM allowed from 0.30.0; absent before 0.29.0
    ep = Case("vllm", "0.29.0", "dsv4_fp4", "DeepseekV41ForCausalLM", "sm100", "flashinfer_moe_ep_mega_deep_gemm")
    assert "VL-EP-ARCH" in ids(ep) and "VL-EP-ARCH" not in ids(dataclasses.replace(ep, version="0.30.0"))
    cute = Case("vllm", "0.31.0", "dsv4_fp4", "Qwen3MoeForCausalLM", "sm100", "flashinfer_moe_ep_mega_cutedsl")
    assert "VL-EP-ARCH" in ids(cute)
    # the megakernels' capability check at config time exists 0.29.0-0.31.0 only
    cc = dataclasses.replace(ep, version="0.31.0", family="sm90")
    assert "VL-FI-MOE-EP-CC" in ids(cc) and "VL-FI-MOE-EP-CC" not in ids(dataclasses.replace(cc, version="0.32.0"))
    # the all2all pairing check arrives in 0.32.0
    a2a = Case("vllm", "0.31.0", "dsv4_fp4", "DeepseekV4ForCausalLM", "sm100", "flashinfer_moe_ep_mega_deep_gemm",
               a2a="deepep_low_latency", tp=8, ep=8)
    assert "VL-EP-A2A" not in ids(a2a) and "VL-EP-A2A" in ids(dataclasses.replace(a2a, version="0.32.0"))


def test_vllm_batched_format_row_holds_in_every_release_and_spares_what_the_oracle_remaps():
    ids = lambda case: {r.rule.id for r in judge.check(case)}  # noqa: E731
    import dataclasses
    # is_supported_config's activation-format check is in every release: TRT-LLM experts are Standard-format only
    fi = Case("vllm", "0.22.0", "nvfp4", "DeepseekV3ForCausalLM", "sm100", "flashinfer_trtllm", a2a="deepep_low_latency",
              tp=8, ep=8)
    assert all("VL-BATCHED" in ids(dataclasses.replace(fi, version=v)) for v in VLLM_RANGE)
    # unquantized triton under a batched dispatch becomes BATCHED_TRITON (oracle/unquantized.py:311-315): accepted
    bf16 = dataclasses.replace(fi, fmt="bf16", runner="triton")
    assert not any("VL-BATCHED" in ids(dataclasses.replace(bf16, version=v)) for v in VLLM_RANGE)


def test_every_sglang_release_in_the_range_was_read():
    assert tuple(recorded.releases("sglang")) == SGLANG_RANGE
    assert engine_rules.VERSIONS_READ["sglang"] == SGLANG_RANGE
    for v in SGLANG_RANGE:
        assert engine_rules.coverage_note("sglang", v) is None, v
        r = recorded.release("sglang", v)
        assert r["runner_choices"]["values"] and r["a2a_choices"]["values"] and r["flashinfer_pin"], v


@pytest.mark.parametrize("engine", ["sglang", "vllm"])
def test_a_check_that_reads_differently_from_every_other_release_was_read_by_a_person(engine):
    rel = recorded.releases(engine)
    for v, r in rel.items():
        others = [o for w, o in rel.items() if w != v]
        unique = [rid for rid, m in r["markers"].items() if m["at"] and m["digest"] not in
                  {(o["markers"].get(rid) or {}).get("digest") for o in others}]
        unique += [k for k, d in r["hand_kept"].items() if d and d not in {o["hand_kept"].get(k) for o in others}]
        # a function a row reads (vLLM's device windows): unique code, or missing where another release has it
        for q, f in r.get("functions", {}).items():
            seen = {(o.get("functions", {}).get(q) or {}).get("digest") for o in others} - {None}
            if (f["digest"] is None and seen) or (f["digest"] is not None and f["digest"] not in seen):
                unique.append(q)
        assert set(unique) <= set(r.get("reviewed", ())), (v, sorted(set(unique) - set(r.get("reviewed", ()))))
        assert r.get("note"), v  # what the reader found


def test_rows_apply_where_their_check_is_and_cite_the_first_release_that_has_it():
    c = Case("sglang", "0.5.12", "nvfp4", "DeepseekV3ForCausalLM", "sm100", "flashinfer_cutedsl", a2a="flashinfer",
             tp=8, ep=8)
    ids = lambda case: {r.rule.id for r in judge.check(case)}  # noqa: E731
    assert "SG-CUTEDSL-A2A" in ids(c)  # 0.5.11-0.5.12.post1 accept none and deepep only
    import dataclasses
    assert "SG-CUTEDSL-A2A" not in ids(dataclasses.replace(c, version="0.5.13"))
    [text] = [r.text for r in judge.check(c) if r.rule.id == "SG-CUTEDSL-A2A"]
    assert "'none' or 'deepep', got 'flashinfer'" in text and "present since sglang 0.5.11" in text
    # a check absent from a release read does not apply there (SG-FUSED starts with 0.5.15's MoeRunner)
    assert recorded.has_check("sglang", "0.5.14", "SG-FUSED") is False
    assert recorded.has_check("sglang", "0.5.15", "SG-FUSED") is True


def test_planner_facts_per_release_come_from_the_wheels():
    assert planner.SGLANG_RUNNERS["aiter"] == "0.5.11" and planner.SGLANG_RUNNERS["marlin"] == "0.5.12"
    assert set(planner.SGLANG_RUNNERS) == {x for r in recorded.releases("sglang").values()
                                           for x in r["runner_choices"]["values"]}
    assert planner.default_flashinfer("sglang", "0.5.10.post1", None) == "0.6.7.post3"  # its own pin, not 0.5.10's
    assert planner.default_flashinfer("sglang", "0.5.10", None) == "0.6.7.post2"
    assert sg_rules.choices("0.5.11")[0] == tuple(recorded.release("sglang", "0.5.11")["runner_choices"]["values"])


def _fake_wheel(root: Path, runners, pin="0.6.1"):
    pkg = root / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (pkg / "server_args.py").write_text(textwrap.dedent(f'''
        MOE_RUNNER_BACKEND_CHOICES = {list(runners)!r}
        MOE_A2A_BACKEND_CHOICES = ["none", "deepep"]

        def add_cli_args(parser):
            parser.add_argument("--moe-a2a-backend", type=str, choices=MOE_A2A_BACKEND_CHOICES)
            parser.add_argument("--moe-runner-backend", type=str, choices=MOE_RUNNER_BACKEND_CHOICES)

        def check(self):
            if self.moe_runner_backend == "flashinfer_cutedsl":
                assert self.moe_a2a_backend in ["none", "deepep"], (
                    f"flashinfer_cutedsl supports moe_a2a_backend='none', got {{self.moe_a2a_backend}}")
        '''))
    (pkg / "fused.py").write_text('@register_fused_func("none", "marlin")\ndef f():\n    pass\n')
    meta = root / "sglang-0.0.1.dist-info"
    meta.mkdir()
    (meta / "METADATA").write_text(f"Name: sglang\nRequires-Dist: flashinfer_python[cu13]=={pin}\n")


def test_the_extraction_reads_choices_registrations_pins_and_checks_from_the_code(tmp_path):
    _fake_wheel(tmp_path / "a", ["auto", "triton", "marlin"])
    got = extract.extract("sglang", "0.0.1", tmp_path / "a")
    assert got["runner_choices"]["values"] == ["auto", "triton", "marlin"]
    assert got["runner_choices"]["at"].startswith("sglang/srt/server_args.py:")
    assert got["a2a_choices"]["values"] == ["none", "deepep"]
    assert got["fused_funcs"] == [["none", "marlin"]]
    assert got["flashinfer_pin"] == "0.6.1"
    m = got["markers"]["SG-CUTEDSL-A2A"]
    assert m["at"] == "sglang/srt/server_args.py:12" and m["digest"]
    assert got["markers"]["SG-FUSED"]["at"] is None  # a check the code does not have
    # the same check reformatted keeps its digest; a changed condition does not
    _fake_wheel(tmp_path / "b", ["auto", "triton", "marlin"])
    src = (tmp_path / "b/sglang/srt/server_args.py")
    src.write_text(src.read_text().replace('["none", "deepep"], (', '[\n "none",\n "deepep"], ('))
    assert extract.extract("sglang", "0.0.1", tmp_path / "b")["markers"]["SG-CUTEDSL-A2A"]["digest"] == m["digest"]
    src.write_text(src.read_text().replace('"deepep"], (', '"deepep", "flashinfer"], ('))
    changed = extract.extract("sglang", "0.0.2", tmp_path / "b")
    assert changed["markers"]["SG-CUTEDSL-A2A"]["digest"] != m["digest"]
    assert extract.flagged("sglang", "0.0.2", changed, {"0.0.1": got}) == ["SG-CUTEDSL-A2A"]


def test_the_committed_data_is_what_the_rows_read():
    data = json.loads(recorded.path("sglang").read_text())
    assert list(data["releases"]) == sorted(data["releases"], key=engine_rules.release_key)
    for v, r in data["releases"].items():
        assert set(r["markers"]) == {rule.id for rule in judge._rules("sglang") if rule.source.marker}, v


def _fake_vllm(root: Path, window: str, with_hpc: bool = True, moved: bool = False):
    """A vLLM package with the pieces the extraction reads: the CLI Literals, the oracle maps, and two device
    checks (one moved to another file when `moved`)."""
    pkg = root / "vllm"
    (pkg / "config").mkdir(parents=True)
    (pkg / "config" / "kernel.py").write_text('MoEBackend = Literal["auto", "triton", "hpc"]\n')
    (pkg / "config" / "parallel.py").write_text('All2AllBackend = Literal["naive", "passthrough"]\n')
    oracle = pkg / "model_executor/layers/fused_moe/oracle"
    oracle.mkdir(parents=True)
    for q in extract.ORACLES:
        body = "_BACKEND_NAME_MAP = {'triton': 1}\n" if q == "mxfp8" else \
            f"def map_{q}_backend(b):\n    mapping = {{'triton': 1}}\n    return mapping[b]\n"
        (oracle / f"{q}.py").write_text(body)
    experts = pkg / "model_executor/layers/fused_moe/experts"
    experts.mkdir()
    (experts / "gpt_oss_triton_kernels_moe.py").write_text(textwrap.dedent(f'''
        def _triton_kernel_moe_supports_current_device():
            cap = get_cap()
            return (9, 0) <= cap < {window}
        '''))
    if with_hpc:
        hpc = pkg / "model_executor/layers/fused_moe" / ("hpc_ops_moe.py" if moved else "hpc_moe.py")
        hpc.write_text("class HPCExperts:\n    @staticmethod\n    def _supports_current_device():\n"
                       "        return is_device_capability(90)\n")


def test_the_extraction_digests_each_function_a_row_reads_by_qualified_name(tmp_path):
    _fake_vllm(tmp_path / "a", "(11, 0)")
    a = extract.extract("vllm", "0.0.1", tmp_path / "a")
    tri = a["functions"]["_triton_kernel_moe_supports_current_device"]
    assert tri["at"] == "vllm/model_executor/layers/fused_moe/experts/gpt_oss_triton_kernels_moe.py:2" and tri["digest"]
    assert a["functions"]["HPCExperts._supports_current_device"]["at"] == "vllm/model_executor/layers/fused_moe/hpc_moe.py:3"
    assert a["functions"]["CudaPlatformBase.support_deep_gemm"] == {"at": None, "digest": None}
    assert a["oracles"]["wna16"] is None and a["a2a_choices"]["values"] == ["none", "naive"]
    # found by qualified name wherever the file is: a moved class keeps its digest, nothing to read
    _fake_vllm(tmp_path / "b", "(11, 0)", moved=True)
    b = extract.extract("vllm", "0.0.2", tmp_path / "b")
    assert b["functions"]["HPCExperts._supports_current_device"]["at"].endswith("hpc_ops_moe.py:3")
    assert extract.flagged("vllm", "0.0.2", b, {"0.0.1": a}) == []
    # a changed window is flagged (for a person to read), and so is a check that went
    _fake_vllm(tmp_path / "c", "(13, 0)", with_hpc=False)
    c = extract.extract("vllm", "0.0.3", tmp_path / "c")
    assert extract.flagged("vllm", "0.0.3", c, {"0.0.1": a}) == ["_triton_kernel_moe_supports_current_device",
                                                                "HPCExperts._supports_current_device"]
    # a row applies where a function it reads is (recorded data), and not where none is
    [hpc] = [r for r in vl_rules.RULES if r.id == "VL-DEV-HPC"]
    assert recorded.has_check("vllm", "0.24.0", hpc.id, hpc.source.reads) is False
    assert recorded.has_check("vllm", "0.25.0", hpc.id, hpc.source.reads) is True
    assert recorded.first_with("vllm", hpc.id, hpc.source.reads) == "0.25.0"
