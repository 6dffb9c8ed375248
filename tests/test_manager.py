"""The single-rank cache with exact block ids: reuse, the eviction cascade, priorities,
errors. ``check_invariants`` runs after every operation."""

import pytest

import kvdist
import kvdist.testing
from kvdist.manager import token_array
from kvdist.testing import IntegrityDriver, Seams
from kvdist.transfer import DEMOTE


class Checked:
    """Runs the driver and checks the cache's invariants after every call; ``m`` is the
    cache's manager (through its seams), for assertions on exact slots."""

    def __init__(self, cache, seams: Seams):
        self.cache = cache
        self.m = seams.manager
        self.drv = IntegrityDriver(cache)

    def __getattr__(self, name):
        fn = getattr(self.drv, name)

        def call(*a, **k):
            out = fn(*a, **k)
            self.cache.check_invariants()
            return out
        return call

    def step(self, seq_id, tokens, priority=35, release=True):
        self.begin()
        reused = self.add(seq_id, tokens, priority)
        self.compute()
        self.end()
        if release:
            self.release(seq_id)
        return reused


def T(start, n=8):
    return list(range(start, start + n))


@pytest.fixture
def make(cfg_factory):
    caches = []

    def make(**kw):
        seams = Seams()
        c = kvdist.testing.create(cfg_factory(**kw), seams)
        caches.append(c)
        return c, Checked(c, seams)
    yield make
    for c in caches:
        c.close()


def test_reuse_exact_ids(make):
    cache, d = make(gpu=4)
    m = d.m
    assert d.step("a", T(0, 10), release=False) == 0
    assert m.seqs["a"].slots == [0, 1, 2]
    d.release("a")
    assert list(m.lru[0]) == [1, 0]  # the tail block is evicted first
    assert m.free[0].snapshot().tolist() == [2, 3]  # the partial block was freed
    assert d.step("b", T(0, 8) + [100, 101], release=False) == 8
    assert m.seqs["b"].slots == [0, 1, 2]
    cache.begin_step()
    with pytest.raises(kvdist.OutOfBlocksError) as ei:
        cache.add_sequence("c", T(50, 12))
    cache.end_step()
    assert (ei.value.needed, ei.value.available) == (3, 1)
    assert "c" not in m.seqs and m.free[0].snapshot().tolist() == [3]
    cache.check_invariants()
    assert d.drv.mismatched_tokens == 0 and d.drv.checked_tokens == 8


def test_at_least_one_token_is_computed(make):
    cache, d = make(gpu=4)
    d.step("a", T(0, 8))
    assert d.step("b", T(0, 8)) == 4  # 2 full blocks cached, only 1 may be reused
    assert d.step("c", T(0, 9)) == 8


def test_blocks_become_reusable_at_end_step(make):
    cache, d = make(gpu=8)
    d.begin()
    d.add("a", T(0, 8))
    assert d.add("b", T(0, 9)) == 0  # same step: nothing reusable yet
    d.compute()
    d.end()
    # a and b each filled the two blocks; b's copies are duplicates and stay private.
    m = d.m
    assert len(m.index) == 2
    d.release("a")
    d.release("b")
    assert m.free[0].snapshot().tolist()[:3] == [2, 3, 4]  # b's private copies were freed
    assert d.step("c", T(0, 9)) == 8


def test_release_in_the_same_step_is_deferred(make):
    cache, d = make(gpu=4)
    d.begin()
    d.add("a", T(0, 8))
    d.compute()
    d.release("a")
    assert len(d.m.index) == 0
    d.end()
    assert len(d.m.index) == 2
    assert d.step("b", T(0, 9)) == 8


def test_cascade_gpu_host_disk_exact(make):
    cache, d = make(gpu=3, host=2, disk=2)
    m = d.m
    assert m.space.base == (0, 3, 5)
    d.step("s1", T(0))
    assert list(m.lru[0]) == [1, 0]
    d.step("s2", T(100), release=False)
    assert m.seqs["s2"].slots == [1, 2]
    assert list(m.lru[1]) == [3]  # T1 block 1 went to host slot 3
    d.release("s2")
    d.step("s3", T(200), release=False)
    assert m.seqs["s3"].slots == [2, 0]
    assert list(m.lru[1]) == [4, 3] and list(m.lru[2]) == [5]
    d.release("s3")
    assert d.step("s4", T(0) + [99], release=False) == 8  # block 0 from host, block 1 from disk
    # fresh slots 2, 0, 1: the two cold blocks take 2 and 0, the lowest source (host
    # slot 4, block 0) into the lowest (0); block 2 is computed into slot 1
    assert m.seqs["s4"].slots == [0, 2, 1]
    s = cache.stats()
    assert s["hit_tokens"] == {"gpu": 0, "host": 4, "disk": 4}
    assert s["blocks_moved"] == {"offload": 6, "onboard": 1, "demote": 4, "spill": 0, "reload": 1,
                                 "promote": 0}
    assert s["dropped"] == 2
    assert s["bytes_offloaded"] == 6 * 512 and s["bytes_onboarded"] == 2 * 512
    assert s["blocks_used"] == {"gpu": 3, "host": 1, "disk": 1}
    assert d.drv.mismatched_tokens == 0 and d.drv.checked_tokens == 8


def test_priority_then_lru(make):
    cache, d = make(gpu=4)
    m = d.m
    d.step("low", T(0, 4) + [1], priority=10)  # block 0 cached, low priority
    d.step("high", T(100, 4) + [1], priority=80)  # block 2 cached
    d.step("mid", T(200, 4) + [1], priority=35)  # block 0? no: block 1 (free stack order)
    victims = list(m.lru[0])
    assert [m.meta.prio[s] for s in victims] == [10, 35, 80]
    # Two new blocks: the low and then the mid block go, the high one stays.
    d.step("new", T(300, 8))
    assert d.step("again-high", T(100, 4) + [2]) == 4
    assert d.step("again-low", T(0, 4) + [2]) == 0


def test_offload_min_priority_drops_instead(make):
    cache, d = make(gpu=2, host=4, offload_min_priority=50)
    d.step("low", T(0, 4) + [1], priority=10)
    d.step("high", T(100, 4) + [1], priority=60)
    d.step("fill", T(200, 8))  # evicts both GPU blocks
    s = cache.stats()
    assert s["blocks_moved"]["offload"] == 1 and s["dropped"] == 1
    assert d.step("x", T(100, 4) + [3]) == 4 and cache.stats()["hit_tokens"]["host"] == 4
    assert d.step("y", T(0, 4) + [3]) == 0


def test_reuse_disabled(make):
    cache, d = make(gpu=4, enable_reuse=False)
    d.step("a", T(0, 8))
    assert d.step("b", T(0, 9)) == 0
    assert len(d.m.index) == 0


def test_append_grows_and_registers(make):
    cache, d = make(gpu=4)
    d.begin()
    d.add("a", T(0, 3))
    d.compute()
    d.end()
    for tok in range(3, 9):
        d.begin()
        d.append("a", [tok])
        d.compute()
        d.end()
    assert d.m.seqs["a"].slots == [0, 1, 2]
    assert len(d.m.index) == 2
    d.release("a")
    assert d.step("b", T(0, 9)) == 8
    assert d.drv.mismatched_tokens == 0


def test_append_out_of_blocks_changes_nothing(make):
    cache, d = make(gpu=2)
    d.step("a", T(0, 8), release=False)
    cache.begin_step()
    with pytest.raises(kvdist.OutOfBlocksError, match="needs 1 GPU blocks but only 0"):
        cache.append_tokens("a", [1])
    cache.end_step()
    assert len(d.m.seqs["a"].tokens) == 8
    cache.check_invariants()


def test_bad_calls(make):
    cache, d = make(gpu=4)
    d.step("a", T(0, 3), release=False)
    cache.begin_step()
    with pytest.raises(ValueError, match="already"):
        cache.add_sequence("a", [1])
    with pytest.raises(ValueError, match="no tokens"):
        cache.add_sequence("b", [])
    with pytest.raises(ValueError, match="priority"):
        cache.add_sequence("b", [1], priority=101)
    cache.end_step()
    with pytest.raises(KeyError, match="unknown sequence 'zz'"):
        cache.release("zz")
    cache.check_invariants()


def test_block_table_padding_and_pool_shape(make):
    cache, d = make(gpu=8)
    d.begin()
    d.add("a", T(0, 9))
    d.add(7, T(50, 2))
    table = d.compute()
    assert table.dtype.is_floating_point is False and str(table.dtype) == "torch.int32"
    assert table.tolist() == [[0, 1, 2], [3, -1, -1]]
    assert tuple(cache.kv_pool(1).shape) == (8, 2, 4, 2, 8)
    with pytest.raises(IndexError):
        cache.kv_pool(2)


def test_demote_ahead_keeps_host_slots_free_exact(cfg_factory, tmp_path):
    """With ``disk.demote_ahead: 0.5`` of a 4-block host tier, end_step demotes the
    coldest host blocks until 2 host slots are free; the demoted blocks stay reusable."""
    cfg = cfg_factory(gpu=3, host=4, disk=4)
    cfg["cache"]["disk"]["demote_ahead"] = 0.5
    seams = Seams()
    cache = kvdist.testing.create(cfg, seams)
    try:
        d, m = Checked(cache, seams), seams.manager
        assert m.space.base == (0, 3, 7) and m.demote_ahead == 2
        d.step("s0", T(0))
        d.step("s1", T(100))
        assert list(m.lru[1]) == [3] and m.free[1].snapshot().tolist() == [4, 5, 6]
        d.step("s2", T(200))  # offloads fill host slots 4, 5: three used, so 3 goes to disk
        assert list(m.lru[1]) == [4, 5] and list(m.lru[2]) == [7]
        # Oldest free first (FreeQueue): 3, whose disk write was just queued, is reused last.
        assert m.free[1].snapshot().tolist() == [6, 3]
        d.step("s3", T(300))  # two more offloads (6, 3): the two coldest (4, 5) go to disk
        assert list(m.lru[1]) == [6, 3] and list(m.lru[2]) == [7, 8, 9]
        assert cache.stats()["blocks_moved"] == {"offload": 5, "onboard": 0, "demote": 3, "spill": 0,
                                                 "reload": 0, "promote": 0}
        assert d.step("again", T(0) + [99]) == 8  # s0's blocks, demoted ahead, come back from disk
        assert cache.stats()["hit_tokens"] == {"gpu": 0, "host": 0, "disk": 8}
        assert d.drv.mismatched_tokens == 0 and d.drv.checked_tokens == 8
    finally:
        cache.close()


def test_prefetch_promotes_a_prompts_disk_blocks_exact(cfg_factory):
    """prefetch moves the disk blocks of the prompt's reusable prefix into the host tier
    (evicting the coldest host block outside the prefix, to disk); its add_sequence then
    reuses them as host hits. The prefix's blocks become the host tier's most recently
    used, its tail the older."""
    seams = Seams(batch_log=[])
    cache = kvdist.testing.create(cfg_factory(gpu=3, host=2, disk=2), seams)
    try:
        d, m = Checked(cache, seams), seams.manager
        for name, start in (("s1", 0), ("s2", 100), ("s3", 200)):
            d.step(name, T(start))
        # T(0): block 0 in host slot 4, block 1 on disk (slot 5); host slot 3 holds another.
        assert list(m.lru[1]) == [4, 3] and list(m.lru[2]) == [5] and m.free[2].snapshot().tolist() == [6]
        assert m.index.match(m.block_hashes(token_array(T(0)))) == [4, 5]
        log = len(seams.batch_log)
        assert cache.prefetch("s4", T(0) + [99]) == 1
        cache.check_invariants()
        assert m.index.match(m.block_hashes(token_array(T(0)))) == [4, 3]  # block 1 now in host slot 3
        assert list(m.lru[1]) == [3, 4] and list(m.lru[2]) == [6] and m.free[2].snapshot().tolist() == [5]
        cache.synchronize()
        assert seams.batch_log[log:] == [("demote", [0], [1]), ("promote", [0], [0])]
        assert cache.prefetch("s4", T(0) + [99]) == 0  # nothing left on disk
        assert d.step("s4", T(0) + [99]) == 8
        s = cache.stats()
        assert s["hit_tokens"] == {"gpu": 0, "host": 8, "disk": 0}
        assert s["blocks_moved"]["promote"] == 1 and s["blocks_moved"]["reload"] == 0
        assert d.drv.mismatched_tokens == 0 and d.drv.checked_tokens == 8
    finally:
        cache.close()


def test_prefetch_follows_the_recompute_policy(cfg_factory):
    """A disk the agreed figures call slower than recomputing is not prefetched from."""
    seams = Seams()
    cache = kvdist.testing.create(cfg_factory(gpu=3, host=2, disk=2), seams)
    try:
        d, m = Checked(cache, seams), seams.manager
        for name, start in (("s1", 0), ("s2", 100), ("s3", 200)):
            d.step(name, T(start))
        # host 1 GB/s, disk 1 B/s, prefill 1,000 tokens/s: a disk block costs far more
        m.policy.agree([10**9, 1, 1000])
        assert cache.prefetch("s4", T(0) + [99]) == 0
        assert cache.stats()["blocks_moved"]["promote"] == 0
        assert d.step("s4", T(0) + [99]) == 4  # block 0 from host, block 1 recomputed
    finally:
        cache.close()


def test_offloads_do_not_reuse_host_slots_a_disk_write_is_still_reading(cfg_factory):
    """A host slot freed by a demotion is read by a disk worker until its write ends: the
    host tier hands out its oldest free slots first, so the next step's offloads land in
    slots freed earlier, not in the ones just demoted (with a stack, last freed first
    out, each of these offloads would wait on the host for a disk write)."""
    cfg = cfg_factory(gpu=2, host=8, disk=32)
    cfg["cache"]["disk"]["demote_ahead"] = 0.5
    seams = Seams(batch_log=[])
    cache = kvdist.testing.create(cfg, seams)
    try:
        d, log = Checked(cache, seams), seams.batch_log
        demoted_last_step: set[int] = set()
        steps_checked = 0
        for i in range(12):
            start = len(log)
            d.step(f"s{i}", T(100 * i))
            batches = log[start:]
            offloaded = {s for name, _, dst in batches if name == "offload" for s in dst}
            if demoted_last_step:
                assert offloaded, f"step {i}: expected offloads into the host tier"
                reused = sorted(offloaded & demoted_last_step)
                assert not reused, f"step {i}: offload into host slots {reused} still being demoted"
                steps_checked += 1
            demoted_last_step = {s for name, src, _ in batches if name == "demote" for s in src}
        assert steps_checked >= 4, f"only {steps_checked} steps followed a demotion"
        assert cache.stats()["blocks_moved"]["demote"] >= 8
        assert d.drv.mismatched_tokens == 0
    finally:
        cache.close()


def test_demotions_are_written_in_batches_of_bounded_bytes(cfg_factory, monkeypatch):
    """A later copy into a demoted host slot waits for that slot's whole disk batch: the
    engine submits demotions in batches of DEMOTE_BATCH_BYTES (here 2 blocks)."""
    import kvdist.manager
    cfg = cfg_factory(gpu=4, host=12, disk=32)
    cfg["cache"]["disk"]["demote_ahead"] = 0.75  # 9 free host slots: 3 demoted a step
    seams = Seams(batch_log=[])
    cache = kvdist.testing.create(cfg, seams)
    try:
        block = seams.manager.layout.bytes_per_block
        monkeypatch.setitem(seams.engine.batch_limits, DEMOTE, 2)
        assert kvdist.manager.DEMOTE_BATCH_BYTES // block > 2  # the default would not split
        d = Checked(cache, seams)
        for i in range(12):
            d.step(f"s{i}", T(100 * i, 12))  # 3 blocks
        demotes = [(src, dst) for name, src, dst in seams.batch_log if name == "demote"]
        assert demotes and all(len(src) <= 2 for src, _ in demotes), [len(s) for s, _ in demotes]
        assert sum(len(s) for s, _ in demotes) == cache.stats()["blocks_moved"]["demote"] >= 8
        assert d.step("again", T(0, 12) + [99]) == 12  # s0's blocks come back from disk intact
        assert d.drv.mismatched_tokens == 0
    finally:
        cache.close()


# -- admission: plan, then commit ----------------------------------------------------------------
def _cascade_setup(make):
    """test_cascade_gpu_host_disk_exact up to s4: T(0)'s block 0 on host, block 1 on disk."""
    cache, d = make(gpu=3, host=2, disk=2)
    for name, start in (("s1", 0), ("s2", 100), ("s3", 200)):
        d.step(name, T(start))
    return cache, d


def test_a_plan_changes_nothing_and_its_commit_does_what_it_says(make):
    cache, d = _cascade_setup(make)
    m = d.m
    d.begin()
    before, generation = m.state_digest(), m.generation
    plan = m.plan("s4", T(0) + [99])
    assert m.state_digest() == before and m.generation == generation
    assert (len(plan.hashes), plan.reusable, plan.matched, plan.hits_per_tier()) == (2, 2, 2, (0, 1, 1))
    assert (plan.on_gpu, plan.need, plan.available, plan.fits, plan.remote_hashes) == (0, 3, 3, True, [])
    assert m.commit(plan) == 8 and m.seqs["s4"].slots == [0, 2, 1]
    cache.check_invariants()
    assert cache.stats()["hit_tokens"] == {"gpu": 0, "host": 4, "disk": 4}
    d.end()


def test_a_plan_that_does_not_fit_raises_at_commit_and_changes_nothing(make):
    cache, d = make(gpu=2)
    d.step("a", T(0, 5), release=False)
    d.begin()
    plan = d.m.plan("b", T(50, 5))
    assert (plan.need, plan.available, plan.fits) == (2, 0, False)
    before = d.m.state_digest()
    with pytest.raises(kvdist.OutOfBlocksError, match="needs 2 GPU blocks but only 0"):
        d.m.commit(plan)
    assert d.m.state_digest() == before
    cache.check_invariants()
    d.end()


def test_a_stale_plan_is_refused_and_refresh_plans_it_again(make):
    cache, d = make(gpu=4)
    m = d.m
    d.step("a", T(0, 9))  # blocks 0, 1 cached and evictable; 2, 3 free
    d.begin()
    plan = m.plan("b", T(0, 9))
    assert (plan.hits.tolist(), plan.need, plan.available) == ([0, 1], 1, 2)
    assert m.refresh(plan) is plan
    assert d.add("c", T(0, 5)) == 4  # pins block 0, takes a free slot
    before = m.state_digest()
    with pytest.raises(AssertionError, match="plan of sequence 'b' is stale"):
        m.commit(plan)
    assert m.state_digest() == before
    fresh = m.refresh(plan)
    assert fresh is not plan and fresh.digests is plan.digests  # not hashed again
    assert (fresh.hits.tolist(), fresh.need, fresh.available) == ([0, 1], 1, 1)
    assert m.commit(fresh) == 8
    cache.check_invariants()
    d.end()


def test_a_plan_does_not_outlive_its_step(make):
    # The recompute policy's agreed figures change at end_step: a plan's cut is for its step.
    cache, d = make(gpu=4)
    d.step("a", T(0, 9))
    d.begin()
    plan = d.m.plan("b", T(0, 9))
    d.end()
    d.begin()
    with pytest.raises(AssertionError, match="stale"):
        d.m.commit(plan)
    assert d.m.commit(d.m.refresh(plan)) == 8
    cache.check_invariants()
    d.end()


def test_landing_slots_make_a_plan_stale(make):
    from kvdist.blocks import GPU
    from kvdist.landing import ManagerSlots

    cache, d = make(gpu=4)
    m = d.m
    slots = ManagerSlots(m)
    d.step("a", T(0, 9))
    d.begin()
    plan = m.plan("b", T(0, 9))
    assert plan.available == 2
    got = slots.reserve(GPU, 1)
    assert got == [2] and m.refresh(plan) is not plan and m.refresh(plan).available == 1
    plan = m.refresh(plan)
    assert slots.land(2, m.block_hashes(token_array(T(40, 4)))[0])
    assert m.refresh(plan) is not plan and m.refresh(plan).available == 2
    plan = m.refresh(plan)
    [s] = slots.reserve(GPU, 1)
    plan = m.refresh(plan)
    slots.release(s)
    assert m.refresh(plan) is not plan
    cache.check_invariants()
    d.end()
