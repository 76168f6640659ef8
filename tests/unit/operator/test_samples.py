"""The samples (issue 26 item 3): deploy/samples/*.yaml is the golden path of a default install
(hf:// at a pinned hub commit with the model cache on, or pvc://), which the chart's default policy
admits; deploy/samples/demo/ holds the demo's file:// samples, which that policy refuses."""

import re
from pathlib import Path

import pytest
import yaml

from moe_operator.api import MoEDeploymentSpec
from moe_operator.reconcile import Config
from moe_operator.webhook import verdict

ROOT = Path(__file__).resolve().parents[3]
GOLDEN = sorted((ROOT / "deploy" / "samples").glob("*.yaml"))
DEMO = sorted((ROOT / "deploy" / "samples" / "demo").glob("*.yaml"))
COMMIT = re.compile(r"^hf://[^@]+@[0-9a-f]{40}$")


def _spec(path: Path) -> dict:
    return yaml.safe_load(path.read_text())["spec"]


def test_the_golden_path_covers_the_models_of_the_issue():
    uris = " ".join(_spec(p)["model"]["uri"] for p in GOLDEN)
    for needle in ("openai/gpt-oss-120b@", "deepseek-ai/DeepSeek-V3@", "-FP4", "Qwen/Qwen3-235B-A22B-FP8@",
                   "moonshotai/Kimi-K2-Instruct@", "pvc://"):
        assert needle in uris, needle
    assert len(DEMO) >= 5 and all(_spec(p)["model"]["uri"].startswith("file:///models/") for p in DEMO)


@pytest.mark.parametrize("path", GOLDEN, ids=[p.stem for p in GOLDEN])
def test_golden_samples_are_pinned_cached_and_admitted_by_the_default_policy(path):
    spec = _spec(path)
    MoEDeploymentSpec.model_validate(spec)
    uri = spec["model"]["uri"]
    if uri.startswith("hf://"):
        assert COMMIT.match(uri), f"{path.name}: pin the hub commit (hf://org/name@<40 hex>)"
        assert spec["model"].get("cache", {}).get("enabled") is True, f"{path.name}: the model cache is on"
    else:
        assert uri.startswith("pvc://"), f"{path.name}: a default install allows no host path"
    assert verdict(spec, Config()) is None  # the chart's defaults: no host path, ClusterIP, any registry


@pytest.mark.parametrize("path", DEMO, ids=[p.stem for p in DEMO])
def test_demo_samples_need_a_host_path_and_have_their_checkpoint(path):
    spec = _spec(path)
    assert "host paths are not allowed" in verdict(spec, Config())
    assert (ROOT / "deploy" / "samples" / "checkpoints" / spec["model"]["uri"].rsplit("/", 1)[1] / "config.json").is_file()
