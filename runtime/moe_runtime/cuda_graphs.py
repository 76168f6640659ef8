"""CUDA graphs for the batched decode step.

At small batch a decode step is launch-bound (hundreds of small kernels per token), so the step is
captured once per batch-size bucket and replayed. Shapes must be static: the block tables have the
full width (max_len / block_size blocks), `kv_len = max_len` (the Triton decode kernels read each
row's own length from its position, on the device), and a batch smaller than its bucket is padded
with rows whose block table points only at a scratch block that no sequence owns.
"""

from __future__ import annotations

import torch

from .log import log

_BUCKETS = (1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512)


class GraphDecoder:
    def __init__(self, model, max_batch: int, max_len: int, table_width: int, scratch_block: int, device: str = "cuda"):
        self.model, self.max_len, self.width, self.scratch, self.device = model, max_len, table_width, scratch_block, device
        self.buckets = [b for b in _BUCKETS if b < max_batch] + [max_batch]
        self.graphs: dict[int, tuple] = {}
        self.pool = None

    def _capture(self, b: int) -> tuple:
        d = self.device
        ids = torch.zeros(b, 1, dtype=torch.long, device=d)
        pos = torch.zeros(b, 1, dtype=torch.long, device=d)
        bt = torch.full((b, self.width), self.scratch, dtype=torch.long, device=d)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up off the capture: JIT, allocator, cuBLAS workspaces
            for _ in range(2):
                self.model(ids, pos, bt, kv_len=self.max_len)
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            out = self.model(ids, pos, bt, kv_len=self.max_len)
        self.pool = g.pool()
        log("cuda_graph", f"captured decode step for batch {b}", batch=b)
        return g, ids, pos, bt, out

    def __call__(self, ids: torch.Tensor, pos: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        n = ids.shape[0]
        b = next(x for x in self.buckets if x >= n)
        if b not in self.graphs:
            self.graphs[b] = self._capture(b)
        g, sids, spos, sbt, out = self.graphs[b]
        sids[:n].copy_(ids)
        spos[:n].copy_(pos)
        sbt[:n].copy_(block_tables)
        if n < b:
            sids[n:].zero_()
            spos[n:].zero_()
            sbt[n:].fill_(self.scratch)
        g.replay()
        return out[:n]
