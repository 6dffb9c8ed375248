"""The GPU tier of ``cache.gpu: external``: the engine's paged KV tensors, one per
layer, registered with their layout. kvdist allocates nothing here and evicts nothing:
the engine owns the blocks and its own prefix cache; kvdist only copies whole blocks
between these tensors and its host and disk tiers, addressing a block by the engine's
block id.

Two shapes of a layer's tensor are understood, in any stride order in which one
block's part is dense (its bytes one contiguous run):

* vLLM 0.33's view, 4-D ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (K and
  V side by side in the last dim; ``vllm/v1/kv_cache_interface.py``): physical orders
  LBNHC (FlashAttention's and FlashInfer's default), LBHNC (HND), and the block-outermost
  BL.. ones. A block of a layer is one piece.
* the older 5-D ``[2, num_blocks, block_size, num_kv_heads, head_size]``
  (FlashAttention's ``get_kv_cache_shape`` before 0.33; ``kv_dim=1``: FlashInfer's
  ``[num_blocks, 2, ...]``), NHD or HND strides: K and V of a block are two pieces (one,
  when they are adjacent).

A kvdist block is the engine block's pieces in order (``KVLayout.engine_pieces``), the
bytes as the engine lays them out: a block goes back into any engine block of the same
deployment unchanged."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from ..dtypes import torch_dtype
from ..errors import ConfigError
from ..layout import EnginePieces, KVLayout
from . import kernels

__all__ = ["ExternalGpuTier"]


def _dense(sizes: Sequence[int], strides: Sequence[int]) -> bool:
    """Whether dims of these sizes and strides (elements) cover one dense range."""
    want = 1
    for stride, size in sorted((st, sz) for sz, st in zip(sizes, strides) if sz > 1):
        if stride != want:
            return False
        want *= size
    return True


def _wide(t: torch.Tensor) -> torch.Tensor:
    """A uint8 view's bytes as 8-byte elements where its strides allow (every piece a
    multiple of 8 bytes at an 8-byte boundary): the indexing kernels of ``gather`` and
    ``scatter`` then move a word, not a byte, a thread."""
    if t.shape[-1] % 8 or t.stride(-1) != 1 or t.storage_offset() % 8 or \
            any(s % 8 for s in t.stride()[:-1]):
        return t
    return t.view(torch.int64)


class ExternalGpuTier:
    """The engine's KV tensors as kvdist's GPU tier (see the module docstring).
    ``pieces(layer)`` is a ``[per_layer, num_blocks, piece_bytes]`` uint8 view of a
    layer; ``piece_pointers`` the addresses of blocks' pieces (batched copies)."""

    def __init__(self, layout: KVLayout, tensors: Sequence[torch.Tensor], names: Sequence[str] | None = None,
                 *, kv_dim: int = 0, one_kernel: bool = True):
        assert kv_dim in (0, 1), f"kv_dim is 0 (FlashAttention) or 1 (FlashInfer), got {kv_dim}"
        names = list(names) if names is not None else [f"layer {i}" for i in range(len(tensors))]
        if len(tensors) != layout.num_layers:
            raise ConfigError("model.num_layers", layout.num_layers,
                              f"the engine registered {len(tensors)} KV tensors")
        self.layout = layout
        first = tensors[0]
        self.device: torch.device = first.device
        joint = first.dim() == 4
        ndim = first.dim()
        self.num_blocks = int(first.shape[0] if joint else first.shape[1 - kv_dim]) if ndim in (4, 5) else 0
        t_, h_, d_ = layout.tokens_per_block, layout.num_kv_heads, layout.head_dim
        if joint:
            expect = (self.num_blocks, h_, t_, 2 * d_)
        else:
            expect = (2, self.num_blocks, t_, h_, d_) if kv_dim == 0 else (self.num_blocks, 2, t_, h_, d_)
        item, dtype = layout.itemsize, torch_dtype(layout.dtype)
        per_layer = 1 if joint else 2
        views, ptrs, piece_strides, block_strides = [], [], [], []
        for name, t in zip(names, tensors):
            key = f"kv_caches[{name}]"
            if tuple(t.shape) != expect:
                raise ConfigError(key, tuple(t.shape),
                                  f"expected {expect} (model and cache.tokens_per_block)")
            if t.dtype != dtype:
                raise ConfigError(key, str(t.dtype).removeprefix("torch."), f"model.dtype is {layout.dtype}")
            if t.device != self.device:
                raise ConfigError(key, str(t.device), f"the other layers are on {self.device}")
            inner = (1, 2, 3) if joint else (2, 3, 4)
            if not _dense([t.shape[i] for i in inner], [t.stride(i) for i in inner]):
                raise ConfigError(key, tuple(t.stride()),
                                  "one block of the layer is not dense in these strides")
            block_stride = t.stride(0 if joint else 1 - kv_dim) * item
            piece_stride = 0 if joint else t.stride(kv_dim) * item
            if not joint and piece_stride == layout.bytes_per_layer // 2:
                per_layer, piece_stride = 1, 0  # K then V, adjacent: one piece
            views.append((t, block_stride, piece_stride))
            ptrs.append(t.data_ptr())
            piece_strides.append(piece_stride)
            block_strides.append(block_stride)
        if len({s == 0 for s in piece_strides}) > 1:
            raise ConfigError("kv_caches", "mixed", "some layers keep K and V apart and others not")
        self.pieces_of: EnginePieces = layout.engine_pieces(per_layer)
        piece = self.pieces_of.piece_bytes
        self._views = [self._bytes(t, (per_layer, self.num_blocks, piece), (ps or piece, bs, 1))
                       for t, bs, ps in views]
        self._ptrs = np.array(ptrs, dtype=np.int64)
        self._piece_stride = np.array(piece_strides, dtype=np.int64)
        self._block_stride = np.array(block_strides, dtype=np.int64)
        self._stacked = self._stack(tensors)
        self.rows: torch.Tensor | None = self._whole_rows(tensors)
        # Layers in allocations of their own, on CUDA: one kernel moves every layer of a
        # group between staged rows and the engine's blocks (``kernels``); else torch's
        # indexing, a kernel a layer.
        words = piece % 8 == 0 and not any(x % 8 for x in ptrs + block_strides + piece_strides)
        self._table = (kernels.LayerTable(ptrs, block_strides, piece_strides, piece, per_layer, self.device)
                       if one_kernel and words and self._stacked is None and kernels.available(self.device)
                       else None)

    def _whole_rows(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """``[num_blocks, bytes_per_block]`` uint8 rows when every block's pieces of every
        layer are one contiguous run in kvdist's order (vLLM's cross-layer, block-outermost
        layouts, BL..): a block then moves as kvdist's own GPU tier's do, whole."""
        p, bpb = self.pieces_of, self.layout.bytes_per_block
        if self._stacked is None or int(self._block_stride[0]) != bpb:
            return None
        layer_step = int(self._ptrs[1] - self._ptrs[0]) if len(tensors) > 1 else p.per_layer * p.piece_bytes
        if layer_step != p.per_layer * p.piece_bytes or int(self._piece_stride[0]) not in (0, p.piece_bytes):
            return None
        return self._bytes(tensors[0], (self.num_blocks, bpb), (bpb, 1))

    def _stack(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor | None:
        """All layers as one ``[layer, per_layer, num_blocks, piece]`` view when they lie
        in one allocation at a constant distance with equal strides (vLLM's views of one
        buffer): a block's every layer then moves in one kernel."""
        n = len(tensors)
        storage = tensors[0].untyped_storage().data_ptr()
        if any(t.untyped_storage().data_ptr() != storage for t in tensors) or \
                len(set(self._block_stride.tolist())) != 1 or len(set(self._piece_stride.tolist())) != 1:
            return None
        step = int(self._ptrs[1] - self._ptrs[0]) if n > 1 else 0
        if n > 1 and (step <= 0 or (np.diff(self._ptrs) != step).any()):
            return None
        p = self.pieces_of
        return self._bytes(tensors[0], (n, p.per_layer, self.num_blocks, p.piece_bytes),
                           (step, int(self._piece_stride[0]) or p.piece_bytes, int(self._block_stride[0]), 1))

    def rows_view(self, rows: torch.Tensor) -> torch.Tensor:
        """kvdist block rows ``[n, bytes_per_block]`` seen as ``[n, layer, piece, bytes]``."""
        p = self.pieces_of
        return rows.view(rows.shape[0], p.num_layers, p.per_layer, p.piece_bytes)

    def _rows(self, rows: torch.Tensor, layers: range, packed: bool) -> tuple[torch.Tensor, int]:
        """``rows`` as ``[n, layer, piece, bytes]`` and the layer its dim 1 starts at:
        whole blocks, or (``packed``) rows holding ``layers``' bytes alone."""
        if not packed:
            return self.rows_view(rows), 0
        p = self.pieces_of
        return rows.view(rows.shape[0], len(layers), p.per_layer, p.piece_bytes), layers.start

    def gather(self, blocks: torch.Tensor, rows: torch.Tensor, layers: range, at: torch.Tensor,
               packed: bool = False) -> None:
        """``rows[at[i]]``'s ``layers`` (kvdist block bytes; ``packed``: rows of those
        layers' bytes alone) <- the pieces of engine block ``blocks[i]`` (index tensors on
        the rows' device; one kernel a layer, or one in all when the layers are stacked)."""
        view, off = self._rows(rows, layers, packed)
        out = _wide(view)
        if self._stacked is not None:
            a, b = layers.start, layers.stop
            out[at, a - off:b - off] = _wide(self._stacked[a:b])[:, :, blocks].permute(2, 0, 1, 3)
            return
        for layer in layers:
            out[at, layer - off] = _wide(self._views[layer])[:, blocks].transpose(0, 1)

    def scatter(self, rows: torch.Tensor, blocks: torch.Tensor, layers: range, packed: bool = False) -> None:
        """The pieces of ``layers`` of engine block ``blocks[i]`` <- ``rows[i]`` (``packed``:
        rows of those layers' bytes alone)."""
        if self._table is not None and rows.is_contiguous() and rows.device == self.device:
            kernels.move_pieces(self._table, rows, blocks, layers, to_engine=True,
                                row_layer0=layers.start if packed else 0)
            return
        view, off = self._rows(rows, layers, packed)
        src = _wide(view)
        if self._stacked is not None:
            a, b = layers.start, layers.stop
            _wide(self._stacked[a:b])[:, :, blocks] = src[:, a - off:b - off].permute(1, 2, 0, 3)
            return
        for layer in layers:
            _wide(self._views[layer])[:, blocks] = src[:, layer - off].transpose(0, 1)

    @property
    def one_kernel(self) -> bool:
        """Whether ``scatter`` and ``stage_out`` move a layer group in one kernel."""
        return self._stacked is not None or self._table is not None

    def stage_out(self, blocks: torch.Tensor, rows: torch.Tensor, layers: range,
                  packed: bool = False) -> None:
        """``rows[i]``'s ``layers`` <- the pieces of engine block ``blocks[i]`` (rows on
        the engine's device, contiguous: the staged path's buffer; ``packed``: rows of
        those layers' bytes alone)."""
        if self._table is not None:
            kernels.move_pieces(self._table, rows, blocks, layers, to_engine=False,
                                row_layer0=layers.start if packed else 0)
        else:
            self.gather(blocks, rows, layers, at=torch.arange(len(blocks), device=rows.device), packed=packed)

    @staticmethod
    def _bytes(t: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...]) -> torch.Tensor:
        """A uint8 view of ``t``'s memory with byte ``size`` and ``stride``."""
        base = torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage())
        return base.as_strided(size, stride, t.storage_offset() * t.element_size())

    @property
    def nbytes(self) -> int:
        """Bytes of the engine's blocks this tier addresses (kvdist allocated none)."""
        return self.num_blocks * self.layout.bytes_per_block

    def pieces(self, layer: int) -> torch.Tensor:
        """``[per_layer, num_blocks, piece_bytes]`` uint8 view of ``layer``."""
        return self._views[layer]

    def piece_pointers(self, blocks: np.ndarray, layers: range) -> np.ndarray:
        """Addresses ``[len(blocks), len(layers), per_layer]`` (uint64) of the pieces of
        ``layers`` of each engine block, in kvdist's block order."""
        b = np.asarray(blocks, dtype=np.int64)[:, None, None]
        sl = slice(layers.start, layers.stop)
        p = np.arange(self.pieces_of.per_layer, dtype=np.int64)[None, None, :]
        out = (self._ptrs[sl][None, :, None] + p * self._piece_stride[sl][None, :, None]
               + b * self._block_stride[sl][None, :, None])
        return out.astype(np.uint64)

    @property
    def stacked(self) -> bool:
        """Whether every layer moves in one kernel (``gather``, ``scatter``)."""
        return self._stacked is not None

    def close(self) -> None:
        """Forget the engine's tensors (the engine frees them)."""
        self._views = []
        self._stacked = self.rows = self._table = None
