"""The pool of bounce buffers: reuse by size, one batch per buffer, nothing lost."""

from __future__ import annotations

import pytest
import torch

import kvdist.testing
from kvdist.testing import Seams
from kvdist.transfer import DEMOTE, RELOAD, SPILL
from kvdist.transfer.bounce import BOUNCE_BATCH_BYTES, BouncePool, bounce_blocks


def _pool() -> BouncePool:
    return BouncePool(8, allocate=lambda blocks: torch.zeros((blocks, 8), dtype=torch.uint8))


def test_a_given_back_buffer_is_taken_again_before_a_new_one_is_made():
    pool = _pool()
    a = pool.take(3)
    pool.check_invariants()
    assert a.shape == (4, 8) and pool.allocations == 1 and pool.lent == 1  # a power of two
    pool.give(a)
    pool.check_invariants()
    b = pool.take(2)
    assert b.data_ptr() == a.data_ptr() and pool.allocations == 1
    c = pool.take(2)  # b is lent: never shared
    assert c.data_ptr() != b.data_ptr() and c.shape == (2, 8) and pool.allocations == 2
    pool.give(b)
    pool.give(c)
    pool.check_invariants()
    assert pool.lent == 0
    d = pool.take(1)  # the smallest free buffer that holds it
    assert d.data_ptr() == c.data_ptr()
    e = pool.take(5)  # none free holds 5: a new one of 8
    assert e.shape == (8, 8) and pool.allocations == 3
    pool.check_invariants()


def test_a_buffer_given_back_twice_or_from_elsewhere_is_a_programming_error():
    pool = _pool()
    a = pool.take(1)
    pool.give(a)
    with pytest.raises(AssertionError, match="twice"):
        pool.give(a)
    with pytest.raises(AssertionError, match="twice"):
        pool.give(torch.zeros((1, 8), dtype=torch.uint8))
    pool.check_invariants()


def test_reloads_and_spills_are_cut_to_what_one_bounce_buffer_holds(cfg_factory):
    """No reload or spill batch needs a buffer bigger than BOUNCE_BATCH_BYTES."""
    assert bounce_blocks(2 << 20) == 32 and bounce_blocks(BOUNCE_BATCH_BYTES + 1) == 1
    seams = Seams()
    cache = kvdist.testing.create(cfg_factory(gpu=4, host=4, disk=8), seams)
    try:
        limits = seams.engine.batch_limits
        block = seams.manager.layout.bytes_per_block
        assert limits[RELOAD] == limits[SPILL] == bounce_blocks(block) == BOUNCE_BATCH_BYTES // block
        assert DEMOTE in limits
    finally:
        cache.close()
