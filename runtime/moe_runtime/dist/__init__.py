"""Tensor and expert parallelism of the bundled runtime over torch.distributed (NCCL on GPUs, gloo on CPU).

One module per job: `layout` (the rank arithmetic, pure), `shard` (which slice of each checkpoint
tensor a rank reads: the shard plan, rules asked of the architecture), `reads` (reading those slices),
`group` (the process group and its reductions), `layers` (the parallel layers the models build on,
each given the group), `combine` (the MoE combine: all-reduce or all-to-all), `leader` (rank 0
mirrors every model call to the followers) and `launch` (one process per local rank, rendezvous).

Layout (the API's convention: `parallelism.tp` GPUs per replica, `ep` divides it; `--tp 1 --ep M`
is accepted too): world W = max(tp, ep), the larger a multiple of the smaller. Rank r:
- attention: tensor parallel over the `tp` consecutive ranks of r's attention group (heads split;
  replicated across the W/tp groups when tp < W); one all-reduce (attention group) after o_proj.
- vocab-parallel embedding (masked lookup + all-reduce) and LM head (local vocab slice, all-gather),
  over the attention group.
- dense MLP and the shared expert: intermediate split over all W ranks (column-parallel gate/up,
  row-parallel down); the dense MLP all-reduces over the world; the shared expert's partial output
  goes into the MoE block's one all-reduce.
- routed experts: ep groups of etp = W/ep ranks; r holds experts [ep_rank*E/ep, (ep_rank+1)*E/ep)
  with their intermediate split etp ways (TP inside experts). Activations are replicated on every
  rank after the attention all-reduce, so dispatch is the all-gather of the degenerate kind (each
  rank already has every token); a rank runs its experts on the pairs routed to them (other ids become
  -1, which the experts backends and the deferred finalize skip) and the combine of (routed partial +
  shared partial) over the world is `combine`'s: one fp32 all-reduce for small batches, or
  all_to_all_single of the rows to the tokens' owners + all_gather_into_tensor for large ones.

All reductions run in fp32 (the bf16 partials summed once in fp32, then rounded). No module keeps
the group in a global: the models are built with it (`group`, None for one process).
"""
