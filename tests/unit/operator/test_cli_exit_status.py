"""Flags of `moe-runtime` and `moe-operator plan|crd`, good and bad, table-driven plus a seeded
random sweep: every refusal is one clear `error:` line naming the flag, with the documented exit
status (0 ok, 1 bad input, 2 the plan has errors, 3 usage) and never a traceback; the serve
refusals happen before the model loads or the port opens."""

import json
import os
import random
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from moe_runtime import __version__
from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.cli import main as runtime_main
from moe_operator.cli import main as operator_main

ROOT = Path(__file__).resolve().parents[3]
SAMPLES = ROOT / "deploy" / "samples" / "checkpoints"
ENV = {**os.environ, "PYTHONPATH": ":".join(str(ROOT / s) for s in ("operator", "runtime", "kernels"))}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("cli") / "tiny", "deepseek_v3", "nvfp4", "tiny")


def run_main(main, argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out, err
    return rc, out, err


def never_serves(monkeypatch):
    """Fail the test if the serve path got past flag validation (no loading, no port)."""
    import moe_runtime.serve as serve_mod

    monkeypatch.setattr(serve_mod, "serve", lambda args: pytest.fail("serve() ran with bad flags"))


@pytest.fixture
def busy_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    yield s.getsockname()[1]
    s.close()


SERVE_BAD = [
    (["--max-batch", "0"], 1, "--max-batch 0"),
    (["--max-batch", "-3"], 1, "--max-batch -3"),
    (["--max-queue", "0"], 1, "--max-queue 0"),
    (["--threads", "-1"], 1, "--threads -1"),
    (["--threads", "100000"], 1, "--threads 100000"),
    (["--threads", "two"], 3, "--threads: invalid int value"),
    (["--device", "tpu"], 3, "--device: invalid choice"),
    (["--device", ""], 3, "--device: invalid choice"),
    (["--port", "70000"], 1, "--port 70000"),
    (["--port", "-1"], 1, "--port -1"),
    (["--port", "http"], 3, "--port: invalid int value"),
    (["--host", "no such host.invalid"], 1, "--host"),
    (["--host", ""], 1, "--host"),
    (["--max-model-len", "0"], 1, "--max-model-len 0"),
    (["--max-model-len", "10000000"], 1, "beyond the model's max_position_embeddings"),
    (["--served-model-name", " "], 1, "--served-model-name"),
    (["--api-key", ""], 1, "--api-key"),
    (["--max-body-bytes", "10"], 1, "--max-body-bytes 10"),
    (["--plan", "/nonexistent/plan.json"], 1, "--plan '/nonexistent/plan.json': no such file"),
    (["--dtype", "fp4"], 3, "--dtype: invalid choice"),
    (["--frobnicate"], 3, "unrecognized arguments: --frobnicate"),
]


@pytest.mark.parametrize("extra,status,needle", SERVE_BAD)
def test_bad_serve_flags_are_refused_before_loading(model, extra, status, needle, capsys, monkeypatch):
    never_serves(monkeypatch)
    rc, _, err = run_main(runtime_main, ["serve", "--model", str(model), "--port", "0", *extra], capsys)
    assert rc == status, err
    assert needle in err and "error:" in err


def test_serve_model_path_and_busy_port(model, tmp_path, busy_port, capsys, monkeypatch):
    never_serves(monkeypatch)
    rc, _, err = run_main(runtime_main, ["serve", "--model", str(tmp_path / "nope")], capsys)
    assert rc == 1 and "no such directory" in err
    f = tmp_path / "file"
    f.write_text("x")
    rc, _, err = run_main(runtime_main, ["serve", "--model", str(f)], capsys)
    assert rc == 1 and "is not a directory" in err
    # the busy port is found by serve's first step, binding the socket: before the checkpoint is read
    import moe_runtime.serve as serve_mod

    monkeypatch.undo()
    monkeypatch.setattr(serve_mod, "prepare", lambda args: pytest.fail("serve read the checkpoint before binding"))
    rc, _, err = run_main(runtime_main, ["serve", "--model", str(model), "--host", "127.0.0.1",
                                         "--port", str(busy_port)], capsys)
    assert rc == 1 and "already in use" in err


def test_good_serve_flags_reach_serve_with_options(model, capsys, monkeypatch):
    import moe_runtime.serve as serve_mod
    from moe_runtime.http.state import ServerOptions

    from moe_runtime.flags import server_options

    seen = {}
    monkeypatch.setattr(serve_mod, "serve", lambda args: seen.setdefault("args", args) and 0)
    rc, _, err = run_main(runtime_main, ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", "0",
                                         "--max-model-len", "64", "--api-key", "k", "--max-body-bytes", "4096"], capsys)
    assert rc == 0, err
    a = seen["args"]
    assert a.threads == 1 and a.max_batch is None and a.max_model_len == 64  # None: sized from the KV cache
    assert server_options(a) == ServerOptions(api_key="k", max_body_bytes=4096)  # what serve's state gets


@pytest.mark.parametrize("argv,status,needle", [
    ([], 3, "required"),
    (["bogus"], 3, "invalid choice"),
    (["inspect"], 3, "the following arguments are required: path"),
    (["make-checkpoint", "--arch", "llama", "--format", "bf16", "/tmp/x"], 3, "--arch: invalid choice"),
    (["serve"], 3, "--model"),
    (["--version"], 0, ""),
])
def test_usage_errors_exit_3(argv, status, needle, capsys):
    rc, out, err = run_main(runtime_main, argv, capsys)
    assert rc == status and needle in err
    if argv == ["--version"]:
        assert out.strip() == f"moe-runtime {__version__}"


def test_inspect_bad_input_exits_1(tmp_path, capsys):
    rc, _, err = run_main(runtime_main, ["inspect", str(tmp_path / "nope")], capsys)
    assert rc == 1 and err.startswith("error:")


def test_make_checkpoint_targets(tmp_path, capsys):
    f = tmp_path / "afile"
    f.write_text("x")
    base = ["make-checkpoint", "--arch", "qwen3_moe", "--format", "bf16"]
    rc, _, err = run_main(runtime_main, [*base, str(f)], capsys)
    assert rc == 1 and "is not a directory" in err
    rc, _, err = run_main(runtime_main, [*base, str(f / "sub")], capsys)
    assert rc == 1 and "is a file" in err
    rc, _, err = run_main(runtime_main, [*base, "--device", "gpu0", str(tmp_path / "d")], capsys)
    assert rc == 1 and "--device 'gpu0'" in err
    d = tmp_path / "ck"
    d.mkdir()
    (d / "stale.safetensors").write_text("old")
    (d / "hf_quant_config.json").write_text("{}")
    rc, _, err = run_main(runtime_main, [*base, str(d)], capsys)
    assert rc == 1 and "not empty" in err and "--force" in err
    assert (d / "stale.safetensors").exists()
    rc, _, err = run_main(runtime_main, [*base, "--force", str(d)], capsys)
    assert rc == 0, err
    assert not (d / "stale.safetensors").exists() and not (d / "hf_quant_config.json").exists()
    assert (d / "config.json").is_file()
    rc, out, _ = run_main(runtime_main, ["inspect", str(d), "--termination-log", str(tmp_path / "t")], capsys)
    assert rc == 0 and json.loads(out)["format"] == "bf16"


def test_unexpected_exception_is_one_line_unless_debug(model, capsys, monkeypatch):
    import moe_runtime.inspect_cmd as inspect_cmd

    def boom(*a, **k):
        raise KeyError("surprise")

    monkeypatch.setattr(inspect_cmd, "run_inspect", boom)
    rc, _, err = run_main(runtime_main, ["inspect", str(model)], capsys)
    assert rc == 1 and "error: inspect failed: KeyError" in err and "--debug" in err
    rc = runtime_main(["--debug", "inspect", str(model)])
    err = capsys.readouterr().err
    assert rc == 1 and "Traceback" in err
    rc = runtime_main(["inspect", "--debug", str(model)])
    assert rc == 1 and "Traceback" in capsys.readouterr().err


def test_random_serve_flag_combinations(model, capsys, monkeypatch):
    """Seeded sweep: combinations with at least one bad value; status 1 or 3, the message names a
    flag that was bad, no traceback, nothing served."""
    never_serves(monkeypatch)
    good = {"--max-batch": ["1", "8"], "--max-queue": ["1", "64"], "--threads": ["0", "1", "2"],
            "--max-model-len": ["16", "128"], "--dtype": ["auto", "float32"], "--device": ["cpu"]}
    bad = {"--max-batch": ["0", "-1", "x", "99999"], "--max-queue": ["0", "-9", "1.5"], "--threads": ["-2", "abc", "5000"],
           "--max-model-len": ["1", "-5", "99999999", "ten"], "--dtype": ["int8"], "--device": ["npu"],
           "--port": ["65536", "-80", "p"], "--max-body-bytes": ["0", "many"]}
    rng = random.Random(4)
    for _ in range(60):
        flags = rng.sample(sorted(set(good) | set(bad)), 3)
        bad_flags = set(rng.sample(flags, rng.randint(1, 3))) & set(bad)
        if not bad_flags:
            bad_flags = {next(f for f in flags if f in bad)} if any(f in bad for f in flags) else {"--port"}
            flags = list(dict.fromkeys(flags + list(bad_flags)))
        argv = ["serve", "--model", str(model), "--host", "127.0.0.1", "--port", "0"]
        for f in flags:
            argv += [f, rng.choice(bad[f] if f in bad_flags else good.get(f, ["0"]))]
        rc, _, err = run_main(runtime_main, argv, capsys)
        assert rc in (1, 3), (argv, rc, err)
        assert err.count("error:") == 1 and any(f in err for f in bad_flags), (argv, err)


def test_subprocess_statuses_and_no_traceback(model, tmp_path):
    def run(*argv):
        p = subprocess.run([sys.executable, "-m", "moe_runtime.cli", *argv], capture_output=True, text=True, env=ENV,
                           timeout=120)
        assert "Traceback" not in p.stderr, p.stderr
        return p

    p = run("serve", "--model", str(model), "--max-batch", "0")
    assert p.returncode == 1 and "--max-batch 0" in p.stderr
    p = run("serve", "--model", str(model), "--threads", "x")
    assert p.returncode == 3 and "invalid int value" in p.stderr
    p = run("--version")
    assert p.returncode == 0 and p.stdout.strip() == f"moe-runtime {__version__}"
    f = tmp_path / "f"
    f.write_text("")
    p = run("make-checkpoint", "--arch", "deepseek_v3", "--format", "bf16", str(f))
    assert p.returncode == 1 and "not a directory" in p.stderr
    with socket.socket() as busy:  # the SIGABRT: a port in use, an invalid host
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        p = run("serve", "--model", str(model), "--host", "127.0.0.1", "--port", str(busy.getsockname()[1]))
    assert p.returncode == 1 and "already in use" in p.stderr
    p = run("serve", "--model", str(model), "--host", "300.1.2.3", "--port", "0")
    assert p.returncode == 1 and "--host '300.1.2.3'" in p.stderr


# ------------------------------------------------------------------------------------- plan / crd

PLAN = ["plan", "--checkpoint", str(SAMPLES / "deepseek-v3-nvfp4"), "--gpu", "B200"]


@pytest.mark.parametrize("value,status,deferred", [
    ("true", 0, "1"), ("on", 0, "1"), ("TRUE", 0, "1"), ("yes", 0, "1"), ("1", 0, "1"),
    ("false", 0, "0"), ("off", 0, "0"), ("0", 0, "0"), ("auto", 0, "any"),
    ("maybe", 1, None), ("", 1, None), ("enabled", 1, None),
])
def test_plan_deferred_finalize_values(value, status, deferred, capsys):
    rc, out, err = run_main(operator_main, [*PLAN, "--engine", "sglang", "--set", f"moe.deferredFinalize={value}",
                                            "-o", "json"], capsys)
    assert rc == status, err
    if status:
        assert "moe.deferredFinalize" in err and "on, off or auto" in err
        return
    plan = json.loads(out)
    if deferred != "any":
        assert plan["env"].get("SGLANG_ENABLE_MOE_DEFERRED_FINALIZE") == deferred
    df = [d for d in plan["decisions"] if d["key"] in ("moe.deferredFinalize", "env.SGLANG_ENABLE_MOE_DEFERRED_FINALIZE")]
    if value in ("true", "on", "TRUE", "yes", "1"):
        assert plan["moe"]["deferredFinalize"] is True and any("=on" in d["reason"] for d in df)
    if value in ("false", "off", "0"):
        assert plan["moe"]["deferredFinalize"] is False and all("moe.deferredFinalize=on" not in d["reason"] for d in df)


@pytest.mark.parametrize("kv,needle", [
    ("parallelism.tp=-4", "parallelism.tp='-4'"), ("parallelism.ep=0", "parallelism.ep='0'"),
    ("parallelism.dp=abc", "parallelism.dp='abc'"), ("parallelism.tp=1000", "1..64"),
    ("parallelism.tp=2.5", "integer"), ("moe.runnerBackend=", "empty value"), ("nope=1", "unknown --set key"),
    ("noequals", "is not KEY=VALUE"), ("=x", "empty key"),
])
def test_plan_bad_set_values_exit_1(kv, needle, capsys):
    rc, _, err = run_main(operator_main, [*PLAN, "--set", kv], capsys)
    assert rc == 1 and needle in err and err.startswith("error:")


@pytest.mark.parametrize("engine,sets,envs,needle", [
    ("bundled", ["moe.runnerBackend=torch"], ["MOE_RUNNER_BACKEND=triton"], "[ENV1]"),
    ("sglang", ["moe.runnerBackend=flashinfer_trtllm"], ["SGLANG_CUTLASS_MOE=1"], "[ENV1]"),
    ("vllm", ["moe.runnerBackend=flashinfer_cutlass"], ["VLLM_USE_FLASHINFER_MOE_FP4=1",
                                                        "VLLM_FLASHINFER_MOE_BACKEND=latency"], "[ENV1]"),
    ("sglang", ["moe.deferredFinalize=on"], ["SGLANG_ENABLE_MOE_DEFERRED_FINALIZE=0"], "[ENV2]"),
    ("bundled", ["moe.deferredFinalize=off"], ["MOE_DEFERRED_FINALIZE=1"], "[ENV2]"),
])
def test_plan_set_env_conflicts_warn(engine, sets, envs, needle, capsys):
    argv = [*PLAN, "--engine", engine, *sum((["--set", s] for s in sets), []), *sum((["--env", e] for e in envs), []),
            "-o", "json"]
    rc, out, _ = run_main(operator_main, argv, capsys)
    plan = json.loads(out)
    assert rc in (0, 2) and any(w.startswith(needle) for w in plan["warnings"]), plan["warnings"]
    # the same choices without the conflicting env: no such warning
    rc, out, _ = run_main(operator_main, [*PLAN, "--engine", engine, *sum((["--set", s] for s in sets), []), "-o", "json"],
                          capsys)
    assert not any(w.startswith(needle) for w in json.loads(out)["warnings"])


def test_plan_outputs_carry_structured_decisions(capsys):
    rc, out, _ = run_main(operator_main, [*PLAN, "-o", "json"], capsys)
    decisions = json.loads(out)["decisions"]
    assert rc == 0 and decisions and all(set(d) == {"key", "value", "rule", "reason"} and d["rule"] for d in decisions)
    import yaml

    rc, out, _ = run_main(operator_main, [*PLAN, "-o", "yaml"], capsys)
    assert yaml.safe_load(out)["decisions"] == decisions


def test_plan_statuses(capsys):
    rc, _, err = run_main(operator_main, [*PLAN[:3], "--gpu", "H200", "--set", "moe.runnerBackend=flashinfer_trtllm"],
                          capsys)
    assert rc == 2
    rc, _, err = run_main(operator_main, ["plan", "--checkpoint", str(SAMPLES)], capsys)
    assert rc == 3 and "--gpu" in err
    rc, _, err = run_main(operator_main, [*PLAN[:3], "--gpu", "Z9000"], capsys)
    assert rc == 1
    rc, _, err = run_main(operator_main, [*PLAN, "-o", "xml"], capsys)
    assert rc == 3 and "invalid choice" in err
    rc, out, _ = run_main(operator_main, ["--version"], capsys)
    assert rc == 0 and out.startswith("moe-operator ")


def test_crd_output_format_and_path(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    rc, out, _ = run_main(operator_main, ["crd", "-o", "json"], capsys)
    assert rc == 0 and json.loads(out)["kind"] == "CustomResourceDefinition"
    assert not (tmp_path / "json").exists()
    rc, out, _ = run_main(operator_main, ["crd", "--format", "json"], capsys)
    assert json.loads(out)["kind"] == "CustomResourceDefinition"
    rc, _, _ = run_main(operator_main, ["crd", "-o", "out.json"], capsys)
    assert rc == 0 and json.loads((tmp_path / "out.json").read_text())["kind"] == "CustomResourceDefinition"
    rc, _, _ = run_main(operator_main, ["crd", "-o", "out.yaml"], capsys)
    import yaml

    assert yaml.safe_load((tmp_path / "out.yaml").read_text())["kind"] == "CustomResourceDefinition"
    rc, _, err = run_main(operator_main, ["crd", "-o", str(tmp_path)], capsys)
    assert rc == 1 and "is a directory" in err
    rc, _, err = run_main(operator_main, ["crd", "--format", "xml"], capsys)
    assert rc == 3


def test_plan_model_statuses(capsys, monkeypatch):
    """plan --model: a hub that refuses the connection is bad input (1, one line naming the uri);
    --model and --checkpoint together, or neither, are usage (3)."""
    import huggingface_hub.constants as c

    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    closed = s.getsockname()[1]
    s.close()  # nothing listens there now
    monkeypatch.setattr(c, "ENDPOINT", f"http://127.0.0.1:{closed}")
    monkeypatch.setattr(c, "HUGGINGFACE_CO_URL_TEMPLATE", f"http://127.0.0.1:{closed}" + "/{repo_id}/resolve/{revision}/{filename}")
    rc, out, err = run_main(operator_main, ["plan", "--model", "hf://org/m", "--gpu", "H200"], capsys)
    assert rc == 1 and out == "" and err.startswith("error: hf://org/m") and err.count("\n") == 1, err
    rc, _, err = run_main(operator_main, ["plan", "--model", "hf://org/m", *PLAN[1:3], "--gpu", "H200"], capsys)
    assert rc == 3 and "not allowed with" in err
    rc, _, err = run_main(operator_main, ["plan", "--gpu", "H200"], capsys)
    assert rc == 3 and "one of the arguments --checkpoint --model is required" in err
