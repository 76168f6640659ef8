"""Bad checkpoints through `moe-runtime serve` and `inspect`, table-driven plus seeded random
mutations: safetensors headers (non-finite and overflowing numbers, wrong types, byte ranges that
do not fit, random byte flips) and config.json (every key the runtime reads, given values of the
wrong type, non-finite, overflowing or out of range, and keys that cannot work together).

Each refusal must be one `error:` line naming the file, the key (tensor or config key) and the
value, exit 1 (bad input), never a traceback, and must come before the weights load (`serve`'s
load stage is replaced by a test failure). A checkpoint whose loaded model gives non-finite logits
is refused by the forward self-test before Ready.
"""

import json
import os
import random
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest

import moe_runtime.serve as serve_mod
from moe_runtime.checkpoint_writer import make_checkpoint
from moe_runtime.cli import main
from moe_runtime.config_check import KEYS
from moe_runtime.errors import RuntimeFailure

SEED = 17
ROOT = Path(__file__).resolve().parents[3]
ENV = {**os.environ, "PYTHONPATH": ":".join(str(ROOT / s) for s in ("operator", "runtime", "kernels"))}


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")
    return {arch: make_checkpoint(root / arch, arch, "bf16", "tiny") for arch in ("deepseek_v3", "qwen3_moe")}


@pytest.fixture
def copy(bases, tmp_path):
    def make(arch="deepseek_v3"):
        d = tmp_path / f"ck-{arch}"
        if d.exists():
            shutil.rmtree(d)
        shutil.copytree(bases[arch], d)
        return d
    return make


LOADED = "LOADED: serve got past the header and config checks"


@pytest.fixture
def no_load(monkeypatch):
    """Refusals must come from the headers and config alone: serve's load stage is replaced by a
    refusal the tests recognise (a valid checkpoint among the random ones ends there)."""
    def load(*a, **k):
        raise RuntimeFailure(LOADED)

    monkeypatch.setattr(serve_mod, "load", load)


def run(argv, capsys):
    rc = main(argv)
    out, err = capsys.readouterr()
    assert "Traceback" not in err + out, err
    return rc, err.strip().splitlines()[-1] if err.strip() else ""


def serve_refuses(d, capsys):
    rc, line = run(["serve", "--model", str(d), "--host", "127.0.0.1", "--port", "0", "--device", "cpu"], capsys)
    assert rc == 1, line
    assert line.startswith("error: ") and LOADED not in line, line
    return line


def set_raw(d: Path, key: str, raw: str) -> None:
    """config.json with `key` set to the JSON text `raw` (NaN, Infinity and 1e999 are not values json.dumps writes)."""
    cfg = json.loads((d / "config.json").read_text())
    cfg[key] = "@@RAW@@"
    (d / "config.json").write_text(json.dumps(cfg).replace('"@@RAW@@"', raw))


# ------------------------------------------------------------------------------------ config.json

# (JSON text, what the message must show of it)
NON_FINITE = [("NaN", "nan"), ("Infinity", "inf"), ("-Infinity", "-inf"), ("1e999", "inf")]
BAD_BY_KIND = {
    "int": NON_FINITE + [("2.5", "2.5"), ("64.0", "64.0"), ('"8"', "'8'"), ("true", "True"), ("[8]", "[8]"),
                         ("{}", "{}"), ("-1", "-1"), (str(10**30), str(10**30)), ("2147483648", "2147483648")],
    "float": NON_FINITE + [('"1e-6"', "'1e-6'"), ("true", "True"), ("[0.5]", "[0.5]"), ("-1", "-1"), ("0", "0")],
    "bool": [('"false"', "'false'"), ("0", "0"), ("1", "1"), ("[]", "[]")],
    "str": [("5", "5"), ("[]", "[]"), ("{}", "{}"), ("NaN", "nan")],
    "ints": [('"0,1"', "'0,1'"), ("[1.5]", "[1.5]"), ("[-1]", "[-1]"), ("[true]", "[True]"), ("{}", "{}")],
    "strs": [('"full_attention"', "'full_attention'"), ("[1]", "[1]")],
}
# the runtime's positive keys refuse 0 too; the counts (experts, dense layers, MTP layers) accept it
ZERO_OK = {k for k, key in KEYS.items() if key.kind == "int" and key.low == 0}
CONFIG_CASES = [(k, raw, shown) for k, key in sorted(KEYS.items()) for raw, shown in BAD_BY_KIND[key.kind]]


def test_every_config_key_has_cases():
    assert {k for k, _, _ in CONFIG_CASES} == set(KEYS)
    assert len(CONFIG_CASES) > 300


@pytest.mark.parametrize("key,raw,shown", CONFIG_CASES, ids=[f"{k}={r[:12]}" for k, r, _ in CONFIG_CASES])
def test_bad_config_value_is_refused_naming_file_key_and_value(copy, key, raw, shown, capsys, no_load):
    d = copy("qwen3_moe" if key in ("head_dim", "decoder_sparse_step", "mlp_only_layers") else "deepseek_v3")
    set_raw(d, key, raw)
    line = serve_refuses(d, capsys)
    assert f"{d / 'config.json'}: " in line, line
    assert f"{key} = {shown}" in line, line


def test_zero_where_the_runtime_needs_one(copy, capsys, no_load):
    for key in sorted(k for k, v in KEYS.items() if v.kind == "int" and k not in ZERO_OK):
        d = copy()
        set_raw(d, key, "0")
        line = serve_refuses(d, capsys)
        assert f"{key} = 0" in line, (key, line)


@pytest.mark.parametrize("digits", [4301, 20000])
def test_an_integer_python_will_not_parse_names_the_file(copy, digits, capsys, no_load):
    d = copy()
    set_raw(d, "hidden_size", "9" * digits)
    line = serve_refuses(d, capsys)
    assert f"{d / 'config.json'}: invalid JSON" in line and "digits" in line, line


def test_deeply_nested_config_names_the_file(copy, capsys, no_load):
    d = copy()
    set_raw(d, "rope_scaling", "[" * 100_000 + "]" * 100_000)
    line = serve_refuses(d, capsys)
    assert f"{d / 'config.json'}" in line and ("nested too deeply" in line or "rope_scaling" in line), line


ROPE_BAD = [({"rope_type": "yarn", "factor": "NaN"}, "rope_scaling.factor = 'NaN'"),
            ({"rope_type": "yarn", "factor": 0}, "rope_scaling.factor = 0"),
            ({"rope_type": "yarn", "factor": 4, "original_max_position_embeddings": 4.5},
             "rope_scaling.original_max_position_embeddings = 4.5"),
            ({"rope_type": "yarn", "factor": 4, "beta_fast": "32"}, "rope_scaling.beta_fast = '32'"),
            ({"rope_type": "yarn", "factor": 4, "truncate": "false"}, "rope_scaling.truncate = 'false'"),
            ({"rope_type": 3}, "rope_scaling.rope_type = 3"),
            ({"rope_type": "dynamic", "factor": 2.0}, "rope_scaling type 'dynamic' is not supported"),
            ({"rope_type": "yarn"}, "rope_scaling type 'yarn' without a factor"),
            ([1, 2], "rope_scaling = [1, 2]: must be an object")]


@pytest.mark.parametrize("rope,needle", ROPE_BAD, ids=[n[:40] for _, n in ROPE_BAD])
def test_bad_rope_scaling(copy, rope, needle, capsys, no_load):
    d = copy()
    set_raw(d, "rope_scaling", json.dumps(rope))
    line = serve_refuses(d, capsys)
    assert needle in line and "config.json" in line, line


# arch, {key: value}, what the message says
INCONSISTENT = [
    ("deepseek_v3", {"num_experts_per_tok": 9}, "num_experts_per_tok = 9: more than the 8 routed experts (n_routed_experts)"),
    ("qwen3_moe", {"num_experts_per_tok": 9}, "num_experts_per_tok = 9: more than the 8 routed experts (num_experts)"),
    ("deepseek_v3", {"n_group": 3}, "n_group = 3: does not divide the 8 routed experts"),
    ("deepseek_v3", {"topk_group": 5}, "topk_group = 5: more than n_group = 4"),
    ("deepseek_v3", {"n_group": 8, "topk_group": 2}, "n_group = 8: 8 experts give groups of 1"),
    ("deepseek_v3", {"num_experts_per_tok": 5, "topk_group": 2},
     "num_experts_per_tok = 5: more than the 4 experts of the topk_group = 2 groups kept"),
    ("deepseek_v3", {"scoring_func": "softmax"}, "scoring_func = 'softmax': the bundled runtime routes DeepSeek-V3 with sigmoid only"),
    ("deepseek_v3", {"topk_method": "greedy"}, "topk_method = 'greedy'"),
    ("deepseek_v3", {"qk_rope_head_dim": 15}, "qk_rope_head_dim = 15: must be even"),
    ("qwen3_moe", {"num_key_value_heads": 3}, "num_key_value_heads = 3: does not divide num_attention_heads = 4"),
    ("qwen3_moe", {"head_dim": None, "hidden_size": 66}, "hidden_size = 66: not a multiple of num_attention_heads = 4"),
    ("qwen3_moe", {"head_dim": 15}, "head_dim = 15: must be even"),
    ("deepseek_v3", {"hidden_size": None}, "missing hidden_size (required by deepseek_v3)"),
    ("qwen3_moe", {"num_key_value_heads": None, "vocab_size": None}, "missing vocab_size, num_key_value_heads"),
    ("deepseek_v3", {"moe_intermediate_size": None}, "missing moe_intermediate_size"),
    # a dropped layer: the tensors of layer 2 (and 1) are there, the config serves fewer
    ("deepseek_v3", {"num_hidden_layers": 2}, "num_hidden_layers = 2, but model-"),
    ("qwen3_moe", {"num_hidden_layers": 1}, "has tensors of layer 1 (model.layers.1."),
]


@pytest.mark.parametrize("arch,edit,needle", INCONSISTENT, ids=[n[:50] for _, _, n in INCONSISTENT])
def test_inconsistent_config_is_refused_before_loading(copy, arch, edit, needle, capsys, no_load):
    d = copy(arch)
    cfg = json.loads((d / "config.json").read_text())
    for k, v in edit.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (d / "config.json").write_text(json.dumps(cfg))
    line = serve_refuses(d, capsys)
    assert needle in line and "config.json" in line, line


def test_mtp_layers_after_the_decoder_are_not_a_dropped_layer(copy, capsys, monkeypatch):
    """DeepSeek-V3 checkpoints carry their MTP layer as model.layers.<num_hidden_layers>: allowed when
    num_nextn_predict_layers counts it (and refused as a dropped layer when it does not)."""
    from moe_runtime.loader import validate_checkpoint

    d = copy()
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_hidden_layers"], cfg["num_nextn_predict_layers"] = 2, 1  # layer 2 becomes the MTP layer
    (d / "config.json").write_text(json.dumps(cfg))
    v = validate_checkpoint(d)
    assert any(n.startswith("model.layers.2.") for n in v.ignored)
    cfg["num_nextn_predict_layers"] = 0
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exception, match="layer 2 .*would be dropped"):
        validate_checkpoint(d)


def test_seeded_random_config_values(copy, capsys, no_load):
    """Random JSON values for random keys, several at a time: refused with the first bad key named,
    or accepted (then the weights would load: that is the only other outcome)."""
    rng = random.Random(SEED)
    pool = ["NaN", "Infinity", "-Infinity", "1e999", "-1", "0", "1", "3", "2.5", "true", "false", "null", '"x"', "[]",
            "{}", "[1, 2]", '{"a": 1}', str(2**31), str(2**64), "1e-300", "-0.0"]
    keys = sorted(KEYS)
    outcomes = {"refused": 0, "loads": 0}
    for _ in range(60):
        d = copy()
        for key in rng.sample(keys, rng.randint(1, 3)):
            set_raw(d, key, rng.choice(pool))
        rc = main(["serve", "--model", str(d), "--host", "127.0.0.1", "--port", "0", "--device", "cpu"])
        out, err = capsys.readouterr()
        assert "Traceback" not in err + out, err
        if LOADED in err:
            outcomes["loads"] += 1
            continue
        assert rc == 1 and err.strip().splitlines()[-1].startswith("error: "), err
        assert "config.json" in err, err
        outcomes["refused"] += 1
    assert outcomes["refused"] > 40, outcomes


# ------------------------------------------------------------------------------ safetensors headers

def shard(d: Path) -> Path:
    """The shard of layer 0 (many tensors; the first shard holds only the embeddings)."""
    return sorted(d.glob("*.safetensors"))[1]


def header_of(f: Path) -> tuple[dict, bytes]:
    raw = f.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_header(f: Path, text: str, data: bytes) -> None:
    b = text.encode()
    f.write_bytes(struct.pack("<Q", len(b)) + b + data)


def first_tensor(h: dict) -> str:
    return next(k for k in h if k != "__metadata__")


def edit_entry(field, raw):
    """A header edit: the first tensor's `field` set to the JSON text `raw`."""
    def edit(h, name):
        h[name][field] = "@@RAW@@"
        return json.dumps(h).replace('"@@RAW@@"', raw)
    return edit


def whole(text):
    return lambda h, name: text


def shape_scaled(h, name):
    h[name]["shape"] = [d * 2 for d in h[name]["shape"]]
    return json.dumps(h)


def overlap(h, name):
    names = [k for k in h if k != "__metadata__"]
    h[names[1]]["data_offsets"] = [0, h[names[1]]["data_offsets"][1] - h[names[1]]["data_offsets"][0]]
    h[names[0]]["data_offsets"] = [0, h[names[0]]["data_offsets"][1] - h[names[0]]["data_offsets"][0]]
    return json.dumps(h)


# edit, what the message must name besides the file
HEADER_CASES = [
    (edit_entry("shape", "[NaN, 4]"), "NaN is not a JSON number"),
    (edit_entry("shape", "[Infinity]"), "Infinity is not a JSON number"),
    (edit_entry("shape", "[1e999, 4]"), "number 1e999 overflows a float"),
    (edit_entry("shape", "[64.0, 512]"), "shape [64.0, 512] is not a list of non-negative integers"),
    (edit_entry("shape", "[true, 4]"), "shape [True, 4]"),
    (edit_entry("shape", "[-512, -64]"), "shape [-512, -64]"),
    (edit_entry("shape", '"512x64"'), "shape '512x64'"),
    (edit_entry("shape", f"[{2**64}, 1]"), f"shape [{2**64}, 1]"),
    (edit_entry("shape", "[" + "9" * 5000 + "]"), "digits"),
    (shape_scaled, "bytes but data_offsets"),
    (edit_entry("dtype", "5"), "dtype 5 is not a dtype name"),
    (edit_entry("dtype", "null"), "dtype None"),
    (edit_entry("dtype", '"F32"'), "bytes but data_offsets"),
    (edit_entry("data_offsets", "[100, 0]"), "data_offsets [100, 0] end before they start"),
    (edit_entry("data_offsets", "[0]"), "data_offsets [0] is not a pair"),
    (edit_entry("data_offsets", "[0.0, 65536.0]"), "data_offsets [0.0, 65536.0]"),
    (edit_entry("data_offsets", f"[0, {10**15}]"), "truncated safetensors data"),
    (edit_entry("data_offsets", f"[0, {2**64}]"), f"data_offsets [0, {2**64}] is not a pair"),
    (edit_entry("data_offsets", "[NaN, 1]"), "NaN is not a JSON number"),
    (overlap, "overlap in the data section"),
    (whole("[1, 2, 3]"), "not a JSON object"),
    (whole('{"__metadata__": [1]}'), "__metadata__ is not an object"),
    (whole('{"a": 5}'), "tensor 'a': expected an object"),
    (whole('{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"), "nested too deeply"),
    (whole('{"a": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}'), "not JSON"),
    (whole('{"a": "\\ud800"}'), "tensor 'a': expected an object"),
]


@pytest.mark.parametrize("edit,needle", HEADER_CASES, ids=[n[:40] for _, n in HEADER_CASES])
def test_bad_safetensors_header_names_file_and_tensor(copy, edit, needle, capsys, no_load):
    d = copy()
    f = shard(d)
    h, data = header_of(f)
    name = first_tensor(h)
    write_header(f, edit(h, name), data)
    for argv in (["serve", "--model", str(d), "--host", "127.0.0.1", "--port", "0", "--device", "cpu"],
                 ["inspect", str(d), "--termination-log", str(d / "termination-log")]):
        rc, line = run(argv, capsys)
        assert rc == 1 and line.startswith("error: "), line
        assert str(f) in line and needle in line, line
        if edit.__name__ in ("edit", "shape_scaled") and "not JSON" not in line:  # an entry of that tensor
            assert repr(name) in line, line


def test_seeded_byte_flips_in_headers(copy, capsys, no_load):
    """Random bytes of a header replaced: refused naming the shard (or, when the flip hit a tensor
    name or padding, still a clear refusal or a checkpoint that is valid); never a traceback or
    another status."""
    rng = random.Random(SEED)
    d = copy()
    files = sorted(d.glob("*.safetensors"))
    pristine = {f: f.read_bytes() for f in files}
    outcomes = {"refused": 0, "valid": 0}
    for _ in range(80):
        f = rng.choice(files)
        raw = bytearray(pristine[f])
        (n,) = struct.unpack("<Q", raw[:8])
        for _ in range(rng.randint(1, 4)):
            raw[rng.randrange(0, 8 + n)] = rng.choice(b'0123456789-.eE+NIaf[]{},:"x \xff\x00')
        f.write_bytes(bytes(raw))
        rc = main(["serve", "--model", str(d), "--host", "127.0.0.1", "--port", "0", "--device", "cpu"])
        out, err = capsys.readouterr()
        f.write_bytes(pristine[f])
        assert "Traceback" not in err + out, err
        if LOADED in err:
            outcomes["valid"] += 1
            continue
        assert rc == 1 and err.strip().splitlines()[-1].startswith("error: "), err
        assert str(d) in err, err
        outcomes["refused"] += 1
    assert outcomes["refused"] > 60, outcomes


# ------------------------------------------------------------------------------ forward self-test

def test_forward_problem_is_a_pure_decision():
    import torch

    from moe_runtime.serve import forward_problem

    ok = torch.zeros(1, 4, 10)
    assert forward_problem(ok, 4, 10) is None
    assert "shape [1, 4, 9], expected [1, 4, 10]" in forward_problem(torch.zeros(1, 4, 9), 4, 10)
    nan = ok.clone()
    nan[0, 1, 3] = float("nan")
    nan[0, 2, 0] = float("inf")
    assert "2 of 40 logits are not finite" in forward_problem(nan, 4, 10)


def test_nan_weights_are_refused_by_the_forward_selftest_before_ready(copy, capsys):
    """Headers, shapes, dtypes and config all fine, the weights NaN: only a forward of the real
    model sees it. serve must exit 1 naming the problem instead of reporting Ready."""
    import torch
    from safetensors.torch import load_file, save_file

    d = copy("qwen3_moe")
    for f in d.glob("*.safetensors"):
        t = load_file(str(f))
        if "model.norm.weight" in t:
            t["model.norm.weight"] = torch.full_like(t["model.norm.weight"], float("nan"))
            save_file(t, str(f), metadata={"format": "pt"})
    try:  # a subprocess: a server that reports Ready instead would serve until the timeout
        p = subprocess.run([sys.executable, "-m", "moe_runtime.cli", "serve", "--model", str(d), "--host", "127.0.0.1",
                            "--port", "0", "--device", "cpu", "--dtype", "float32"], env=ENV, capture_output=True,
                           text=True, timeout=180)
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"serve kept running with NaN weights: {(e.stderr or b'')[-500:]!r}")
    assert p.returncode == 1 and "Traceback" not in p.stderr, p.stderr
    line = p.stderr.strip().splitlines()[-1]
    assert "self-test forward of the loaded model on the torch backend" in line and "logits are not finite" in line, line
    assert '"event": "ready"' not in p.stdout + p.stderr


def test_operator_classify_refuses_only_with_inspection_errors():
    """moe_core.checkpoint.classify (the operator's torch-free reading of config.json, hub and
    inspection Job alike) over random values for its facts and random quantization configs: a
    CheckpointInfo or an InspectionError naming config.json, never another exception."""
    from moe_core.checkpoint import CONFIG_KEYS, InspectionError, classify

    rng = random.Random(SEED)
    values = [float("nan"), float("inf"), -1, 0, 7, 2.5, 64.0, True, None, "8", [], {}, [1], {"a": 1}, 2**31, 10**30]
    quant = [None, {}, [], "fp8", {"quant_method": 5}, {"quant_method": "fp8", "weight_block_size": "x"},
             {"quant_method": "compressed-tensors", "config_groups": [1]},
             {"quant_method": "compressed-tensors", "config_groups": {"g": "w"}},
             {"quant_algo": "MIXED_PRECISION", "quantized_layers": [1]}, {"quant_algo": ["NVFP4"]},
             {"quant_method": "modelopt", "quantization": 3}, {"kv_cache_scheme": []}]
    keys = [k for ks in CONFIG_KEYS.values() for k in ks] + ["model_type"]
    outcomes = {"info": 0, "refused": 0}
    for _ in range(400):
        cfg = {"architectures": [rng.choice(["DeepseekV3ForCausalLM", "Qwen3MoeForCausalLM", "GptOssForCausalLM",
                                             "DeepseekV4ForCausalLM", "MixtralForCausalLM"])]}
        for k in rng.sample(keys, rng.randint(1, 6)):
            cfg[k] = rng.choice(values)
        if (q := rng.choice(quant)) is not None:
            cfg["quantization_config"] = q
        try:
            classify(cfg, rng.choice([None, {"quantization": []}, {"quant_algo": 5}]), [], where="/ck")
            outcomes["info"] += 1
        except InspectionError as e:
            assert str(e).startswith("/ck/config.json: "), e
            outcomes["refused"] += 1
    assert outcomes["info"] >= 5 and outcomes["refused"] > 300, outcomes  # (seeded: 7 and 393)
