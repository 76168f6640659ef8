"""Invariants of triton_align.align_mixed, shared by the CPU interpreter test and the GPU test."""

import torch


def check_pair_order(perm: torch.Tensor, ids: torch.Tensor, num_experts: int) -> None:
    """Rows of each expert increase with the pair index (deterministic scatter, no atomics)."""
    flat = ids.flatten().long()
    valid = (flat >= 0) & (flat < num_experts)
    idx = torch.arange(flat.numel(), device=flat.device)[valid]
    key = flat[valid] * (flat.numel() + 1) + idx       # pairs sorted by (expert, pair index)
    rows = perm.long()[valid][torch.argsort(key)]
    same = flat[valid][torch.argsort(key)]
    step = rows[1:] - rows[:-1]
    assert bool(((step > 0) | (same[1:] != same[:-1])).all()), "rows of an expert follow pair order"


def check_rows(al, ids: torch.Tensor, num_experts: int):
    """What every two-part alignment (MixedAlignment) must give: a row per pair of this rank, in pair
    order per expert, sorted_ids inverting perm, padding rows marked. Returns (rows, experts, counts)."""
    flat = ids.flatten().long()
    dev = flat.device
    n = flat.numel()
    valid = (flat >= 0) & (flat < num_experts)
    perm = al.perm.long()
    assert torch.equal(perm >= 0, valid), "perm is -1 exactly for other ranks' experts"
    rows, experts = perm[valid], flat[valid]
    assert rows.unique().numel() == rows.numel(), "each pair has its own row"
    check_pair_order(al.perm, ids, num_experts)
    sorted_ids = al.big.sorted_ids.long()
    assert torch.equal(sorted_ids[rows], torch.arange(n, device=dev)[valid]), "sorted_ids inverts perm"
    pad = torch.ones(al.p_max, dtype=torch.bool, device=dev)
    pad[rows] = False
    assert (sorted_ids[pad] == n).all(), "padding rows hold num_pairs"
    return rows, experts, torch.bincount(experts, minlength=num_experts)


def check_mixed(mixed, ids: torch.Tensor, num_experts: int, small_m: int = 8, big_m: int = 16) -> None:
    rows, experts, counts = check_rows(mixed, ids, num_experts)
    big = counts > small_m
    end_big, start_big = mixed.big.num_post_pad.tolist()
    end_small, start_small = mixed.small.num_post_pad.tolist()
    assert start_big == 0 and start_small == end_big
    assert end_big == int(((counts + big_m - 1) // big_m * big_m)[big].sum())
    assert end_small - start_small == small_m * int(((counts > 0) & ~big).sum())
    assert end_small <= mixed.p_max
    in_big = rows < end_big
    assert torch.equal(in_big, big[experts]), "experts with > small_m rows (only) are in big blocks"
    assert torch.equal(mixed.big.expert_ids[rows[in_big] // big_m].long(), experts[in_big])
    assert torch.equal(mixed.small.expert_ids[(rows[~in_big] - start_small) // small_m].long(), experts[~in_big])


def check_split(split, ids: torch.Tensor, num_experts: int, big_m: int, tail_max: int, tail_m: int = 16) -> None:
    """Invariants of triton_align.align_split: every expert's full big_m-row blocks first, a remainder
    of <= tail_max rows in tail_m-row blocks after all big blocks (more: one more big block)."""
    rows, experts, counts = check_rows(split, ids, num_experts)
    full, rest = counts // big_m, counts % big_m
    over = rest > tail_max
    end_big, start_big = split.big.num_post_pad.tolist()
    end_tail, start_tail = split.small.num_post_pad.tolist()
    assert start_big == 0 and start_tail == end_big
    assert end_big == big_m * int((full + over.long()).sum())
    assert end_tail - start_tail == tail_m * int(torch.where(over, 0, (rest + tail_m - 1) // tail_m).sum())
    assert end_tail <= split.p_max
    in_big = rows < end_big
    # rows of an expert in big blocks: all of them if over, else exactly its full blocks' worth
    n_big = torch.bincount(experts[in_big], minlength=num_experts)
    assert torch.equal(n_big, torch.where(over, counts, full * big_m)), "big blocks hold the full blocks' rows"
    assert torch.equal(split.big.expert_ids[rows[in_big] // big_m].long(), experts[in_big])
    assert torch.equal(split.small.expert_ids[(rows[~in_big] - start_tail) // tail_m].long(), experts[~in_big])
