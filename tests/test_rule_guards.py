"""Tests that exist to fail when one ordering rule of the transfer engine is weakened
(each was found by a mutation that no other test killed). They drive the cache
through its public API on simulated streams and check the bytes read back, so they do
not depend on how the engine is written inside."""

import pytest

import kvdist
import kvdist.testing
from kvdist.testing import IntegrityDriver, Seams


def T(start, n):
    return list(range(start, start + n))


def _fill(cache, table_row, tag: float) -> None:
    """What a forward pass writes into a sequence's blocks: ``tag`` everywhere."""
    blocks = table_row[table_row >= 0].long()
    for layer in range(cache.layout.num_layers):
        cache.kv_pool(layer)[blocks] = tag


def _tags(cache, table_row) -> list[float]:
    """The tag each block of a table row holds (layer 0, first element)."""
    blocks = table_row[table_row >= 0].long()
    return cache.kv_pool(0)[blocks].flatten(1)[:, 0].tolist()


def test_copies_queued_in_a_step_without_a_table_are_waited_for_later(cfg_factory):
    """A step that onboards blocks but builds no block table (it only admits), then a
    later step that reads them: the compute stream must still wait for those copies at
    that later block_table (S5), however many step boundaries passed meanwhile. Kills
    the engine forgetting copies still in flight at a step boundary."""
    cache = kvdist.create(cfg_factory(gpu=4, host=4, simulate_async=True))
    try:
        cache.begin_step()
        cache.add_sequence("a", T(0, 8))  # two full blocks
        _fill(cache, cache.block_table(["a"])[0], 1.0)
        cache.end_step()
        cache.release("a")
        cache.begin_step()
        cache.add_sequence("b", T(100, 16))  # four blocks: "a"'s two go to the host tier
        _fill(cache, cache.block_table(["b"])[0], 2.0)
        cache.end_step()
        cache.release("b")
        cache.begin_step()
        assert cache.add_sequence("a again", T(0, 8) + [99]) == 8  # onboarded, copies queued
        cache.end_step()  # no block table in this step: nothing waited for them yet
        cache.begin_step()
        table = cache.block_table(["a again"])
        assert _tags(cache, table[0][:2]) == [1.0, 1.0], "a block read before its onboard ran"
        cache.end_step()
        assert cache.stats()["blocks_moved"]["onboard"] == 2
        cache.check_invariants()
    finally:
        cache.close()


def _bulk_churn(cache, seams, rounds: int = 3) -> IntegrityDriver:
    """Fill the GPU tier with cached blocks, then admit prompts big enough that one
    eviction pass moves dozens of blocks at once (the bulk copy path), and reuse what
    went to the host tier. Every reused token is checked."""
    d = IntegrityDriver(cache)
    for r in range(rounds):
        for i in range(12):  # 12 prompts of 4 blocks: the 48-block GPU tier, all cached
            d.begin()
            d.add((r, "fill", i), T(1000 * (r + 1) + 100 * i, 16))
            d.compute()
            d.end()
            d.release((r, "fill", i))
        d.begin()
        d.add((r, "big"), T(50_000 + 1000 * r, 160))  # 40 fresh blocks: 40 evictions in one pass
        d.compute()
        d.end()
        d.release((r, "big"))
        for i in reversed(range(12)):  # reuse what is still cached: newest fills first
            d.begin()
            d.add((r, "again", i), T(1000 * (r + 1) + 100 * i, 16) + [7])
            d.compute()
            d.end()
            d.release((r, "again", i))
    cache.synchronize()
    return d


def test_bulk_eviction_that_reuses_a_host_slot_within_one_batch(cfg_factory):
    """40 offloads in one pass into an 8-block host tier without a disk tier: host
    blocks are dropped and their slots taken again within the same run of offloads,
    so the bulk copy holds two copies into one host slot. They must run in order (the
    second one's block is what the prefix index says is there)."""
    seams = Seams(copy_many_sizes=[])
    cache = kvdist.testing.create(cfg_factory(gpu=48, host=8, simulate_async=True), seams)
    try:
        d = _bulk_churn(cache, seams)
        assert max(seams.copy_many_sizes) >= 32  # the bulk path ran
        s = cache.stats()
        assert s["hit_tokens"]["host"] > 0 and s["dropped"] > 0
        assert d.checked_tokens > 0 and d.mismatched_tokens == 0, d.first_mismatch
        cache.check_invariants()
    finally:
        cache.close()


@pytest.mark.parametrize("host", [48, 96], ids=["host-full", "host-free"])
def test_bulk_onboard_into_slots_an_open_offload_batch_reads(cfg_factory, host):
    """A prompt with dozens of host-tier hits while the GPU tier is full: its fresh GPU
    slots are vacated by a bulk offload still open in the engine, and the bulk onboard
    writes into exactly those slots. The onboard must follow the offload's reads."""
    seams = Seams(copy_many_sizes=[])
    cache = kvdist.testing.create(cfg_factory(gpu=48, host=host, simulate_async=True), seams)
    try:
        d = IntegrityDriver(cache)
        prompt = T(0, 160)  # 40 full blocks
        d.begin()
        d.add("p", prompt + [1])
        d.compute()
        d.end()
        d.release("p")
        d.begin()
        d.add("q", T(10_000, 160) + [1])  # evicts p's 40 blocks to the host tier in bulk
        d.compute()
        d.end()
        d.release("q")
        flushes = seams.engine.stats.conflict_flushes
        d.begin()
        assert d.add("p again", prompt + [2]) == 160  # 40 onboards into slots q's offloads vacate
        d.compute()
        d.end()
        cache.synchronize()
        assert sum(n >= 32 for n in seams.copy_many_sizes) >= 3
        assert seams.engine.stats.conflict_flushes > flushes  # the onboard met the open offload's marks
        assert d.checked_tokens >= 160 and d.mismatched_tokens == 0, d.first_mismatch
        cache.check_invariants()
    finally:
        cache.close()
