"""The GPU tier of ``cache.gpu: external``: the engine's paged KV tensors, one per
layer, registered with their layout. kvdist allocates nothing here and evicts nothing:
the engine owns the blocks and its own prefix cache; kvdist only copies whole blocks
between these tensors and its host and disk tiers, addressing a block by the engine's
block id.

A layer's tensor is vLLM's FlashAttention layout, ``[2, num_blocks, block_size,
num_kv_heads, head_size]`` (``kv_dim=0``; ``kv_dim=1`` is FlashInfer's ``[num_blocks,
2, ...]``), in any stride order whose trailing ``[block_size, heads, head_size]`` part of
one block is dense: vLLM's NHD (identity) and HND (``(0, 1, 3, 2, 4)``) orders, and
per-layer views of its cross-layer ``[num_blocks, num_layers, 2, ...]`` allocation,
all qualify. One layer's K (or V) of one block is then one contiguous *piece* of
``KVLayout.piece_bytes``, and a kvdist block is the block's ``2 * num_layers`` pieces
in order (``KVLayout.piece_offset``): the bytes are copied as the engine lays them out,
so a block goes back into any engine block of the same layout unchanged."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..dtypes import torch_dtype
from ..errors import ConfigError
from ..layout import KVLayout

__all__ = ["ExternalGpuTier"]


def _dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether dims of these sizes and strides (elements) cover one dense range."""
    want = 1
    for stride, size in sorted((st, sz) for sz, st in zip(sizes, strides) if sz > 1):
        if stride != want:
            return False
        want *= size
    return True


class ExternalGpuTier:
    """The engine's KV tensors as kvdist's GPU tier (see the module docstring).
    ``pieces(layer)`` is a ``[2, num_blocks, piece_bytes]`` uint8 view of a layer;
    ``piece_pointers`` the device addresses of blocks' pieces (batched copies)."""

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None,
                 *, kv_dim: int = 0):
        assert kv_dim in (0, 1), f"kv_dim is 0 (FlashAttention) or 1 (FlashInfer), got {kv_dim}"
        names = list(names) if names is not None else [f"layer {i}" for i in range(len(tensors))]
        if len(tensors) != layout.num_layers:
            raise ConfigError("model.num_layers", layout.num_layers,
                              f"the engine registered {len(tensors)} KV tensors")
        self.layout = layout
        self.kv_dim = kv_dim
        dtype = torch_dtype(layout.dtype)
        first = tensors[0]
        self.device: torch.device = first.device
        self.num_blocks = int(first.shape[1 - kv_dim]) if first.dim() == 5 else 0
        want = [layout.tokens_per_block, layout.num_kv_heads, layout.head_dim]
        piece = layout.piece_bytes
        item = layout.itemsize
        views, ptrs, kv_strides, block_strides = [], [], [], []
        for name, t in zip(names, tensors):
            shape = list(t.shape)
            expect = [2, self.num_blocks] if kv_dim == 0 else [self.num_blocks, 2]
            if t.dim() != 5 or shape[:2] != expect or shape[2:] != want:
                raise ConfigError(f"kv_caches[{name}]", tuple(shape),
                                  f"expected {tuple(expect + want)} (model and cache.tokens_per_block)")
            if t.dtype != dtype:
                raise ConfigError(f"kv_caches[{name}]", str(t.dtype).removeprefix("torch."),
                                  f"model.dtype is {layout.dtype}")
            if t.device != self.device:
                raise ConfigError(f"kv_caches[{name}]", str(t.device),
                                  f"the other layers are on {self.device}")
            if not _dense(shape[2:], t.stride()[2:]):
                raise ConfigError(f"kv_caches[{name}]", tuple(t.stride()),
                                  "a block's [block_size, heads, head_size] is not dense in these strides")
            kv_stride, block_stride = t.stride(kv_dim) * item, t.stride(1 - kv_dim) * item
            base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
            views.append(base.as_strided((2, self.num_blocks, piece), (kv_stride, block_stride, 1),
                                         t.storage_offset() * item))
            ptrs.append(t.data_ptr())
            kv_strides.append(kv_stride)
            block_strides.append(block_stride)
        self._views = views
        self._ptrs = np.array(ptrs, dtype=np.int64)
        self._kv_stride = np.array(kv_strides, dtype=np.int64)
        self._block_stride = np.array(block_strides, dtype=np.int64)

    @property
    def nbytes(self) -> int:
        """Bytes of the engine's blocks this tier addresses (kvdist allocated none)."""
        return self.num_blocks * self.layout.bytes_per_block

    def pieces(self, layer: int) -> torch.Tensor:
        """``[2, num_blocks, piece_bytes]`` uint8 view of ``layer``: K at 0, V at 1."""
        return self._views[layer]

    def piece_pointers(self, blocks: np.ndarray, layers: range) -> np.ndarray:
        """Device addresses ``[len(blocks), len(layers), 2]`` (uint64) of the K and V
        pieces of ``layers`` of each engine block, in kvdist's block order."""
        b = np.asarray(blocks, dtype=np.int64)[:, None, None]
        sl = slice(layers.start, layers.stop)
        kv = np.arange(2, dtype=np.int64)[None, None, :]
        out = (self._ptrs[sl][None, :, None] + kv * self._kv_stride[sl][None, :, None]
               + b * self._block_stride[sl][None, :, None])
        return out.astype(np.uint64)

    def close(self) -> None:
        """Forget the engine's tensors (the engine frees them)."""
        self._views = []
