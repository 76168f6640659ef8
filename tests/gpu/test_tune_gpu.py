"""The tune command on a CUDA GPU (skipped without one): a tiny shape, 2 candidates per size; the
written JSON is read back by the kernels' own lookup and its configs give the reference's output."""

import json

import pytest
import torch

triton = pytest.importorskip("triton")

from moe_kernels.reference import TorchExperts  # noqa: E402
from moe_kernels.triton_config import config_from_dict, load_table, shape_key, tuned_configs  # noqa: E402
from moe_kernels.triton_moe import TritonExperts  # noqa: E402
from moe_kernels.tune import _inputs, _rel, main, random_weights  # noqa: E402

SHAPE = (8, 256, 256, 2)   # E, H, I, top-k: fragment kernel at both sizes (H, I multiples of 256)
TOKENS = (1, 16)


@pytest.mark.parametrize("fmt", ["nvfp4"])
def test_tune_writes_a_table_the_kernels_read(tmp_path, fmt):
    path = tmp_path / "table.json"
    rc = main(["--shape", ",".join(map(str, SHAPE)), "--format", fmt, "--tokens", ",".join(map(str, TOKENS)),
               "-o", str(path), "--max-candidates", "2", "--rep", "5"])
    assert rc == 0, "tune failed or its read-back check failed (see the output above)"
    raw = json.loads(path.read_text())
    entry = raw["entries"][shape_key(fmt, *SHAPE)]
    assert sorted(int(t) for t in entry) == list(TOKENS)
    for v in entry.values():
        assert v["us"] > 0 and v["rel_err"] <= 2e-2 and v["checked"] >= 1
        config_from_dict(v["config"])
    table = load_table(str(path))
    cfgs = tuned_configs(table, fmt, *SHAPE)
    e, h, i, k = SHAPE
    weights = random_weights(fmt, e, h, i, seed=7)
    ex = TritonExperts(weights, tuned_table=table)
    ref = TorchExperts(weights)
    for t in TOKENS:
        x, w, ids = _inputs(t, e, h, k, seed=100 + t)
        assert ex.config_for(t * k, k) == cfgs[t]
        err = _rel(ex.forward(x, w, ids), ref.forward(x, w, ids))
        assert err < 2e-2, (t, err)
    # the same experts without the table run the defaults (the table is only data)
    assert TritonExperts(weights, tuned_table={}).config_for(k, k) is not None


def test_table_found_by_device_name(tmp_path, monkeypatch):
    # MOE_KERNELS_TUNED_CONFIGS=<dir>: the experts load <dir>/<device>.json themselves
    from dataclasses import replace

    from moe_kernels.triton_config import TABLE_ENV, config_to_dict, default_config, device_file_name
    e, h, i, k = SHAPE
    cfg = replace(default_config("nvfp4", k, e, True), pdl=False)   # not the default, and a tested path
    table = {"format_version": 1, "device": torch.cuda.get_device_name(),
             "entries": {shape_key("nvfp4", *SHAPE): {"1": {"config": config_to_dict(cfg)}}}}
    (tmp_path / device_file_name(torch.cuda.get_device_name())).write_text(json.dumps(table))
    monkeypatch.setenv(TABLE_ENV, str(tmp_path))
    weights = random_weights("nvfp4", e, h, i, seed=3)
    ex = TritonExperts(weights)
    assert ex.config_for(k, k) == cfg
    x, w, ids = _inputs(1, e, h, k, seed=5)
    assert _rel(ex.forward(x, w, ids), TorchExperts(weights).forward(x, w, ids)) < 2e-2
