"""The image-contents table is what deploy/Dockerfile.runtime builds (its pins), and the plan's
provenance (issue 33 item 4): candidates, explicit and from where, the image's kernel packages as the
operator assumed them; the pod takes the plan as it is where its packages are the assumed ones and
re-resolves, with a warning naming the difference, where they are not."""

import json
import re
from pathlib import Path

import pytest

from moe_core import image_contents
from moe_core.bundled import resolve_bundled
from moe_core.checkpoint import CheckpointInfo
from moe_core.gpu import PRODUCTS, from_name
from moe_core.plan import Plan, PlanImage
from moe_core.runtime import BUNDLED

ROOT = Path(__file__).resolve().parents[3]


def _arg(name):
    return re.search(rf"^ARG {name}=(\S+)$", (ROOT / "deploy" / "Dockerfile.runtime").read_text(), re.M).group(1)


def test_the_table_is_what_the_dockerfile_installs():
    assert _arg("TORCH_VERSION") == image_contents.TORCH
    assert _arg("FLASHINFER_VERSION") == image_contents.FLASHINFER
    from moe_kernels.backends import KERNEL_PACKAGES
    assert tuple(image_contents.KERNEL_PACKAGES) == tuple(KERNEL_PACKAGES)
    assert set(image_contents.bundled_packages("sm100")) == set(KERNEL_PACKAGES)


def test_the_operators_images_read_the_table():
    from moe_operator import images
    assert images.bundled_image_flashinfer(from_name("sm100")) == image_contents.FLASHINFER
    assert images.bundled_image_flashinfer(from_name("sm90")) is None
    assert images.bundled_image_packages(from_name("sm90")) == {"flashinfer-python": None, "triton": image_contents.TRITON}


def test_same_release_and_differences():
    assert image_contents.same_release("3.6", "3.6.0") and image_contents.same_release(None, None)
    assert not image_contents.same_release("3.6", "3.5.1") and not image_contents.same_release("3.6", None)
    assert image_contents.differences({"triton": "3.6", "flashinfer-python": None},
                                      {"triton": "3.5.1", "flashinfer-python": None}) == ["triton assumed 3.6, installed 3.5.1"]


def _res(family="sm90", fmt="fp8", backend="auto", explicit=False, installed=None, shared=0, deferred="auto"):
    return resolve_bundled(family=family, where=family, architecture="DeepseekV3ForCausalLM", checkpoint_format=fmt,
                           shared_experts=shared, installed=installed or image_contents.bundled_packages(family),
                           backend=backend, explicit=explicit, deferred=deferred)


def test_resolve_bundled_says_where_each_value_came_from():
    auto = _res()
    p = auto.provenance["moe.runnerBackend"]
    assert (p.value, p.explicit, p.source, p.candidates) == (auto.backend, False, "default", auto.backends)
    chosen = _res(backend=auto.backend, explicit=True).provenance["moe.runnerBackend"]
    assert (chosen.explicit, chosen.source, chosen.candidates) == (True, "moe.runnerBackend", [auto.backend])
    d = _res(deferred="off").provenance["moe.deferredFinalize"]
    assert (d.value, d.explicit, d.source) == ("false", True, "moe.deferredFinalize")
    assert _res().provenance["moe.deferredFinalize"].source == "default"


def test_a_plan_without_provenance_serialises_as_before():
    from moe_operator import planner
    info = CheckpointInfo(architecture="Qwen3MoeForCausalLM", format="fp8_block", formatSource="t", numExperts=8)
    p = planner.plan(info, from_name("NVIDIA-H200"), engine="sglang")
    assert not p.provenance and "provenance" not in p.model_dump() and '"image"' not in p.model_dump_json()


def _planned(info, gpu):
    """The planner's bundled plan with the provenance its engine records (engines/bundled/plan.py)."""
    from moe_operator import planner
    p = planner.plan(info, gpu)
    installed = image_contents.bundled_packages(gpu.family, gpu.is_rocm)
    r = resolve_bundled(family=gpu.family, where=gpu.family, architecture=info.architecture,
                        checkpoint_format=info.format, shared_experts=info.numSharedExperts or 0, installed=installed)
    image = PlanImage(packages={k: v for k, v in installed.items() if v is not None})  # as planner.plan writes it
    return p.model_copy(update={"provenance": r.provenance, "image": image}), installed


@pytest.mark.parametrize("product", sorted(p for p, v in PRODUCTS.items() if not v[1].startswith("gfx")))
@pytest.mark.parametrize("fmt", BUNDLED.checkpoint_formats)
@pytest.mark.parametrize("shared", [0, 1])
def test_the_pod_takes_the_plan_as_it_is_and_gets_what_re_resolving_gets(product, fmt, shared, monkeypatch):
    from moe_runtime import plan_check

    gpu = from_name(product)
    info = CheckpointInfo(architecture="DeepseekV3ForCausalLM", format=fmt, formatSource="t", numExperts=8,
                          numSharedExperts=shared)
    p, installed = _planned(info, gpu)
    assert not p.errors and p.provenance["moe.runnerBackend"].value == p.moe.runnerBackend
    again = plan_check.resolve(None, gpu.family, product, info, {}, installed)  # what re-resolving gives
    monkeypatch.setattr(plan_check, "resolve_bundled", lambda **k: pytest.fail("re-resolved though nothing differs"))
    got = plan_check.resolve(json.loads(p.model_dump_json()), gpu.family, product, info, {}, installed)
    assert (got.backends, got.explicit, got.deferred, got.expert_format) == \
        (again.backends, again.explicit, again.deferred, again.expert_format)
    assert got.reasons[0].startswith(f"[plan] MoE backend {p.moe.runnerBackend} as planned") and not got.warnings


def test_other_packages_are_re_resolved_with_a_warning_naming_them():
    from moe_runtime import plan_check

    gpu = from_name("NVIDIA-H200")
    info = CheckpointInfo(architecture="DeepseekV3ForCausalLM", format="fp8", formatSource="t", numExperts=8)
    p, installed = _planned(info, gpu)
    got = plan_check.resolve(p, gpu.family, "NVIDIA-H200", info, {}, {**installed, "triton": "3.7.0"})
    assert got.warnings == ["this image's kernel packages are not the ones the plan assumed (triton assumed 3.6, "
                            "installed 3.7.0): the MoE backend is re-resolved here"]
    assert got.backends[0] == p.moe.runnerBackend and not got.reasons[0].startswith("[plan]")
    # an image without Triton cannot run the planned backend: refused, saying why it was re-resolved
    with pytest.raises(plan_check.RuntimeFailure, match="triton assumed 3.6, installed absent"):
        plan_check.resolve(p, gpu.family, "NVIDIA-H200", info, {}, {**installed, "triton": None})


def test_explicit_travels_as_provenance_not_as_a_user_tagged_decision():
    from moe_runtime import plan_check

    gpu = from_name("NVIDIA-H200")
    info = CheckpointInfo(architecture="DeepseekV3ForCausalLM", format="fp8", formatSource="t", numExperts=8)
    p, installed = _planned(info, gpu)
    prov = p.provenance["moe.runnerBackend"].model_copy(update={"explicit": True, "candidates": [p.moe.runnerBackend],
                                                               "source": "moe.runnerBackend"})
    p = p.model_copy(update={"provenance": {**p.provenance, "moe.runnerBackend": prov}})
    assert not any(d.rule == "user" for d in p.decisions)
    got = plan_check.resolve(p, gpu.family, "NVIDIA-H200", info, {}, installed)
    assert got.explicit and got.backends == [p.moe.runnerBackend]
    # re-resolved (other packages), explicit still comes from the provenance
    got = plan_check.resolve(p, gpu.family, "NVIDIA-H200", info, {}, {**installed, "triton": "3.7.0"})
    assert got.explicit and got.warnings


def test_the_bundled_plan_carries_its_provenance_and_image():
    from moe_operator import planner
    gpu = from_name("NVIDIA-H200")
    info = CheckpointInfo(architecture="DeepseekV3ForCausalLM", format="fp8", formatSource="t", numExperts=8)
    p = planner.plan(info, gpu)
    assert p.image == PlanImage(packages={"triton": image_contents.TRITON})  # (no flashinfer in the sm90 image)
    assert p.provenance["moe.runnerBackend"].candidates[0] == p.moe.runnerBackend
    assert Plan.model_validate(json.loads(p.model_dump_json())) == p
