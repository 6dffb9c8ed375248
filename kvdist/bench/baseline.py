"""The baseline of ``bench manager``: a straightforward pure-Python block manager of
the common design (vLLM v0's prefix-caching block manager, minus the tiers).

* unreferenced blocks sit in one ``deque``: blocks that hold nothing on the left (used
  first), cached blocks appended on the right as they are released, so the left end
  is also the least recently used cached block — the eviction victim;
* a block's hash is one xxh3-128 of (parent hash, the block's token ids), and a
  ``dict`` maps hash -> block;
* a prefix hit on an unreferenced cached block revives it with ``deque.remove``.

Semantics match :class:`kvdist.manager.CacheManager` with only a GPU tier: blocks
become reusable at ``end_step`` of the step that filled them, at least one prompt
token is always computed, the tail block of a released sequence is evicted before
the blocks it depends on, a duplicate block stays private. Same trace, same hits."""

from __future__ import annotations

from array import array
from collections import deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from itertools import chain

import numpy as np
import xxhash

from ..errors import OutOfBlocksError

_hash128 = xxhash.xxh3_128_intdigest


@dataclass(slots=True)
class _Seq:
    tokens: list[int]
    blocks: list[int]
    num_hashed: int  # leading full blocks whose hashes are known
    parent: bytes  # digest of block num_hashed - 1 (the salt when 0)


class BaselineBlockManager:
    """Block bookkeeping of one GPU tier of ``num_blocks`` blocks of ``block_size`` tokens."""

    def __init__(self, num_blocks: int, block_size: int, salt: bytes = bytes(16)):
        self.block_size = block_size
        self.salt = salt
        self.free: deque[int] = deque(range(num_blocks))
        self.refcount = [0] * num_blocks
        self.block_hash: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # block hash -> block
        self.seqs: dict[Hashable, _Seq] = {}
        self._dirty: dict[Hashable, _Seq] = {}
        self._deferred_release: list[_Seq] = []
        self.hit_tokens = 0
        self.evictions = 0

    def _allocate(self) -> int:
        block = self.free.popleft()
        h = self.block_hash[block]
        if h is not None:  # the least recently used cached block: evict it
            del self.cached[h]
            self.block_hash[block] = None
            self.evictions += 1
        self.refcount[block] = 1
        return block

    def add_sequence(self, seq_id: Hashable, tokens: Iterable[int]) -> int:
        """Admit a prompt; returns the number of prompt tokens reused."""
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already in the cache")
        tokens = list(tokens)
        bs = self.block_size
        blocks: list[int] = []
        parent = self.salt
        data = array("i", tokens).tobytes()
        stride = 4 * bs
        for i in range((len(tokens) - 1) // bs):
            h = _hash128(parent + data[i * stride : (i + 1) * stride])
            b = self.cached.get(h)
            if b is None:
                break
            blocks.append(b)
            parent = h.to_bytes(16, "little")
        revive = [b for b in blocks if self.refcount[b] == 0]
        need = -(-len(tokens) // bs) - len(blocks)
        if need > len(self.free) - len(revive):
            raise OutOfBlocksError(need, len(self.free) - len(revive), f"sequence {seq_id!r}")
        for b in blocks:
            if self.refcount[b] == 0:
                self.free.remove(b)
            self.refcount[b] += 1
        hits = len(blocks)
        blocks.extend(self._allocate() for _ in range(need))
        self.seqs[seq_id] = self._dirty[seq_id] = _Seq(tokens, blocks, hits, parent)
        self.hit_tokens += hits * bs
        return hits * bs

    def append_tokens(self, seq_id: Hashable, tokens: Iterable[int]) -> None:
        seq = self.seqs[seq_id]
        tokens = list(tokens)
        need = -(-(len(seq.tokens) + len(tokens)) // self.block_size) - len(seq.blocks)
        if need > 0:
            if need > len(self.free):
                raise OutOfBlocksError(need, len(self.free), f"appending to {seq_id!r}")
            seq.blocks.extend(self._allocate() for _ in range(need))
        seq.tokens.extend(tokens)
        self._dirty[seq_id] = seq

    def table_rows(self, seq_ids: list[Hashable]) -> np.ndarray:
        """int32 ``[len(seq_ids), max blocks]`` padded with -1."""
        rows = [self.seqs[s].blocks for s in seq_ids]
        table = np.full((len(rows), max(map(len, rows), default=0)), -1, dtype=np.int32)
        for i, blocks in enumerate(rows):
            table[i, : len(blocks)] = blocks
        return table

    def end_step(self) -> None:
        """Blocks filled in this step become reusable; deferred releases run."""
        for seq in chain(self._dirty.values(), self._deferred_release):
            self._register(seq)
        self._dirty.clear()
        for seq in self._deferred_release:
            self._free(seq)
        self._deferred_release.clear()

    def _register(self, seq: _Seq) -> None:
        bs = self.block_size
        first, full = seq.num_hashed, len(seq.tokens) // bs
        if full <= first:
            return
        data = array("i", seq.tokens[first * bs : full * bs]).tobytes()
        stride = 4 * bs
        parent = seq.parent
        for i in range(full - first):
            h = _hash128(parent + data[i * stride : (i + 1) * stride])
            if h not in self.cached:
                block = seq.blocks[first + i]
                self.cached[h] = block
                self.block_hash[block] = h
            parent = h.to_bytes(16, "little")
        seq.num_hashed = full
        seq.parent = parent

    def release(self, seq_id: Hashable) -> None:
        seq = self.seqs.pop(seq_id)
        if self._dirty.pop(seq_id, None) is not None:
            self._deferred_release.append(seq)
        else:
            self._free(seq)

    def _free(self, seq: _Seq) -> None:
        # Tail first, so the end of a prefix is evicted before the blocks it extends.
        for b in reversed(seq.blocks):
            self.refcount[b] -= 1
            if self.refcount[b] == 0:
                if self.block_hash[b] is None:
                    self.free.appendleft(b)
                else:
                    self.free.append(b)
