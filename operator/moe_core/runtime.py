"""The runtime capability table: what the bundled runtime (`moe-runtime serve`) can serve.

The planner never promises the bundled engine what this table does not list, and the runtime's
loader and plan check refuse from the same table, so the two cannot disagree.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from .formats import TABLE, expert_format


class RuntimeCapabilities(BaseModel):
    model_config = ConfigDict(frozen=True)

    # config.json architectures[0] -> the runtime's architecture folder (moe_runtime.models.<module>: its Arch)
    architectures: dict[str, str]
    # checkpoint formats (moe_core.formats) whose tensors the loader reads, for some architecture
    checkpoint_formats: tuple[str, ...]
    # architectures whose loader reads only some of checkpoint_formats (absent: all of them)
    arch_formats: dict[str, tuple[str, ...]] = {}
    # architectures whose experts are not plain SiLU-gated without biases: (activation, biased), as the
    # registry's backends declare them (BackendSpec.runs_experts); absent: ("silu", False)
    arch_experts: dict[str, tuple[str, bool]] = {}
    # architectures served on one GPU only (moe_runtime.dist has no shard rules for them; none today)
    single_rank: tuple[str, ...] = ()
    # parallelism inside one replica
    max_tp: int = 1
    max_dp: int = 1
    max_ep: int = 1
    max_nodes: int = 1
    max_gpus_per_node: int = 8  # one process per GPU of a node
    a2a_backends: tuple[str, ...] = ("none",)

    def formats_for(self, architecture: str) -> tuple[str, ...]:
        return self.arch_formats.get(architecture, self.checkpoint_formats)

    def experts_for(self, architecture: str) -> tuple[str, bool]:
        """(expert activation, whether the experts have GEMM biases) of `architecture`."""
        return self.arch_experts.get(architecture, ("silu", False))


# Kimi-K2 checkpoints declare DeepseekV3ForCausalLM (model_type kimi_k2), so they are served too.
BUNDLED = RuntimeCapabilities(
    architectures={"DeepseekV3ForCausalLM": "deepseek_v3", "Qwen3MoeForCausalLM": "qwen3_moe",
                   "GptOssForCausalLM": "gpt_oss"},
    # block-FP8 (weight_scale_inv per 128x128), ModelOpt NVFP4, OCP MXFP4 and bf16 tensor layouts;
    # per-tensor FP8 (modelopt_fp8, the FP8 layers of `mixed`), compressed-tensors names (ct_*) and
    # DeepSeek-V4 layouts are not read
    checkpoint_formats=("bf16", "fp8", "nvfp4", "mxfp4"),
    # gpt-oss: its release layout (MXFP4 experts as `*_blocks` / `*_scales`, everything else bf16) and
    # the bf16 one transformers writes (fused `experts.gate_up_proj`); no FP8/NVFP4 gpt-oss layouts.
    # Its experts have biases and the clamped SwiGLU ("swiglu_oai"): only backends that compute both are
    # candidates (Triton on CUDA; torch, which runs the model's own transformers-exact path). Sharded like the others (moe_runtime.dist.shard.ShardPlan, its Arch's rules): heads with their
    # q/k/v biases and sinks over tp (o_proj's bias added once), experts with their biases over ep,
    # the intermediate split inside the experts for the rest (MXFP4: whole 32-blocks of down's input).
    arch_formats={"GptOssForCausalLM": ("bf16", "mxfp4")},
    arch_experts={"GptOssForCausalLM": ("swiglu_oai", True)},
    # moe_runtime.dist: tensor parallel (attention heads, dense layers, vocab) and expert parallel
    # (E/ep experts per rank, TP inside experts for the rest), one process per GPU over NCCL, on one node
    # or on up to max_nodes nodes of a LeaderWorkerSet (the runtime's rendezvous reads LWS_LEADER_ADDRESS /
    # LWS_GROUP_SIZE / LWS_WORKER_INDEX; the operator renders the leader and worker pods). tp is the
    # replica's GPU count (the API's convention), ep divides it. The combine of the routed experts is the
    # runtime's own (moe_runtime.dist.combine: all-reduce, or all_to_all_single for large batches), not an
    # all-to-all backend of the engines (moe.a2aBackend none).
    max_tp=64,
    max_ep=64,
    max_nodes=8,
)

ELSEWHERE = "use engine sglang or vllm"


def architecture_problem(architecture: str, caps: RuntimeCapabilities = BUNDLED) -> str | None:
    if architecture in caps.architectures:
        return None
    unknown = " (spec.model.format skips the inspection: set spec.model.architecture as well)" \
        if architecture in ("", "Unknown") else ""
    return (f"[B8] the bundled runtime serves {', '.join(caps.architectures)}, not {architecture or 'an unknown'}"
            f" architecture{unknown}: {ELSEWHERE}")


def format_problem(checkpoint_format: str, caps: RuntimeCapabilities = BUNDLED,
                   architecture: str | None = None) -> str | None:
    """None when the loader reads `checkpoint_format` (for `architecture`, when given)."""
    loads = caps.formats_for(architecture) if architecture else caps.checkpoint_formats
    if checkpoint_format in loads:
        return None
    what = TABLE[checkpoint_format].what if checkpoint_format in TABLE else "unknown format"
    same = [f for f in loads if expert_format(f) == expert_format(checkpoint_format)
            and expert_format(checkpoint_format) is not None]
    instead = f"a checkpoint of the model in {' or '.join(same or loads)}"
    whose = f" {architecture}" if architecture in caps.arch_formats else ""
    return (f"[B0] the bundled runtime cannot load{whose} {checkpoint_format} checkpoints ({what}); its loader reads "
            f"{', '.join(loads)}{' for ' + architecture if whose else ''}: {ELSEWHERE}, or {instead}")


def parallelism_problems(tp: int = 1, dp: int = 1, ep: int = 1, a2a: str = "none", nodes: int = 1,
                         caps: RuntimeCapabilities = BUNDLED, architecture: str | None = None) -> list[str]:
    out = []
    if a2a not in caps.a2a_backends:
        out.append(f"[B5] the bundled runtime has no all-to-all backend (moe.a2aBackend={a2a}; its expert "
                   f"parallelism combines with its own all-reduce / all-to-all, moe_runtime.dist.combine: moe.a2aBackend none); {ELSEWHERE} for all-to-all dispatch")
    if architecture in caps.single_rank and max(tp, ep, nodes) > 1:
        out.append(f"[B6] the bundled runtime serves {architecture} on one GPU only (here tp={tp} ep={ep} "
                   f"nodes={nodes}); {ELSEWHERE} to shard it")
        return out
    if tp > caps.max_tp or dp > caps.max_dp or ep > caps.max_ep or nodes > caps.max_nodes:
        out.append(f"[B6] the bundled runtime serves tp <= {caps.max_tp}, ep <= {caps.max_ep}, dp <= {caps.max_dp} "
                   f"on at most {caps.max_nodes} node{'s' if caps.max_nodes > 1 else ''} per replica (here tp={tp} "
                   f"dp={dp} ep={ep} nodes={nodes}); {ELSEWHERE} for larger replicas")
    elif max(tp, ep) % min(tp, ep):
        out.append(f"[B6] the bundled runtime runs max(tp, ep) ranks and needs one of tp={tp}, ep={ep} to divide the other")
    elif max(tp, ep) % nodes or max(tp, ep) // nodes > caps.max_gpus_per_node:
        out.append(f"[B6] the bundled runtime runs max(tp, ep)={max(tp, ep)} ranks, one process per GPU, the same number "
                   f"on each of the {nodes} node(s) of a replica and at most {caps.max_gpus_per_node} per node")
    return out


def problems(architecture: str, checkpoint_format: str, *, tp: int = 1, dp: int = 1, ep: int = 1,
             a2a: str = "none", nodes: int = 1, caps: RuntimeCapabilities = BUNDLED) -> list[str]:
    """Everything in (architecture, format, parallelism) the bundled runtime cannot serve, with rule ids."""
    served = architecture in caps.architectures
    out = [p for p in (architecture_problem(architecture, caps),
                       format_problem(checkpoint_format, caps, architecture if served else None)) if p]
    return out + parallelism_problems(tp, dp, ep, a2a, nodes, caps, architecture)
