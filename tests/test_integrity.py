"""End-to-end integrity on CPU: blocks travel gpu -> host -> disk and back while a
driver writes a pattern per (prefix, layer, K/V) and checks every reused token.

Runs with immediate copies and with simulated asynchronous streams; with a rule of
docs/design.md ("Synchronization rules") switched off through the test seams, the
simulated streams must corrupt (the rule-off cases)."""

import random

import pytest

import kvdist
import kvdist.testing
from kvdist.testing import IntegrityDriver, Seams


def churn(cache, steps=240, seed=1, check=True, host_reader=False, prefetch=False):
    """``prefetch``: each prompt is prefetched first, between steps or in its step."""
    d = IntegrityDriver(cache, host_reader=host_reader)
    rng = random.Random(seed)
    systems = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    history = []
    for i in range(steps):
        if prefetch and i % 2 and history:  # between steps
            cache.prefetch(f"early-{i}", rng.choice(history))
        d.begin()
        if history and rng.random() < 0.5:
            toks = rng.choice(history) + [rng.randrange(100) for _ in range(rng.randrange(1, 6))]
        else:
            toks = rng.choice(systems) + [rng.randrange(100) for _ in range(rng.randrange(1, 10))]
        if prefetch:
            cache.prefetch(i, toks)
        d.add(i, toks, priority=rng.choice([10, 35, 80]))
        d.compute()
        d.end()
        if check:
            cache.check_invariants()
        d.begin()
        d.append(i, [rng.randrange(100) for _ in range(3)])
        d.compute()
        d.end()
        history.append(list(d.seqs[i].tokens))
        d.release(i)
        if check:
            cache.check_invariants()
    cache.synchronize()
    return d


@pytest.fixture(params=[False, True], ids=["sync", "simulated-async"])
def cache(request, cfg_factory):
    c = kvdist.create(cfg_factory(gpu=24, host=8, disk=128, simulate_async=request.param))
    yield c
    c.close()


def test_churn_hits_every_tier_with_exact_bytes(cache):
    d = churn(cache)
    s = cache.stats()
    assert all(s["hit_tokens"][t] > 0 for t in ("gpu", "host", "disk")), s["hit_tokens"]
    assert min(s["blocks_moved"][k] for k in ("offload", "onboard", "demote", "reload")) > 0
    assert d.checked_tokens > 4000
    assert d.mismatched_tokens == 0, d.first_mismatch


def test_a_host_reader_gets_complete_tables_under_simulated_streams(cfg_factory):
    """KVDIST_SIMULATE_ASYNC serves any caller: a CPU engine reads the table and the
    blocks with plain torch indexing right after block_table (no simulated kernel)."""
    cache = kvdist.create(cfg_factory(gpu=24, host=8, disk=128, simulate_async=True))
    try:
        d = churn(cache, host_reader=True)
        s = cache.stats()
        assert all(s["hit_tokens"][t] > 0 for t in ("gpu", "host", "disk")), s["hit_tokens"]
        assert d.checked_tokens > 4000
        assert d.mismatched_tokens == 0, d.first_mismatch
    finally:
        cache.close()


def test_s5_off_corrupts_a_host_reader_too(cfg_factory):
    cache = kvdist.testing.create(cfg_factory(gpu=24, host=8, disk=128, simulate_async=True),
                                  Seams(rules=frozenset({"S2", "S4"})))
    try:
        assert churn(cache, check=False, host_reader=True).mismatched_tokens > 0
    finally:
        cache.close()


@pytest.mark.parametrize("rules,tracking", [
    (frozenset({"S4", "S5"}), "slot"),  # S2 off
    (frozenset({"S2", "S4"}), "slot"),  # S5 off
    (frozenset({"S2", "S4", "S5"}), "block"),  # S1 off: pending copies keyed by block id
], ids=["S2-off", "S5-off", "S1-off-block-ids"])
def test_rule_off_corrupts_under_simulated_streams(cfg_factory, rules, tracking):
    cfg = cfg_factory(gpu=24, host=8, disk=128, simulate_async=True)
    cache = kvdist.testing.create(cfg, Seams(rules=rules, tracking=tracking))
    try:
        d = churn(cache, check=False)
        assert d.mismatched_tokens > 0
    finally:
        cache.close()


@pytest.mark.parametrize("simulate_async", [False, True], ids=["sync", "simulated-async"])
def test_prefetched_disk_blocks_come_back_intact(cfg_factory, simulate_async):
    """``prefetch`` promotes a prompt's disk blocks into the host tier (in and between
    steps); its add_sequence onboards them from there, after their read."""
    cache = kvdist.create(cfg_factory(gpu=24, host=8, disk=128, simulate_async=simulate_async))
    try:
        d = churn(cache, prefetch=True)
        s = cache.stats()
        assert s["blocks_moved"]["promote"] > 20, s["blocks_moved"]
        assert s["hit_tokens"]["host"] > 0
        assert d.mismatched_tokens == 0, d.first_mismatch
    finally:
        cache.close()


@pytest.mark.parametrize("s2", [True, False], ids=["S2", "S2-off"])
def test_a_prefetched_block_is_onboarded_after_its_read(cfg_factory, s2):
    """Under simulated streams, the onboard of a promoted block waits for its read from
    disk (S2); without S2 it reads the host slot first and the bytes are wrong."""
    rules = frozenset({"S2", "S4", "S5"} if s2 else {"S4", "S5"})
    cache = kvdist.testing.create(cfg_factory(gpu=24, host=8, disk=128, simulate_async=True),
                                  Seams(rules=rules))
    try:
        d = IntegrityDriver(cache)
        # Blocks of "a" pushed down to disk by a churn of other prompts.
        a = list(range(1000, 1016)) + [7]
        d.begin(); d.add("a", a); d.compute(); d.end(); d.release("a")  # noqa: E702
        for i in range(40):
            d.begin(); d.add(i, [i * 100 + j for j in range(16)] + [1]); d.compute(); d.end(); d.release(i)  # noqa: E702
        cache.synchronize()
        assert cache.prefetch("a2", a) == 4  # a's 4 full blocks, all on disk
        d.begin()
        assert d.add("a2", a) == 16
        d.compute()
        d.end()
        assert cache.stats()["hit_tokens"]["host"] == 16  # all 4 blocks onboarded from host
        assert (d.mismatched_tokens == 0) == s2, (d.mismatched_tokens, d.checked_tokens)
    finally:
        cache.close()


def test_no_disk_tier_spills_gpu_to_disk_without_host(cfg_factory):
    cache = kvdist.create(cfg_factory(gpu=24, host=0, disk=64, simulate_async=True))
    try:
        d = churn(cache, steps=120)
        s = cache.stats()
        assert cache.tiers == ("gpu", "disk")
        assert s["blocks_moved"]["spill"] > 0 and s["hit_tokens"]["disk"] > 0
        assert d.mismatched_tokens == 0, d.first_mismatch
    finally:
        cache.close()


@pytest.mark.gpu
@pytest.mark.parametrize("prefetch", [False, True], ids=["", "prefetch"])
def test_churn_on_cuda_with_pinned_host_tier(cfg_factory, prefetch):
    """The same churn with the GPU tier in CUDA memory and a pinned host tier (and with
    prompts prefetched: disk blocks promoted to the pinned host tier by disk workers)."""
    seams = Seams()
    cache = kvdist.testing.create(cfg_factory(gpu=24, host=8, disk=128, device="cuda"), seams)
    try:
        assert cache.device.type == "cuda" and seams.host.raw.is_pinned()
        d = churn(cache, prefetch=prefetch)
        s = cache.stats()
        tiers = ("gpu", "host") if prefetch else ("gpu", "host", "disk")
        assert all(s["hit_tokens"][t] > 0 for t in tiers), s["hit_tokens"]
        assert (s["blocks_moved"]["promote"] > 20) == prefetch, s["blocks_moved"]
        assert d.mismatched_tokens == 0, d.first_mismatch
        print(f"\nCUDA churn: {d.checked_tokens} reused tokens checked, 0 mismatched, "
              f"hits {s['hit_tokens']}, moved {s['blocks_moved']}, path {s['transfer_path']}")
    finally:
        cache.close()
