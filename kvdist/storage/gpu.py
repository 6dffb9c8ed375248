"""The GPU tier: one block-major tensor per rank on ``cache.device``."""

from __future__ import annotations

import torch

from ..dtypes import torch_dtype
from ..layout import KVLayout

__all__ = ["GpuPool"]


class GpuPool:
    """``num_blocks`` blocks of ``layout.bytes_per_block`` bytes, block-major:
    ``data[block, layer, k|v, token, head, dim]``. ``raw`` is the same memory as
    ``[block, bytes]`` uint8, the view every tier copy uses."""

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device):
        self.layout = layout
        self.num_blocks = num_blocks
        self.device = device
        self.data = torch.zeros((num_blocks, *layout.block_shape()),
                                dtype=torch_dtype(layout.dtype), device=device)
        self.raw = self.data.view(torch.uint8).view(num_blocks, layout.bytes_per_block)

    def kv_pool(self, layer: int) -> torch.Tensor:
        """``[num_blocks, 2, tokens_per_block, kv_heads, head_dim]`` view of one layer."""
        if not 0 <= layer < self.layout.num_layers:
            raise IndexError(f"layer {layer} outside 0..{self.layout.num_layers - 1}")
        return self.data[:, layer]

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def close(self) -> None:
        self.data = self.raw = None
