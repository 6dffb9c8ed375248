"""Rule S3 on CPU with simulated streams: a host buffer feeding a queued host->device
copy is never rewritten before that copy runs, whatever the scheduler (running one
step ahead) does to its tables meanwhile.

The four scenarios of the issue each hold the simulated compute stream, queue a staged
copy, overwrite on the host, stage on until the 4-slot ring wraps onto the first copy's
slot (so the ring's wait is what protects it), release the stream and compare the
device result with a baseline taken before the overwrite. Each runs protected and with the protection off
(``protect=False``: one persistent buffer), where it must corrupt."""

import random

import numpy as np
import pytest
import torch

import kvdist
import kvdist.testing
from kvdist.staging import ImmediateH2D, SimH2D, Stager, TableRows
from kvdist.staging.stager import DEFAULT_SLOTS
from kvdist.testing import IntegrityDriver, Seams
from kvdist.transfer import SimDeadlock, SimExecutor

PROTECT = pytest.mark.parametrize("protect", [True, False], ids=["protected", "rule-off-one-buffer"])


def T(start, n):
    return list(range(start, start + n))


def host_view(seams: Seams, ids):
    """The table as the scheduler's sequences say it is right now (independent of staging)."""
    rows = [list(seams.manager.seqs[i].slots) for i in ids]
    width = max(len(r) for r in rows)
    return torch.tensor([r + [-1] * (width - len(r)) for r in rows], dtype=torch.int32)


def wrap_ring(stage, ex, staged: int) -> None:
    """Stage until the ring wraps: the slots left while the device is still held, then
    one more once it is released, which reuses the slot of the first copy staged. From
    there only the ring's wait for that slot's queued copy keeps the first one intact."""
    for _ in range(DEFAULT_SLOTS - staged):
        stage()
    ex.release("compute")
    stage()


def intact(protect, got, baseline):
    """Protected: the device result equals the baseline. Rule off: the overwrite reached it."""
    got = got.cpu()
    if protect:
        assert torch.equal(got, baseline), f"{got.tolist()} != {baseline.tolist()}"
    else:
        assert not torch.equal(got, baseline), "the rule-off case was expected to corrupt"


@pytest.fixture
def sim_cache(cfg_factory):
    caches = []

    def make(protect=True, table_rows=None, **kw):
        seams = Seams(protect_staging=protect)
        if table_rows:
            seams.table_rows = table_rows
        cache = kvdist.testing.create(cfg_factory(simulate_async=True, **{"gpu": 32, **kw}), seams)
        caches.append(cache)
        return cache, seams
    yield make
    for c in caches:
        c.close()


# -- the four scenarios through the façade (1, 3, 4) and the stager (2) -------------------------
@PROTECT
def test_1_table_row_rewritten_after_copy_queued(sim_cache, protect):
    cache, seams = sim_cache(protect)
    ex = seams.executor
    cache.begin_step()
    cache.add_sequence("a", T(0, 6))
    cache.add_sequence("b", T(100, 9))
    ex.hold("compute")  # the device is still busy with earlier work
    table = cache.block_table(["a", "b"])
    baseline = host_view(seams, ["a", "b"])
    assert baseline.tolist() == [[0, 1, -1], [2, 3, 4]]
    cache.end_step()
    # The scheduler prepares the next step before the copy ran: "a" grows, its row changes.
    cache.begin_step()
    cache.append_tokens("a", [7, 8, 9])
    following = cache.block_table(["a", "b"])
    assert host_view(seams, ["a", "b"]).tolist() == [[0, 1, 5], [2, 3, 4]]
    cache.check_invariants()
    wrap_ring(lambda: cache.block_table(["b", "a"]), ex, staged=2)
    ex.drain("compute")
    assert cache.stats()["staging"]["ring_waits"] == (1 if protect else 0)
    assert following.tolist() == [[0, 1, 5], [2, 3, 4]] or not protect  # rule off: all share a buffer
    intact(protect, table, baseline)


@PROTECT
def test_2_gather_indices_rewritten(protect):
    ex = SimExecutor(None)
    stager = Stager(SimH2D(ex), protect=protect)
    pool = torch.arange(64 * 3, dtype=torch.int64).view(64, 3)  # rows a gather kernel reads
    picked = {}
    idx = np.array([5, 9, 2, 40, 17], dtype=np.int64)  # the scheduler's copy-index slice
    ex.hold("compute")
    dev_idx = stager.stage(idx)
    ex.kernel(lambda: picked.__setitem__("N", pool.index_select(0, dev_idx)))
    baseline = pool[[5, 9, 2, 40, 17]]
    # Next step's indices, written into the same slice and staged before the gather ran.
    idx[:] = [1, 2, 3, 4, 63]
    dev_next = stager.stage(idx)
    ex.kernel(lambda: picked.__setitem__("N+1", pool.index_select(0, dev_next)))
    stager.check_invariants()
    idx[:] = [0, 0, 0, 0, 0]  # and the steps after that: the ring wraps onto "N"'s slot
    wrap_ring(lambda: stager.stage(idx), ex, staged=2)
    assert stager.counters.ring_waits == (1 if protect else 0)
    ex.drain("compute")
    assert torch.equal(picked["N+1"], pool[[1, 2, 3, 4, 63]]) or not protect
    intact(protect, picked["N"], baseline)


@PROTECT
def test_3_released_row_rebound_before_copy_ran(sim_cache, protect):
    cache, seams = sim_cache(protect, table_rows=2)  # two rows: "c" must take "a"'s
    ex, rows = seams.executor, seams.manager.host_table
    cache.begin_step()
    cache.add_sequence("a", T(0, 8))
    cache.add_sequence("b", T(100, 5))
    ex.hold("compute")
    table = cache.block_table(["a", "b"])
    baseline = host_view(seams, ["a", "b"])
    assert baseline.tolist() == [[0, 1], [2, 3]]
    row_a = rows.row_of("a")
    cache.end_step()
    cache.begin_step()
    cache.release("a")  # its full blocks stay cached; its table row is free
    cache.add_sequence("c", T(200, 8))
    following = cache.block_table(["c", "b"])
    assert rows.row_of("c") == row_a and rows.row_of("a") is None
    assert host_view(seams, ["c", "b"]).tolist() == [[4, 5], [2, 3]]
    cache.check_invariants()
    wrap_ring(lambda: cache.block_table(["b", "c"]), ex, staged=2)
    assert cache.stats()["staging"]["ring_waits"] == (1 if protect else 0)
    ex.drain("compute")
    assert following.tolist() == [[4, 5], [2, 3]] or not protect
    intact(protect, table, baseline)


@PROTECT
def test_4_second_staged_copy_queued_behind_first(sim_cache, protect):
    cache, seams = sim_cache(protect)
    ex = seams.executor
    cache.begin_step()
    cache.add_sequence("a", T(0, 10))
    cache.add_sequence("b", T(100, 3))
    ex.hold("compute")
    first = cache.block_table(["a", "b"])
    baseline = host_view(seams, ["a", "b"])
    assert baseline.tolist() == [[0, 1, 2], [3, -1, -1]]
    cache.end_step()
    cache.begin_step()
    second = cache.block_table(["b"])  # other contents, other shape, same stream behind the first
    assert ex.streams["compute"].last is not None and not ex.streams["compute"].last.done
    wrap_ring(lambda: cache.block_table(["b", "a"]), ex, staged=2)
    assert cache.stats()["staging"]["ring_waits"] == (1 if protect else 0)
    ex.drain("compute")
    assert second.tolist() == [[3]] or not protect
    intact(protect, first, baseline)


# -- the ring -------------------------------------------------------------------------------------
def test_ring_exhausted_waits_for_oldest_copy_never_reuses_it():
    ex = SimExecutor(None)
    stager = Stager(SimH2D(ex), slots=2)
    a, b, c = (np.full(5, v, dtype=np.int32) for v in (1, 2, 3))
    ex.hold("compute")
    da, db = stager.stage(a), stager.stage(b)
    assert stager.in_flight() == 2
    with pytest.raises(SimDeadlock):  # the slot of "a" is still being copied: wait, not reuse
        stager.stage(c)
    assert stager.counters.ring_waits == 1
    ex.release("compute")
    dc = stager.stage(c)  # waits for the copy of "a" (the oldest), then reuses its slot
    assert stager.counters.ring_waits == 2 and stager.counters.host_syncs == 2
    ex.drain("compute")
    assert da.tolist() == [1] * 5 and db.tolist() == [2] * 5 and dc.tolist() == [3] * 5
    stager.check_invariants()


def test_ring_grows_for_a_bigger_batch_then_steady_state_allocates_and_waits_nothing():
    ex = SimExecutor(None)
    stager = Stager(SimH2D(ex), slots=4)
    rng = np.random.default_rng(0)
    previous = None
    shapes = [(4, 8)] * 6 + [(256, 128)] * 6 + [(256, 130)] * 40  # a batch outgrows the ring
    allocs_before_steady = None
    for i, shape in enumerate(shapes):
        if i == 12:
            allocs_before_steady = stager.counters.pinned_allocs
        arr = rng.integers(-1, 1 << 20, shape, dtype=np.int32)
        dev = stager.stage(arr)
        if previous is not None:  # one step ahead: the previous step runs after this one is staged
            ex.force(previous[0])
            assert np.array_equal(previous[1].numpy(), previous[2])
        op = ex.kernel(lambda: None)
        previous = (op, dev, arr.copy())
        stager.check_invariants()
    c = stager.counters
    assert allocs_before_steady == 8  # 4 slots for the small batch, 4 regrown for the big one
    assert c.pinned_allocs == allocs_before_steady  # 256 x 130 fits the headroom: none in steady state
    assert c.ring_waits == 0 and c.host_syncs == 0
    assert c.stages == len(shapes)


def test_immediate_path_copies_at_once():
    stager = Stager(ImmediateH2D())
    arr = np.arange(12, dtype=np.int32).reshape(3, 4)
    dev = stager.stage(arr)
    arr[:] = -5
    assert dev.tolist() == np.arange(12).reshape(3, 4).tolist()
    assert stager.stats()["path"] == "immediate" and stager.in_flight() == 0


def test_host_buffer_protocol_is_checked():
    stager = Stager(ImmediateH2D())
    buf = stager.host_buffer((2, 2), np.int32)
    with pytest.raises(AssertionError, match="twice"):
        stager.host_buffer((2, 2), np.int32)
    with pytest.raises(AssertionError, match="last host_buffer"):
        stager.upload_buffer(np.zeros((2, 2), np.int32))
    buf[:] = 7
    assert stager.upload_buffer(buf).tolist() == [[7, 7], [7, 7]]


# -- the persistent host table ------------------------------------------------------------------------
class Seq:
    def __init__(self, slots):
        self.slots = list(slots)


def test_table_rows_follow_sequences_rebind_and_grow():
    rows = TableRows(rows=2, width=2)
    seqs = {"a": Seq([4, 5]), "b": Seq([7])}
    idx, width = rows.rows_for(["a", "b"], seqs)
    out = np.empty((2, width), np.int32)
    assert rows.gather(idx, width, out).tolist() == [[4, 5], [7, -1]]
    rows.check_invariants()
    seqs["a"].slots += [9, 10, 11]  # grows past the table's width
    idx, width = rows.rows_for(["b", "a"], seqs)
    assert rows.gather(idx, width, np.empty((2, width), np.int32)).tolist() == \
        [[7, -1, -1, -1, -1], [4, 5, 9, 10, 11]]
    assert rows.table.shape[1] >= 5
    rows.check_invariants()
    row_a = rows.row_of("a")
    del seqs["a"]  # released
    seqs["c"] = Seq([1])
    idx, width = rows.rows_for(["c"], seqs)  # no free row: "a"'s is reclaimed, cleared, rebound
    assert rows.row_of("c") == row_a and rows.row_of("a") is None and rows.reclaimed == 1
    assert rows.gather(idx, width, np.empty((1, 1), np.int32)).tolist() == [[1]]
    assert rows.table[row_a].tolist()[1:] == [-1] * (rows.table.shape[1] - 1)
    rows.check_invariants()
    seqs["b"] = Seq([3, 3, 3])  # the id "b" released and added again: a new sequence object
    idx, width = rows.rows_for(["b", "c"], seqs)
    assert rows.gather(idx, width, np.empty((2, 3), np.int32)).tolist() == [[3, 3, 3], [1, -1, -1]]
    rows.check_invariants()
    for i in range(5):  # every row live: the table doubles its rows
        seqs[i] = Seq([i])
    idx, width = rows.rows_for([0, 1, 2, 3, 4, "b", "c"], seqs)
    assert rows.table.shape[0] >= 7 and len(set(idx.tolist())) == 7
    rows.check_invariants()
    with pytest.raises(KeyError, match="unknown sequence 'zz'"):
        rows.rows_for(["zz"], seqs)


# -- the scheduler one step ahead, end to end -------------------------------------------------------
def overlap_churn(cache, steps=160, seed=3):
    """Up to four live sequences decode together; new prompts reuse earlier ones; the
    forward pass of step N runs only after step N+1 has been prepared and staged."""
    d = IntegrityDriver(cache, overlap=True)
    rng = random.Random(seed)
    systems = [[rng.randrange(100) for _ in range(12)] for _ in range(3)]
    live, history, next_id = [], [], 0
    for _ in range(steps):
        d.begin()
        for sid in live:
            d.append(sid, [rng.randrange(100) for _ in range(rng.randrange(1, 4))])
        if len(live) < 4:
            base = rng.choice(history)[:24] if history and rng.random() < 0.5 else rng.choice(systems)
            d.add(next_id, base + [rng.randrange(100) for _ in range(rng.randrange(1, 8))],
                  priority=rng.choice([10, 35, 80]))
            live.append(next_id)
            next_id += 1
        d.compute()
        d.end()
        if len(live) == 4 or rng.random() < 0.3:
            sid = live.pop(rng.randrange(len(live)))
            history.append(list(d.seqs[sid].tokens))
            d.release(sid)
    d.drain()
    cache.synchronize()
    return d


def test_overlap_churn_is_exact_and_steady_state_stages_for_free(cfg_factory):
    cache = kvdist.create(cfg_factory(gpu=48, host=16, disk=128, simulate_async=True))
    try:
        d = overlap_churn(cache)
        s = cache.stats()
        assert d.mismatched_tokens == 0, d.first_mismatch
        assert d.checked_tokens > 1000
        assert all(s["hit_tokens"][t] > 0 for t in ("gpu", "host", "disk")), s["hit_tokens"]
        st = s["staging"]
        assert st["stages"] == 160 and st["ring_waits"] == 0 and st["host_syncs"] == 0
        assert st["pinned_allocs"] == st["slots"] and st["path"] == "simulated" and not st["pinned"]
        cache.check_invariants()
    finally:
        cache.close()


@pytest.mark.parametrize("what", ["staging-one-buffer", "S4-off"])
def test_overlap_churn_rule_off_corrupts(cfg_factory, what):
    """With the scheduler a step ahead, one reused staging buffer (S3 off) or copies that do
    not wait for the previous step's kernels (S4 off) corrupt the KV bytes."""
    seams = Seams(rules=frozenset({"S2", "S5"})) if what == "S4-off" else Seams(protect_staging=False)
    # The simulated copies run as late as the rules allow, and a missing S4 wait shows when
    # S5 forces a whole step's copies at block_table; by layer group, the next step's
    # offloads would run only when its own pass reads them, after the late kernel anyway.
    cache = kvdist.testing.create(cfg_factory(gpu=48, host=16, disk=128, simulate_async=True,
                                              layer_groups=1), seams)
    try:
        d = overlap_churn(cache)
        assert d.mismatched_tokens > 0
    finally:
        cache.close()


def test_stats_expose_staging(cfg_factory):
    cache = kvdist.create(cfg_factory(gpu=8))
    try:
        cache.begin_step()
        cache.add_sequence(1, T(0, 5))
        assert cache.block_table([1]).tolist() == [[0, 1]]
        cache.end_step()
        st = cache.stats()["staging"]
        assert st == {"path": "immediate", "pinned": False, "protect": True, "slots": 4, "stages": 1,
                      "bytes_staged": 8, "pinned_allocs": 1, "pinned_bytes": 4096, "ring_waits": 0,
                      "host_syncs": 0, "in_flight": 0}
    finally:
        cache.close()


def test_gather_scratch_stays_bounded_when_the_width_changes():
    """Regression: the gather scratch once doubled on every width change (24 GiB after
    a thousand requests of the main job)."""
    from kvdist.staging.rows import TableRows

    class S:
        def __init__(self, n):
            self.slots = list(range(n))

    tr = TableRows(rows=4, width=2)
    seqs = {i: S(1 + i) for i in range(4)}
    for width in range(2, 60):
        seqs[3].slots = list(range(width))  # the widest row grows ...
        tr.rows_for([3], seqs)
        rows, w = tr.rows_for([0, 1], seqs)  # ... and a batch without it is gathered
        out = np.empty((len(rows), w), np.int32)
        tr.gather(rows, w, out)
        assert out.tolist() == [[0, -1], [0, 1]]
        assert tr._scratch.shape[0] <= tr.table.shape[0]
