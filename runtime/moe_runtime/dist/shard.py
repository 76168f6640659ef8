"""The shard plan: which slice of each checkpoint tensor one rank of a tensor/expert-parallel group
reads (moe_runtime.dist's layout), and what the layout must divide. Headers only; `reads` reads them.
Each rule is the architecture's (Arch.shard_rule, Arch.shard_problems): the defaults here
(`default_rule`, `even_expert_split_problems`) are what the Hugging Face layout shares."""

from __future__ import annotations

from typing import Any

from .. import models
from ..errors import RuntimeFailure
from ..model_spec import num_experts
from .layout import Layout, split

BLOCK = {"fp8": 128, "nvfp4": 16, "mxfp4": 32, "bf16": 1}  # an expert format's scale block along K


class ShardPlan:
    """Which slice of each checkpoint tensor one rank reads: None = the whole tensor, "skip" = not on this
    rank, ("part", dim, parts, i) = part i of dimension dim, ("range", dim, start, stop) = those rows."""

    def __init__(self, cfg: dict[str, Any], expert_format: str, layout: Layout):
        self.cfg, self.fmt, self.lay = cfg, expert_format, layout
        self.E = num_experts(cfg)
        self.arch = models.arch_for(cfg)
        self.expert_lo, self.expert_hi = split(self.E, layout.ep, layout.ep_rank) if self.E else (0, 0)

    @property
    def local_experts(self) -> int:
        return self.expert_hi - self.expert_lo

    def problems(self) -> list[str]:
        """Headers-only: every size the layout must divide, named."""
        c, lay, out = self.cfg, self.lay, []
        if (p := lay.problem()):
            return [p]

        def need(what: str, n: int, parts: int, flag: str):
            if parts > 1 and n % parts:
                out.append(f"{what} {n} is not divisible by {flag} {parts}")

        need("num_attention_heads", c["num_attention_heads"], lay.tp, "--tp")
        need("vocab_size", c["vocab_size"], lay.tp, "--tp")
        nkv = c.get("num_key_value_heads") or c["num_attention_heads"]
        if "kv_lora_rank" not in c and lay.tp > 1 and nkv % lay.tp and lay.tp % nkv:
            out.append(f"num_key_value_heads {nkv} and --tp {lay.tp}: one must divide the other")
        need("intermediate_size (dense MLP)", self.arch.dense_intermediate(c), lay.world, "the world size")
        if c.get("n_shared_experts"):
            need("shared expert intermediate size", c["moe_intermediate_size"] * c["n_shared_experts"], lay.world,
                 "the world size")
        if self.E:
            need("number of routed experts", self.E, lay.ep, "--ep")
            out += self.arch.shard_problems(self)
        return out

    def block(self) -> int:
        return BLOCK[self.fmt]

    def even_expert_split_problems(self, key: str) -> list[str]:
        """TP inside the experts (etp > 1) in equal parts: each a whole number of the format's blocks."""
        lay, inter, group = self.lay, self.cfg[key], self.block()
        if lay.etp > 1 and inter % (lay.etp * group):
            return [f"{key} {inter} split {lay.etp} ways inside the experts (world {lay.world} / "
                    f"--ep {lay.ep}) leaves slices that are not whole {self.fmt} blocks of {group}; "
                    f"use --ep {lay.world} (whole experts per rank)"]
        return []

    def rule(self, name: str):
        """None = the whole tensor, "skip", ("part", dim, parts, i), ("range", dim, start, stop) or
        ("all", rule, ...) (several dimensions at once): the architecture's rule (Arch.shard_rule)."""
        return self.arch.shard_rule(self, name)

    def default_rule(self, name: str):
        lay = self.lay
        parts = name.split(".")
        leaf = parts[-1]
        if name in ("model.embed_tokens.weight", "lm_head.weight"):
            return self._dim_rule(name, 0, lay.tp, lay.tp_rank)
        if ".self_attn." in name:
            proj = parts[-2]
            if leaf == "sinks":  # attention sinks: one logit per query head, split with the heads
                return self._dim_rule(name, 0, lay.tp, lay.tp_rank)
            if leaf == "bias" and proj == "o_proj":
                return None  # replicated; the model adds it once (dist.layers.RowParallelLinear's bias)
            if leaf not in ("weight", "weight_scale_inv", "bias"):  # q/k/v biases follow their weight's rows
                return None
            c = self.cfg
            if proj in ("q_proj", "q_b_proj", "kv_b_proj"):
                return self._dim_rule(name, 0, lay.tp, lay.tp_rank)
            if proj in ("k_proj", "v_proj"):
                nkv, hd = c.get("num_key_value_heads") or c["num_attention_heads"], self._head_dim()
                if lay.tp == 1:
                    return None
                if nkv % lay.tp == 0:
                    return self._dim_rule(name, 0, lay.tp, lay.tp_rank)
                # fewer KV heads than ranks: each rank reads the one its query heads share
                first = lay.tp_rank * nkv // lay.tp
                return ("range", 0, first * hd, (first + 1) * hd)
            if proj == "o_proj":
                return self._dim_rule(name, 1, lay.tp, lay.tp_rank)
            return None  # q_a_proj, kv_a_proj_with_mqa, norms: replicated
        if ".mlp.experts." in name:
            tag = parts[parts.index("experts") + 1]
            if not tag.isdigit():  # fused layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
                if lay.etp > 1:
                    raise RuntimeFailure(f"{name}: fused expert tensors are split by whole experts only; "
                                         f"use --ep {lay.world}")
                return None if lay.ep == 1 else ("range", 0, self.expert_lo, self.expert_hi)
            e = int(tag)
            if not self.expert_lo <= e < self.expert_hi:
                return "skip"
            if leaf in ("weight_scale_2", "input_scale"):
                return None
            proj = parts[-2]
            return self._dim_rule(name, 1 if proj == "down_proj" else 0, lay.etp, lay.etp_rank, full=True)
        if ".mlp." in name and parts[-2] in ("gate_proj", "up_proj", "down_proj"):
            if leaf not in ("weight", "weight_scale_inv"):
                return None
            return self._dim_rule(name, 1 if parts[-2] == "down_proj" else 0, lay.world, lay.rank)
        return None

    def _head_dim(self) -> int:
        c = self.cfg
        return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]

    def _dim_rule(self, name: str, dim: int, parts: int, i: int, full: bool = False):
        """("part", dim, parts, i): part i of `parts` equal parts of the tensor's own dimension `dim` (for a
        packed or block-scaled tensor that is the matching part of its logical dimension)."""
        if parts == 1:
            return None
        return ("part", dim, parts, i)
