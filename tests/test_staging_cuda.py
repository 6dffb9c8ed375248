"""Rule S3 on a GPU: the four staging races of tests/test_staging.py with the compute
stream held by a deterministic gate (a one-thread kernel spinning on a flag in mapped
pinned memory, opened by a host write: no sleeps), plus the steady state (no pinned
allocation, no host synchronization). Skipped without CUDA."""

import numpy as np
import pytest
import torch

import kvdist
import kvdist.testing
from kvdist.staging import CudaH2D, Stager
from kvdist.testing import Seams

from .cuda_gate import SpinGate
from .test_staging import PROTECT, T, host_view, intact

pytestmark = pytest.mark.gpu

@pytest.fixture(scope="module")
def gate():
    return SpinGate()


@pytest.fixture
def cuda_cache(cfg_factory):
    caches = []

    def make(protect=True, table_rows=None):
        seams = Seams(protect_staging=protect)
        if table_rows:
            seams.table_rows = table_rows
        cache = kvdist.testing.create(cfg_factory(gpu=32, device="cuda"), seams)
        caches.append(cache)
        return cache, seams
    yield make
    for c in caches:
        c.close()


def gated(gate, fn):
    """Run ``fn`` with the compute stream (made current) held by the gate; open it, wait."""
    stream = torch.cuda.Stream()
    gate.close(stream)
    try:
        with torch.cuda.stream(stream):
            out = fn()
    finally:
        gate.open()
    gate.check()
    return out


@PROTECT
def test_1_table_row_rewritten_after_copy_queued(cuda_cache, gate, protect):
    cache, seams = cuda_cache(protect)

    def steps():
        cache.begin_step()
        cache.add_sequence("a", T(0, 6))
        cache.add_sequence("b", T(100, 9))
        table = cache.block_table(["a", "b"])
        baseline = host_view(seams, ["a", "b"])
        cache.end_step()
        cache.begin_step()
        cache.append_tokens("a", [7, 8, 9])  # "a" grows: its row is rewritten
        following = cache.block_table(["a", "b"])
        return table, baseline, following

    table, baseline, following = gated(gate, steps)
    assert baseline.tolist() == [[0, 1, -1], [2, 3, 4]]
    assert following.cpu().tolist() == [[0, 1, 5], [2, 3, 4]]
    intact(protect, table, baseline)


@PROTECT
def test_2_gather_indices_rewritten(gate, protect):
    dev = torch.device("cuda")
    stager = Stager(CudaH2D(dev), protect=protect)
    pool = torch.arange(64 * 3, dtype=torch.int64, device=dev).view(64, 3)
    idx = np.array([5, 9, 2, 40, 17], dtype=np.int64)
    pool.index_select(0, torch.zeros(1, dtype=torch.int64, device=dev))  # load the kernel now

    def steps():
        d_idx = stager.stage(idx)
        picked = pool.index_select(0, d_idx)  # the gather kernel, queued behind the copy
        idx[:] = [1, 2, 3, 4, 63]  # the scheduler's next indices ...
        d_next = stager.stage(idx)  # ... staged before the gather ran
        return picked, pool.index_select(0, d_next)

    picked, picked_next = gated(gate, steps)
    assert picked_next.cpu().tolist() == pool.cpu()[[1, 2, 3, 4, 63]].tolist()
    intact(protect, picked, pool.cpu()[[5, 9, 2, 40, 17]])


@PROTECT
def test_3_released_row_rebound_before_copy_ran(cuda_cache, gate, protect):
    cache, seams = cuda_cache(protect, table_rows=2)  # two rows: "c" must take "a"'s
    rows = seams.manager.host_table

    def steps():
        cache.begin_step()
        cache.add_sequence("a", T(0, 8))
        cache.add_sequence("b", T(100, 5))
        table = cache.block_table(["a", "b"])
        baseline = host_view(seams, ["a", "b"])
        row_a = rows.row_of("a")
        cache.end_step()
        cache.begin_step()
        cache.release("a")
        cache.add_sequence("c", T(200, 8))
        following = cache.block_table(["c", "b"])
        assert rows.row_of("c") == row_a
        return table, baseline, following

    table, baseline, following = gated(gate, steps)
    assert baseline.tolist() == [[0, 1], [2, 3]]
    assert following.cpu().tolist() == [[4, 5], [2, 3]]
    intact(protect, table, baseline)


@PROTECT
def test_4_second_staged_copy_queued_behind_first(cuda_cache, gate, protect):
    cache, seams = cuda_cache(protect)

    def steps():
        cache.begin_step()
        cache.add_sequence("a", T(0, 10))
        cache.add_sequence("b", T(100, 3))
        first = cache.block_table(["a", "b"])
        baseline = host_view(seams, ["a", "b"])
        cache.end_step()
        cache.begin_step()
        second = cache.block_table(["b"])
        return first, baseline, second

    first, baseline, second = gated(gate, steps)
    assert baseline.tolist() == [[0, 1, 2], [3, -1, -1]]
    assert second.cpu().tolist() == [[3]]
    intact(protect, first, baseline)


def test_ring_exhausted_waits_for_the_oldest_copy(gate):
    """Two stages fill a two-slot ring while the stream is held; a third, once the gate is
    open, reuses the oldest slot only after its copy ran (waiting, counted, if it had
    not), and every table arrives intact."""
    dev = torch.device("cuda")
    stager = Stager(CudaH2D(dev), slots=2)
    stream = torch.cuda.Stream()
    gate.close(stream)
    try:
        with torch.cuda.stream(stream):
            a = stager.stage(np.full(8, 1, dtype=np.int32))
            b = stager.stage(np.full(8, 2, dtype=np.int32))
        assert stager.in_flight() == 2 and stager.counters.ring_waits == 0
    finally:
        gate.open()
    with torch.cuda.stream(stream):
        c = stager.stage(np.full(8, 3, dtype=np.int32))  # slot of "a": done now, or waited for
    gate.check()
    assert a.cpu().tolist() == [1] * 8 and b.cpu().tolist() == [2] * 8 and c.cpu().tolist() == [3] * 8
    assert stager.counters.ring_waits == stager.counters.host_syncs <= 1
    stager.check_invariants()


def test_steady_state_stages_without_allocation_or_host_sync():
    """256 sequences x 128 blocks, a table every step: after warm-up no pinned allocation,
    no ring wait, and no synchronizing CUDA call (torch's sync debug mode would raise)."""
    seams = Seams()
    cache = kvdist.testing.create({"model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
                                   "cache": {"tokens_per_block": 16, "device": "cuda",
                                             "gpu": {"blocks": 256 * 136}}}, seams)
    try:
        ids = list(range(256))
        rng = np.random.default_rng(0)
        cache.begin_step()
        for i in ids:
            cache.add_sequence(i, rng.integers(0, 30000, 128 * 16 - 8).tolist())
        cache.block_table(ids)
        cache.end_step()

        def step(t):
            cache.begin_step()
            for i in ids:
                cache.append_tokens(i, [t])
            table = cache.block_table(ids)
            cache.end_step()
            return table

        for t in range(8):  # warm-up: every slot grows to the table's size once
            step(t)
        torch.cuda.synchronize()
        before = cache.stats()["staging"]
        tables = []
        torch.cuda.set_sync_debug_mode("error")
        try:
            for t in range(8, 40):
                tables.append(step(t))
        finally:
            torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        after = cache.stats()["staging"]
        assert after["pinned_allocs"] == before["pinned_allocs"]
        assert after["ring_waits"] == before["ring_waits"] == 0
        assert after["host_syncs"] == before["host_syncs"] == 0
        assert after["pinned"] and after["stages"] - before["stages"] == 32
        assert torch.equal(tables[-1].cpu(), host_view(seams, ids))
    finally:
        cache.close()
