"""KV geometry: how many bytes a block holds and how a pool is shaped.

A block holds the K and V of ``tokens_per_block`` tokens for *all* layers, stored
block-major (``[block, layer, k|v, token, head, dim]``), so moving a block between
tiers is one contiguous copy of ``bytes_per_block`` bytes."""

from __future__ import annotations

__all__ = ["EnginePieces", "KVLayout", "LayerGroups"]

from dataclasses import dataclass

import xxhash

from .config import CacheConfig
from .dtypes import ITEMSIZE


@dataclass(frozen=True, slots=True)
class LayerGroups:
    """Byte ranges of a block, one per group of consecutive layers, layer 0's first;
    ``group_of[layer]`` is the group a layer's K/V is in."""

    spans: tuple[tuple[int, int], ...]
    group_of: tuple[int, ...]

    def __len__(self) -> int:
        return len(self.spans)


@dataclass(frozen=True, slots=True)
class EnginePieces:
    """A kvdist block cut as an engine's tensors hold it: ``per_layer`` pieces of
    ``piece_bytes`` per layer; in a kvdist block they follow one another, layer 0's
    first (``offset``), so kvdist keeps the engine's bytes as they are."""

    num_layers: int
    per_layer: int
    piece_bytes: int

    def offset(self, layer: int, piece: int) -> int:
        """Where piece ``piece`` of ``layer`` starts in a kvdist block."""
        return (layer * self.per_layer + piece) * self.piece_bytes


@dataclass(frozen=True, slots=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    tokens_per_block: int

    @classmethod
    def from_config(cls, cfg: CacheConfig) -> KVLayout:
        m = cfg.model
        return cls(m.num_layers, m.num_kv_heads, m.head_dim, m.dtype, cfg.cache.tokens_per_block)

    @property
    def itemsize(self) -> int:
        return ITEMSIZE[self.dtype]

    @property
    def layer_elems(self) -> int:
        """Elements of one layer's K and V in one block."""
        return 2 * self.tokens_per_block * self.num_kv_heads * self.head_dim

    @property
    def bytes_per_layer(self) -> int:
        return self.layer_elems * self.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.num_layers * self.bytes_per_layer

    def engine_pieces(self, per_layer: int) -> EnginePieces:
        """A block as an engine's per-layer paged tensors hold it (``cache.gpu:
        external``): ``per_layer`` contiguous pieces in each layer's tensor — 1 where a
        block of a layer is one dense run (vLLM 0.33's layouts, K and V side by side), 2
        where K and V are apart (``[2, num_blocks, ...]``)."""
        assert per_layer in (1, 2), f"a layer holds a block in 1 or 2 pieces, not {per_layer}"
        return EnginePieces(self.num_layers, per_layer, self.bytes_per_layer // per_layer)

    def layers_in(self, span: tuple[int, int]) -> range:
        """The layers whose K and V fill the byte ``span`` of a block (a layer group's)."""
        lo, hi = span
        assert lo % self.bytes_per_layer == 0 and hi % self.bytes_per_layer == 0, f"span {span} cuts a layer"
        return range(lo // self.bytes_per_layer, hi // self.bytes_per_layer)

    def block_shape(self) -> tuple[int, ...]:
        """Shape of one block: ``[layer, 2, tokens, heads, dim]``."""
        return (self.num_layers, 2, self.tokens_per_block, self.num_kv_heads, self.head_dim)

    def blocks_in(self, nbytes: int) -> int:
        return nbytes // self.bytes_per_block

    def groups_for(self, groups: int | str, min_piece: int) -> int:
        """``cache.layer_groups`` as a count: ``"auto"`` is the most groups (at most one
        per layer) that keep each group's slice of a block at least ``min_piece`` bytes."""
        if groups == "auto":
            groups = self.bytes_per_block // min_piece
        return max(1, min(int(groups), self.num_layers))

    def layer_groups(self, groups: int) -> LayerGroups:
        """The block cut into ``groups`` runs of consecutive layers (at most one per
        layer), as equal as they can be: what a layer-by-layer copy moves at a time."""
        groups = max(1, min(groups, self.num_layers))
        sizes = [self.num_layers // groups + (g < self.num_layers % groups) for g in range(groups)]
        spans, group_of, first = [], [], 0
        for g, n in enumerate(sizes):
            spans.append((first * self.bytes_per_layer, (first + n) * self.bytes_per_layer))
            group_of += [g] * n
            first += n
        return LayerGroups(tuple(spans), tuple(group_of))

    def hash_salt(self) -> bytes:
        """16 bytes that seed every block hash chain: caches of different geometry or
        dtype never share a hash, even for equal tokens."""
        key = (f"kvdist/v1/{self.num_layers}/{self.num_kv_heads}/{self.head_dim}/"
               f"{self.dtype}/{self.tokens_per_block}")
        return xxhash.xxh3_128_digest(key.encode())
