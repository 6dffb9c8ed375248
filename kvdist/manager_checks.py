"""Whole-state checks of a :class:`~kvdist.manager.CacheManager`, over a read-only
:class:`ManagerState` the manager hands over (its slots as the pool's snapshot): the
digest ranks compare for consistency and the structural invariants tests verify after
every operation. O(total slots) each: never on the per-step path."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass

import numpy as np
import xxhash

from .block_pool import PoolSnapshot
from .blocks import ACTIVE, CACHED, FREE, HOST, NO_SLOT, TIER_NAMES, BlockMeta, SlotSpace
from .prefix import PrefixIndex
from .sequences import Sequence

__all__ = ["ManagerState", "check_invariants", "state_digest"]


@dataclass(frozen=True, slots=True)
class ManagerState:
    """What the checks read of a manager (``CacheManager._checked``); read-only."""

    meta: BlockMeta
    space: SlotSpace
    index: PrefixIndex
    pool: PoolSnapshot
    tokens_per_block: int
    seqs: dict[Hashable, Sequence]  # admitted and not released
    dirty: list[Hashable]  # ids of the sequences that got tokens this step
    deferred: list[Sequence]  # released in this step, freed at its end_step


def state_digest(m: ManagerState) -> bytes:
    """xxh3-128 of the state that decides this cache's future behaviour: capacities,
    each slot's state, refcount and (when live) priority and hash, the eviction lists'
    order, the free lists, the prefix index and the sequences. Ranks fed the same
    request stream have equal digests (``KVCache.check_consistency``). O(slots)."""
    meta = m.meta
    live = meta.state != FREE
    # Dead slots keep stale hashes/priorities; only what is live is compared.
    h = xxhash.xxh3_128()
    h.update(np.asarray(m.space.capacity, dtype=np.int64))
    for a in (meta.state, meta.refcnt, np.where(live, meta.prio, 0),
              np.where(live, meta.hash_hi, 0), np.where(live, meta.hash_lo, 0),
              np.sort(m.index.slots()), *m.pool.lru):
        h.update(np.ascontiguousarray(a))
    for free in m.pool.free:
        if free is not None:
            h.update(free)
    pending = [s.seq_id for s in m.deferred]
    h.update(repr((len(m.seqs), m.dirty, pending)).encode())
    for seq in m.seqs.values():
        h.update(repr(seq.seq_id).encode())
        h.update(np.array([len(seq.tokens), seq.priority, seq.num_hashed], dtype=np.int64))
        h.update(np.asarray(seq.slots, dtype=np.int32))
        h.update(np.asarray(seq.tokens, dtype=np.int32))
    return h.digest()


def check_invariants(m: ManagerState) -> None:
    """Verify the structural invariants of ``kvdist.manager``'s module docstring."""
    meta, space, pool = m.meta, m.space, m.pool
    state, ref = meta.state, meta.refcnt
    assert not pool.pending_moves, f"{pool.pending_moves} moves never reached the transfer engine"
    expected_ref = np.zeros(space.total, dtype=np.int64)
    for seq in list(m.seqs.values()) + m.deferred:
        assert len(seq.slots) == -(-len(seq.tokens) // m.tokens_per_block), f"{seq.seq_id}: slots/tokens"
        np.add.at(expected_ref, np.asarray(seq.slots, dtype=np.int64), 1)
    assert np.array_equal(expected_ref, ref), "refcounts differ from sequence references"
    assert (ref[space.base[HOST]:] == 0).all(), "a host/disk slot is referenced"
    assert not (state[space.base[HOST]:] == ACTIVE).any(), "an ACTIVE slot outside the GPU tier"
    assert ((state != FREE) | (ref == 0)).all(), "a FREE slot is referenced"
    assert ((state != ACTIVE) | (ref > 0)).all(), "an ACTIVE slot is unreferenced"
    for t in range(len(space.capacity)):
        lo, hi = space.base[t], space.base[t] + space.capacity[t]
        if not space.capacity[t]:
            continue
        free = pool.free[t]
        assert len(np.unique(free)) == len(free), f"{TIER_NAMES[t]}: a slot is free twice"
        assert ((free >= lo) & (free < hi)).all(), f"{TIER_NAMES[t]}: foreign slot on free list"
        assert (state[free] == FREE).all(), f"{TIER_NAMES[t]}: non-FREE slot on free list"
        assert (state[lo:hi] == FREE).sum() == len(free), f"{TIER_NAMES[t]}: FREE slot not on free list"
        in_lru = pool.lru[t]
        assert ((in_lru >= lo) & (in_lru < hi)).all(), f"{TIER_NAMES[t]}: foreign slot in lru"
        assert (state[in_lru] == CACHED).all() and (ref[in_lru] == 0).all(), \
            f"{TIER_NAMES[t]}: eviction list holds a referenced or uncached slot"
        unref_cached = ((state[lo:hi] == CACHED) & (ref[lo:hi] == 0)).sum()
        assert unref_cached == len(in_lru), f"{TIER_NAMES[t]}: cached slot missing from lru"
    listed = (state == CACHED) & (ref == 0)
    assert np.array_equal(meta.lru_pos != NO_SLOT, listed), "a slot's lru_pos disagrees with its lists"
    m.index.check_invariants()
    indexed = np.sort(m.index.slots())
    assert np.array_equal(indexed, np.flatnonzero(state == CACHED)), "index != CACHED slots"
