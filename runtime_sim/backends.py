"""Backends the engine runs on. Each keeps the pool tensors and runs one step of the graph.

- TorchBackend: the compiled PagedModel in eager PyTorch (the reference).
"""

from __future__ import annotations

import numpy as np
import torch

from toolkit.compiler import PagedModel


class TorchBackend:
    name = "torch"

    def __init__(self, paged: PagedModel):
        self.paged = paged
        self.layout = paged.layout

    def forward(self, ids, positions, seq_ids, tables) -> np.ndarray:
        with torch.no_grad():
            logits = self.paged(
                torch.from_numpy(ids)[None],
                torch.from_numpy(positions),
                torch.from_numpy(seq_ids),
                torch.from_numpy(tables),
            )
        return logits[0].float().numpy()

    def copy_block(self, src: int, dst: int) -> None:
        for codes, scales, _ in self.paged.pool_tensors():
            codes[dst] = codes[src]
            if scales.shape[0] > 1:
                scales[dst] = scales[src]

    def copy_stage(self, src_seq: int, dst_seq: int) -> None:
        for _, _, stage in self.paged.pool_tensors():
            if stage.shape[0] > 1:
                stage[dst_seq] = stage[src_seq]
