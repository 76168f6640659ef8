"""Bad input before serving: corrupt/truncated files, missing tensors, wrong shapes/dtypes,
unsupported formats and architectures, plans for another GPU or checkpoint. Each gives a clear
`error:` line naming the file/tensor/mismatch and exit 1 (bad input; 2 only for a plan with errors),
without loading anything. Also the pure plan/backend resolution and the self-test fallback."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.cli import main
from moe_runtime.errors import RuntimeFailure

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("err") / "ds-nvfp4", "deepseek_v3", "nvfp4", "tiny")


@pytest.fixture
def ck(base, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(base, d)
    return d


def serve_fails(d, capsys, *extra, status=1):
    """Refused before serving: 1 bad input (checkpoint, a plan that does not fit), 2 the plan has errors."""
    rc = main(["serve", "--model", str(d), "--port", "0", *extra])
    err = capsys.readouterr().err
    assert rc == status, err
    assert "Traceback" not in err
    return err.strip().splitlines()[-1]


def shard_of(d, name):
    return d / json.loads((d / "model.safetensors.index.json").read_text())["weight_map"][name]


def rewrite(path, edit):
    with safe_open(str(path), "pt") as f:
        t = {k: f.get_tensor(k) for k in f.keys()}
    edit(t)
    save_file(t, str(path))


def test_truncated_shard_subprocess_exit_code(ck):
    f = shard_of(ck, "model.layers.1.mlp.experts.0.gate_proj.weight")
    f.write_bytes(f.read_bytes()[:-100])
    env = {"PYTHONPATH": ":".join(str(ROOT / s) for s in ("operator", "runtime", "kernels")), "PATH": "/usr/bin:/bin"}
    p = subprocess.run([sys.executable, "-m", "moe_runtime.cli", "serve", "--model", str(ck), "--port", "0"],
                       capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 1  # bad input
    assert "truncated safetensors data" in p.stderr and f.name in p.stderr


def test_corrupt_header(ck, capsys):
    f = shard_of(ck, "model.embed_tokens.weight")
    f.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!" + b"\x00" * 64)
    msg = serve_fails(ck, capsys)
    assert "corrupt safetensors header" in msg and f.name in msg


def test_missing_tensor(ck, capsys):
    name = "model.layers.2.mlp.experts.5.down_proj.weight_scale"
    rewrite(shard_of(ck, name), lambda t: t.pop(name))
    msg = serve_fails(ck, capsys)
    assert f"missing tensor {name}" in msg


def test_wrong_shape(ck, capsys):
    name = "model.layers.0.self_attn.o_proj.weight"
    rewrite(shard_of(ck, name), lambda t: t.__setitem__(name, torch.zeros(64, 32, dtype=torch.bfloat16)))
    msg = serve_fails(ck, capsys)
    assert name in msg and "shape [64, 32], expected [64, 64]" in msg


def test_wrong_dtype(ck, capsys):
    name = "model.layers.1.mlp.experts.2.up_proj.weight"
    rewrite(shard_of(ck, name), lambda t: t.__setitem__(name, t[name].to(torch.int8)))
    msg = serve_fails(ck, capsys)
    assert name in msg and "dtype I8, expected U8" in msg


def test_unsupported_format(ck, capsys):
    cfg = json.loads((ck / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized"}
    (ck / "config.json").write_text(json.dumps(cfg))
    msg = serve_fails(ck, capsys)
    assert "unsupported checkpoint format 'ct_nvfp4'" in msg


def test_unsupported_architecture(ck, capsys):
    cfg = json.loads((ck / "config.json").read_text())
    cfg["architectures"] = ["LlamaForCausalLM"]
    (ck / "config.json").write_text(json.dumps(cfg))
    assert "unsupported architecture 'LlamaForCausalLM'" in serve_fails(ck, capsys)


def test_missing_tokenizer(ck, capsys):
    (ck / "tokenizer.json").unlink()
    assert "tokenizer.json: cannot load the tokenizer" in serve_fails(ck, capsys)


def _plan(tmp_path, **over):
    plan = {"gpu": {"family": "cpu", "product": "cpu"},
            "checkpoint": {"architecture": "DeepseekV3ForCausalLM", "format": "nvfp4"},
            "engine": {"name": "bundled", "version": "0.1.0"},
            "moe": {"runnerBackend": "torch", "a2aBackend": "none", "deferredFinalize": True},
            "env": {"MOE_RUNNER_BACKEND": "torch", "MOE_DEFERRED_FINALIZE": "1"}, "args": [], "reasons": [],
            "warnings": [], "errors": [], "someFutureKey": {"ignored": True}}
    for k, v in over.items():
        plan[k] = {**plan[k], **v} if isinstance(v, dict) and v else v  # {} replaces
    p = tmp_path / "plan.json"
    p.write_text(json.dumps(plan))
    return p


def test_plan_for_another_gpu(base, tmp_path, capsys):
    p = _plan(tmp_path, gpu={"family": "sm100", "product": "NVIDIA-B200"}, moe={"runnerBackend": "flashinfer_trtllm"})
    msg = serve_fails(base, capsys, "--plan", str(p))
    assert "plan is for sm100 (NVIDIA-B200) but this node is cpu" in msg


def test_plan_for_another_checkpoint_format(base, tmp_path, capsys):
    p = _plan(tmp_path, checkpoint={"format": "mxfp4"})
    assert "plan is for checkpoint format mxfp4 but the checkpoint is nvfp4" in serve_fails(base, capsys, "--plan", str(p))


def test_plan_with_errors_and_bad_json(base, tmp_path, capsys):
    p = _plan(tmp_path, errors=["[B2] no bundled MoE backend runs nvfp4 experts"])
    assert "the plan has errors" in serve_fails(base, capsys, "--plan", str(p), status=2)
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    assert "is not valid JSON" in serve_fails(base, capsys, "--plan", str(bad))


def test_plan_backend_impossible_here(base, tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("MOE_RUNNER_BACKEND", raising=False)
    p = _plan(tmp_path, moe={"runnerBackend": "triton"}, env={})
    msg = serve_fails(base, capsys, "--plan", str(p))
    assert "MoE backend triton" in msg and "not cpu" in msg and "Backends that can: torch" in msg


# ------------------------------------------------------------------------------------ pure resolution

class _Info:
    def __init__(self, fmt="nvfp4", shared=1, arch="DeepseekV3ForCausalLM"):
        self.format, self.numSharedExperts, self.architecture = fmt, shared, arch
        self.formatSource = "test"


def test_auto_resolves_like_the_planner():
    from moe_core import registry
    from moe_runtime.plan_check import resolve

    installed = {"triton": "3.6.0", "flashinfer-python": None}
    r = resolve(None, "sm90", "NVIDIA H200", _Info(), {}, installed)
    assert r.backends == [b.name for b in registry.candidates("sm90", "nvfp4", installed)] == ["triton", "torch"]
    assert r.deferred and not r.explicit
    r = resolve(_full_plan("sm100", "auto"), "sm100", "NVIDIA B200", _Info(), {},
                {"triton": "3.6.0", "flashinfer-python": "0.6.15"})
    assert r.backends[0] == "triton" and "flashinfer_trtllm" in r.backends  # verified before unverified
    r = resolve(None, "sm90", "H200", _Info("bf16", shared=0, arch="Qwen3MoeForCausalLM"), {}, installed)
    assert not r.deferred  # nothing to fuse without a shared expert


def _full_plan(family, backend, deferred=True, **over):
    plan = {"gpu": {"family": family, "product": ""},
            "checkpoint": {"architecture": "DeepseekV3ForCausalLM", "format": "nvfp4"},
            "engine": {"name": "bundled", "version": "0.1.0"},
            "moe": {"runnerBackend": backend, "a2aBackend": "none", "deferredFinalize": deferred}}
    return {**plan, **over}


def test_env_overrides_and_explicit_choice_has_no_fallback():
    from moe_runtime.plan_check import resolve

    installed = {"triton": "3.6.0"}
    # a plan's env map is not read (the operator renders no MOE_* env): only the process env counts
    plan = {**_full_plan("sm90", "triton"), "env": {"MOE_RUNNER_BACKEND": "torch", "MOE_DEFERRED_FINALIZE": "0"}}
    r = resolve(plan, "sm90", "H200", _Info(), {}, installed)
    assert r.backends == ["triton", "torch"] and not r.explicit and r.deferred  # the planner's pick may fall back
    r = resolve(plan, "sm90", "H200", _Info(), {"MOE_RUNNER_BACKEND": "torch", "MOE_DEFERRED_FINALIZE": "0"}, installed)
    assert r.backends == ["torch"] and r.explicit and not r.deferred  # the user's env wins
    assert any("overrides the plan's backend triton" in w for w in r.warnings)
    user = {**plan, "decisions": [{"key": "moe.runnerBackend", "value": "triton", "rule": "user", "reason": "x"}]}
    assert resolve(user, "sm90", "H200", _Info(), {}, installed).backends == ["triton"]
    with pytest.raises(RuntimeFailure, match="plan is for engine 'sglang'"):
        resolve(_full_plan("sm90", "auto", engine={"name": "sglang"}), "sm90", "H200", _Info(), {}, installed)
    with pytest.raises(RuntimeFailure, match="is not a plan: moe: Field required"):
        resolve({k: v for k, v in plan.items() if k != "moe"}, "sm90", "H200", _Info(), {}, installed)


def test_selftest_failure_falls_back_and_counts(monkeypatch):
    from moe_kernels import selftest
    from moe_runtime.metrics import Metrics
    from moe_runtime.plan_check import Resolution
    from moe_runtime.serve import select_backend

    class R:
        def __init__(self, ok):
            self.ok, self.max_rel_err, self.message = ok, 0.0 if ok else 1.0, "ok" if ok else "wrong results"

    monkeypatch.setattr(selftest, "selftest", lambda name, fmt, dev, **kw: R(name == "torch"))
    m = Metrics()
    res = Resolution("sm90", "nvfp4", ["triton", "torch"], False, True)
    assert select_backend(res, "cpu", m) == ("torch", True)
    assert b'moe_runtime_backend_fallbacks_total{from_backend="triton",to_backend="torch"} 1.0' in m.render()
    with pytest.raises(RuntimeFailure, match="no MoE backend passed its self-test.*triton: wrong results"):
        select_backend(Resolution("sm90", "nvfp4", ["triton"], True, True), "cpu", m)


def test_a_backend_that_cannot_run_the_models_experts_falls_back_before_its_selftest(monkeypatch):
    """gpt-oss's MXFP4 experts at I=32 are not whole Triton FP4 scale groups: triton is left before
    its self-test (which runs its own shapes), torch serves; an explicit triton stops with the reason."""
    import torch

    from moe_kernels import selftest
    from moe_kernels.experts import ExpertWeights
    from moe_runtime.metrics import Metrics
    from moe_runtime.plan_check import Resolution
    from moe_runtime.serve import select_backend

    tested = []
    monkeypatch.setattr(selftest, "selftest", lambda name, fmt, dev, **kw: tested.append((name, kw)) or
                        type("R", (), {"ok": True, "max_rel_err": 0.0, "message": "ok"})())
    ew = ExpertWeights.from_quantized("mxfp4", w13_weight=torch.zeros(2, 64, 32, dtype=torch.uint8),
                                      w13_weight_scale=torch.zeros(2, 64, 2, dtype=torch.uint8),
                                      w2_weight=torch.zeros(2, 64, 16, dtype=torch.uint8),
                                      w2_weight_scale=torch.zeros(2, 64, 1, dtype=torch.uint8))
    assert (ew.hidden_size, ew.intermediate_size) == (64, 32)
    res = Resolution("sm90", "mxfp4", ["triton", "torch"], False, False, activation="swiglu_oai", bias=True)
    assert select_backend(res, "cpu", Metrics(), experts=ew) == ("torch", False)
    assert tested == [("torch", {"activation": "swiglu_oai", "bias": True})]
    with pytest.raises(RuntimeFailure, match="triton: mxfp4 needs H/2 and I/2 to be multiples of 32"):
        select_backend(Resolution("sm90", "mxfp4", ["triton"], True, False), "cpu", Metrics(), experts=ew)


def test_real_planner_output_is_accepted_and_checked(tmp_path):
    """Contract with moe_operator.planner: its JSON plan for this node passes; one for another GPU fails."""
    from moe_core import gpu
    from moe_core.checkpoint import inspect_dir
    from moe_operator import planner
    from moe_runtime.plan_check import resolve

    d = make_checkpoint(tmp_path / "c", "deepseek_v3", "nvfp4", "tiny")
    info = inspect_dir(d)
    installed = {"triton": "3.6.0", "flashinfer-python": None}
    h200 = json.loads(planner.plan(info, gpu.from_name("H200")).model_dump_json())
    r = resolve(h200, "sm90", "NVIDIA H200", info, {}, installed)
    assert r.backends == ["triton", "torch"] and r.deferred and not r.warnings
    b200 = json.loads(planner.plan(info, gpu.from_name("B200")).model_dump_json())
    with pytest.raises(RuntimeFailure, match=r"plan is for sm100 \(NVIDIA-B200\) but this node is sm90 \(NVIDIA H200\)"):
        resolve(b200, "sm90", "NVIDIA H200", info, {}, installed)
