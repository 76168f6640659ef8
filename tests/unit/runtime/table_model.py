"""A stand-in model for the HTTP/engine tests: logits(next | last token t) = table[t], so a request's
tokens are a pure function of its prompt and sampling (no weights, no attention, milliseconds)."""

import torch


class TableModel:
    def __init__(self, vocab: int, seed: int = 0, scale: float = 3.0):
        self.cfg = {"vocab_size": vocab}
        self.table = torch.randn(vocab, vocab, generator=torch.Generator().manual_seed(seed)) * scale

    def kv_bytes_per_block(self, block_size):
        return block_size

    def allocate_kv(self, num_blocks, block_size):
        pass

    def __call__(self, ids, pos, block_tables, last_index=None, kv_len=None):
        if last_index is not None:
            ids = ids[torch.arange(ids.shape[0]), last_index][:, None]
        return self.table[ids]
