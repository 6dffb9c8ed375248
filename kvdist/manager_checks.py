"""Whole-state checks of a :class:`~kvdist.manager.CacheManager`: the digest ranks
compare for consistency and the structural invariants tests verify after every
operation. O(total slots) each: never on the per-step path."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import xxhash

from .blocks import ACTIVE, CACHED, DISK, FREE, GPU, HOST, NO_SLOT, TIER_NAMES

if TYPE_CHECKING:
    from .manager import CacheManager


def state_digest(m: CacheManager) -> bytes:
    """xxh3-128 of the state that decides this cache's future behaviour: capacities,
    each slot's state, refcount and (when live) priority and hash, the eviction-list
    links, the free stacks, the prefix index and the sequences. Ranks fed the same
    request stream have equal digests (``KVCache.check_consistency``). O(slots)."""
    meta = m.meta
    live = meta.state != FREE
    # Dead slots keep stale hashes/priorities/links; only what is live is compared.
    listed = (meta.state == CACHED) & (meta.refcnt == 0)
    h = xxhash.xxh3_128()
    h.update(np.asarray(m.space.capacity, dtype=np.int64))
    for a in (meta.state, meta.refcnt, np.where(live, meta.prio, 0),
              np.where(live, meta.hash_hi, 0), np.where(live, meta.hash_lo, 0),
              np.where(listed, meta.prev, NO_SLOT), np.where(listed, meta.next, NO_SLOT),
              np.sort(m.index.slots())):
        h.update(np.ascontiguousarray(a))
    for stack in m.free:
        if stack is not None:
            h.update(stack.snapshot())
    pending = [s.seq_id for s in m._deferred_release]
    h.update(repr((len(m.seqs), list(m._dirty), pending)).encode())
    for seq in m.seqs.values():
        h.update(repr(seq.seq_id).encode())
        h.update(np.array([len(seq.tokens), seq.priority, seq.num_hashed], dtype=np.int64))
        h.update(np.asarray(seq.slots, dtype=np.int32))
        h.update(np.asarray(seq.tokens, dtype=np.int32))
    return h.digest()


def check_invariants(m: CacheManager) -> None:
    """Verify the structural invariants of ``kvdist.manager``'s module docstring."""
    meta, space = m.meta, m.space
    state, ref = meta.state, meta.refcnt
    assert not m._moves[0], f"{len(m._moves[0])} moves never reached the transfer engine"
    expected_ref = np.zeros(space.total, dtype=np.int64)
    for seq in list(m.seqs.values()) + m._deferred_release:
        assert len(seq.slots) == -(-len(seq.tokens) // m.tpb), f"{seq.seq_id}: slots/tokens"
        np.add.at(expected_ref, np.asarray(seq.slots, dtype=np.int64), 1)
    assert np.array_equal(expected_ref, ref), "refcounts differ from sequence references"
    assert (ref[space.base[HOST]:] == 0).all(), "a host/disk slot is referenced"
    assert not (state[space.base[HOST]:] == ACTIVE).any(), "an ACTIVE slot outside the GPU tier"
    assert ((state != FREE) | (ref == 0)).all(), "a FREE slot is referenced"
    assert ((state != ACTIVE) | (ref > 0)).all(), "an ACTIVE slot is unreferenced"
    for t in (GPU, HOST, DISK):
        lo, hi = space.base[t], space.base[t] + space.capacity[t]
        if not space.capacity[t]:
            continue
        free = m.free[t].snapshot()
        assert len(np.unique(free)) == len(free), f"{TIER_NAMES[t]}: a slot is free twice"
        assert ((free >= lo) & (free < hi)).all(), f"{TIER_NAMES[t]}: foreign slot on free stack"
        assert (state[free] == FREE).all(), f"{TIER_NAMES[t]}: non-FREE slot on free stack"
        assert (state[lo:hi] == FREE).sum() == len(free), f"{TIER_NAMES[t]}: FREE slot not on stack"
        m.lru[t].check_invariants()
        in_lru = np.fromiter(iter(m.lru[t]), dtype=np.int64)
        assert ((in_lru >= lo) & (in_lru < hi)).all(), f"{TIER_NAMES[t]}: foreign slot in lru"
        assert (state[in_lru] == CACHED).all() and (ref[in_lru] == 0).all(), \
            f"{TIER_NAMES[t]}: eviction list holds a referenced or uncached slot"
        unref_cached = ((state[lo:hi] == CACHED) & (ref[lo:hi] == 0)).sum()
        assert unref_cached == len(in_lru), f"{TIER_NAMES[t]}: cached slot missing from lru"
    m.index.check_invariants()
    indexed = np.sort(m.index.slots())
    assert np.array_equal(indexed, np.flatnonzero(state == CACHED)), "index != CACHED slots"

