"""One accepted-value list per engine (engines/<engine>/vocab.py): the CRD enum (api.py), the selection rows
(planner / engines/<engine>/plan) and the start-up rows (engine_rules/) all use it, so they cannot disagree."""

from __future__ import annotations

import typing

from moe_operator import api, planner
from moe_operator.engine_rules import recorded
from moe_operator.engines.sglang import startup as sg_rules
from moe_operator.engines import vocabulary
from moe_operator.engines.bundled import vocab as bundled
from moe_operator.engines.sglang import vocab as sglang
from moe_operator.engines.vllm import vocab as vllm


def _recorded(engine: str, key: str) -> set[str]:
    return {x for r in recorded.releases(engine).values() for x in r[key]["values"]}


def test_crd_enum_is_the_vocabulary():
    fields = api.MoESpec.model_fields
    assert typing.get_args(fields["runnerBackend"].annotation) == vocabulary.ALL_RUNNERS
    assert typing.get_args(fields["a2aBackend"].annotation) == vocabulary.ALL_A2A
    assert set(vocabulary.ALL_RUNNERS) == set(sglang.RUNNERS) | set(vllm.MOE_BACKENDS) | set(bundled.RUNNERS)
    assert set(typing.get_args(api.EngineSpec.model_fields["name"].annotation)) == set(vocabulary.ENGINES)


def test_vocabulary_is_what_the_releases_read_accept():
    # sglang: every --moe-runner-backend / --moe-a2a-backend value of every release read, and nothing else
    assert set(sglang.RUNNERS) == _recorded("sglang", "runner_choices")
    assert set(sglang.A2A) == _recorded("sglang", "a2a_choices")
    # vLLM: every --moe-backend of every release read, plus the two values the legacy env translates to (W7)
    assert set(vllm.MOE_BACKENDS) - _recorded("vllm", "runner_choices") == {"flashinfer_trtllm_afp8",
                                                                             "flashinfer_cutlass_afp8"}
    assert _recorded("vllm", "runner_choices") <= set(vllm.MOE_BACKENDS)  # the CRD enum lacks none of them
    # --all2all-backend: every value of every release read, and nothing else
    assert set(vllm.A2A) == _recorded("vllm", "a2a_choices")


def test_the_crd_a2a_enum_has_every_value_an_engine_release_read_accepts():
    # vLLM 0.33.0's All2AllBackend values the enum once lacked (it listed only five of vLLM's own)
    for a2a in ("nixl_ep", "flashinfer_nvlink_two_sided", "flashinfer_nvlink_one_sided", "mori_high_throughput",
                "mori_low_latency", "moonep"):
        assert a2a in recorded.release("vllm", "0.33.0")["a2a_choices"]["values"]
        assert a2a in typing.get_args(api.MoESpec.model_fields["a2aBackend"].annotation)
    assert set(vocabulary.ALL_A2A) == _recorded("sglang", "a2a_choices") | _recorded("vllm", "a2a_choices")


def test_selection_and_start_up_rows_use_the_same_lists():
    # the planner's names are the vocab's objects, not copies
    assert planner.SGLANG_RUNNERS is sglang.RUNNERS and planner.VLLM_MOE_BACKENDS is vllm.MOE_BACKENDS
    assert planner.DEEPSEEK_FAMILY is sglang.DEEPSEEK_FAMILY is sg_rules._DEEPSEEK_FAMILY_ARCHS
    assert planner.QWEN3_FAMILY is sglang.QWEN3_FAMILY is sg_rules._QWEN3_FAMILY_ARCHS
    # every value a selection row can pick literally is one the engine accepts
    for row in planner.SGLANG_SELECT:
        if isinstance(row.value, str):
            assert row.value in sglang.RUNNERS, row.id
    for row in planner.VLLM_SELECT:
        if isinstance(row.value, str):
            assert row.value in vllm.MOE_BACKENDS or row.value == "env", row.id
