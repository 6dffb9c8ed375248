"""The host tier: ``num_blocks`` blocks in (pinned, when CUDA exists) host memory."""

from __future__ import annotations

import torch

from ..errors import HostTierUnavailable
from ..layout import KVLayout


class HostPool:
    """``raw[block, bytes]`` uint8 host memory. Pinned when ``pin`` so that copies to
    and from the GPU are asynchronous DMA."""

    def __init__(self, layout: KVLayout, num_blocks: int, pin: bool):
        self.layout = layout
        self.num_blocks = num_blocks
        self.pinned = pin
        nbytes = num_blocks * layout.bytes_per_block
        try:
            self.raw = torch.empty((num_blocks, layout.bytes_per_block), dtype=torch.uint8,
                                   pin_memory=pin)
        except (RuntimeError, MemoryError) as e:
            raise HostTierUnavailable(
                f"cannot allocate a {'pinned ' if pin else ''}host tier of {nbytes} bytes: {e}"
            ) from e

    @property
    def nbytes(self) -> int:
        return self.raw.numel()

    def close(self) -> None:
        self.raw = None
