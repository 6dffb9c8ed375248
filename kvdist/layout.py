"""KV geometry: how many bytes a block holds and how a pool is shaped.

A block holds the K and V of ``tokens_per_block`` tokens for *all* layers, stored
block-major (``[block, layer, k|v, token, head, dim]``), so moving a block between
tiers is one contiguous copy of ``bytes_per_block`` bytes."""

from __future__ import annotations

__all__ = ["KVLayout"]

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

    @property
    def piece_bytes(self) -> int:
        """Bytes of one layer's K (or V) in one block: the unit an engine's paged
        tensors hold a block in (``cache.gpu: external``: per layer, K of block b is one
        piece, V another). A kvdist block is its ``2 * num_layers`` pieces in order
        (layer 0's K, layer 0's V, layer 1's K, ...): ``piece_offset``."""
        return self.bytes_per_layer // 2

    def piece_offset(self, layer: int, kv: int) -> int:
        """Where the piece of ``layer``'s K (``kv`` 0) or V (1) starts in a kvdist block."""
        return (2 * layer + kv) * self.piece_bytes

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
