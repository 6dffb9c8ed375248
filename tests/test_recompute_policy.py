"""Onboard or recompute: the cut over a cached prefix from agreed figures, and a cache
whose disk tier is throttled below the recompute rate turning its disk hits down
(still reusing host hits) while the bytes stay right."""

from __future__ import annotations

from array import array

import pytest

import kvdist
import kvdist.testing
from kvdist.blocks import DISK, GPU, HOST
from kvdist.prefix import chain_hashes
from kvdist.recompute_policy import UNKNOWN, RecomputePolicy
from kvdist.seams import Seams
from kvdist.testing import IntegrityDriver

# 1,000-byte blocks of 4 tokens; recompute at 1,000 tokens/s: 4 ms a block. Host at
# 1 MB/s: 1 ms a block (onboard); disk at 100 kB/s: 10 ms a block (recompute).
FIGURES = [1_000_000, 100_000, 1_000]


@pytest.fixture
def policy():
    p = RecomputePolicy(bytes_per_block=1000, tokens_per_block=4)
    p.agree(FIGURES)
    return p


@pytest.mark.parametrize("tiers, k", [
    ([GPU, HOST, HOST], 3),
    ([GPU, HOST, DISK], 2),  # the disk block costs more than recomputing its 4 tokens
    ([DISK, DISK, HOST], 0),  # onboarding 2 dear blocks to reach a cheap one does not pay
    ([GPU, DISK] + [HOST] * 7, 9),  # ... but 7 cheap ones after it do: -4 + 6 - 21 < -4
    ([GPU, DISK, HOST], 1),
    ([], 0),
])
def test_cut_minimizes_onboard_plus_recompute(policy, tiers, k):
    assert policy.cut(tiers) == k
    assert policy.counts.onboarded == [0, 0, 0]  # cut decides, record counts


def test_unknown_figures_onboard_and_decisions_are_counted(policy):
    fresh = RecomputePolicy(1000, 4)
    assert fresh.agreed == [UNKNOWN] * 3 and fresh.cut([DISK, DISK]) == 2  # nothing measured: onboard
    fresh.agree([UNKNOWN, UNKNOWN, 1_000])  # recompute measured, no tier yet: onboard to measure
    assert fresh.cut([HOST, DISK]) == 2
    off = RecomputePolicy(1000, 4, enabled=False)
    off.agree(FIGURES)
    assert off.cut([DISK, DISK]) == 2
    tiers = [GPU, HOST, DISK, HOST]
    k = policy.cut(tiers)
    policy.record(tiers, k)
    assert k == 2 and policy.counts.onboarded == [0, 1, 0] and policy.counts.recomputed == [0, 1, 1]


def test_a_tier_dearer_than_recomputing_is_not_worth_storing(policy):
    assert policy.worth_storing(HOST) and not policy.worth_storing(DISK)  # 1 ms, 10 ms vs 4 ms
    assert policy.worth_storing(GPU)
    assert RecomputePolicy(1000, 4).worth_storing(DISK)  # nothing measured: store, to measure
    off = RecomputePolicy(1000, 4, enabled=False)
    off.agree(FIGURES)
    assert off.worth_storing(DISK)


def test_local_figures_are_running_means():
    p = RecomputePolicy(1000, 4)
    assert p.local_figures() == [UNKNOWN] * 3
    p.observe_copy(HOST, 2_000_000, 1.0)
    p.observe_copy(HOST, 1_000_000, 1.0)  # 0.8 * 2e6 + 0.2 * 1e6
    p.observe_copy(DISK, 0, 1.0)  # nothing moved: ignored
    p.observe_prefill(100, 0.5)
    assert p.local_figures() == [1_800_000, UNKNOWN, 200]


def tiers_of_hits(m, tokens: list[int]) -> list[int]:
    """The tier of each block of ``tokens``' cached prefix in manager ``m`` (what
    add_sequence would match)."""
    tpb = m.tpb
    hashes = chain_hashes(m.salt, array("i", tokens).tobytes(), 0, (len(tokens) - 1) // tpb, tpb)
    return [m.space.tier_of(s) for s in m.index.match(hashes)]


def _throttled_cache(cfg_factory):
    """A cache of 512 B blocks (GPU 4, host 3, disk 8) whose disk reads at most 20 kB/s,
    and its seams."""
    cfg = cfg_factory(gpu=4, host=3, disk=8)
    cfg["cache"]["disk"]["max_read_bytes_per_s"] = 20_000
    seams = Seams()
    return kvdist.testing.create(cfg, seams), seams


def test_a_throttled_disk_is_turned_down_and_host_hits_still_reused(cfg_factory):
    """Blocks of 512 B; the disk reads at most 20 kB/s (26 ms a block); the engine says
    it computes 400 tokens/s (10 ms a block: a host copy takes far less, even on a
    loaded machine). The first disk hit is onboarded (nothing
    measured yet) and timed; from then on every prompt's reuse stops at its first disk
    block, and host hits before it are onboarded. The bytes stay right throughout."""
    cache, seams = _throttled_cache(cfg_factory)
    try:
        d = IntegrityDriver(cache)
        policy = cache.stats()["recompute_policy"]
        measured = False
        decided = {"host": 0, "disk": 0}
        for i in range(24):  # 3-block prompts over 4 distinct starts churn every tier
            tokens = list(range(100 * (i % 4), 100 * (i % 4) + 12)) + [999]
            where = tiers_of_hits(seams.manager, tokens)
            d.begin()
            reused = d.add(i, tokens)
            d.compute()
            cache.observe_prefill(400, 1.0)
            d.end()
            d.release(i)
            before, policy = policy, cache.stats()["recompute_policy"]
            if not measured:
                assert reused == 4 * len(where)  # disk figure unknown: everything onboarded
                measured = policy["disk_bytes_per_s"] is not None
                continue
            cut = next((k for k, t in enumerate(where) if t == DISK), len(where))
            assert reused == 4 * cut, (i, where)
            now = {name: sum(1 for t in where[cut:] if t == tier)
                   for name, tier in (("host", HOST), ("disk", DISK))}
            assert policy["recomputed_blocks"] == {t: before["recomputed_blocks"][t] + now[t] for t in now}
            decided = {t: decided[t] + now[t] for t in now}
        s = cache.stats()["recompute_policy"]
        assert measured and s["disk_bytes_per_s"] <= 20_000 and s["prefill_tokens_per_s"] == 400
        assert s["recomputed_blocks"] == decided and decided["disk"] > 0
        assert s["onboarded_blocks"]["host"] > 0
        assert d.mismatched_tokens == 0 and d.checked_tokens > 0
        cache.check_invariants()
    finally:
        cache.close()


def test_once_the_disk_is_turned_down_host_evictions_drop_instead_of_demoting(cfg_factory):
    """A disk slower than recomputing gets no more demotions: a host block evicted then
    is dropped (no write traffic for a block nobody will onboard back), while before the
    disk figure is known host evictions demote as usual. Bytes stay right."""
    cache, _ = _throttled_cache(cfg_factory)
    try:
        d = IntegrityDriver(cache)
        demotes_after_turned_down = drops_after = 0
        for i in range(32):
            tokens = list(range(100 * (i % 4), 100 * (i % 4) + 12)) + [999]
            turned_down = cache.stats()["recompute_policy"]["disk_bytes_per_s"] is not None
            before = cache.stats()
            d.begin()
            d.add(i, tokens)
            d.compute()
            cache.observe_prefill(400, 1.0)
            d.end()
            d.release(i)
            after = cache.stats()
            if turned_down:
                moved, was = after["blocks_moved"], before["blocks_moved"]
                demotes_after_turned_down += moved["demote"] - was["demote"]
                drops_after += after["dropped"] - before["dropped"]
            cache.check_invariants()
        s = cache.stats()
        assert s["recompute_policy"]["disk_bytes_per_s"] is not None  # the disk was measured ...
        assert s["blocks_moved"]["demote"] > 0  # ... after demotions put blocks there
        assert demotes_after_turned_down == 0 and drops_after > 0
        assert d.mismatched_tokens == 0 and d.checked_tokens > 0
    finally:
        cache.close()
