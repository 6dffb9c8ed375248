"""A prefetch's disk reads across the ranks of a TP group: the last rank's reads are held
(its promotions' simulated stream), the others' run. No rank admits the request until
every rank has its reads: ``prefetch_ready`` is the group's answer, agreed at end_step,
and turns True on every rank at the same step once the last rank's reads ran."""

import pytest

import kvdist
from kvdist.seams import Seams
from kvdist.testing import IntegrityDriver
from tests.conftest import make_cfg
from tests.mpi.test_sim import shared_dir
from tests.test_disk_loads import A, _on_disk

pytestmark = pytest.mark.mpi


def test_every_rank_waits_for_the_slowest_rank_s_reads(tmp_path_factory):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    block = 2 * 2 * 4 * 2 * 8 * 2  # conftest's geometry
    cfg = kvdist.load_config(make_cfg(cache={
        "gpu": {"blocks": 24}, "host": {"bytes": 8 * block}, "simulate_async": True,
        "disk": {"path": shared_dir(tmp_path_factory, "loads"), "bytes": 128 * block},
        "offload_min_priority": 36, "recompute_when_faster": False}))
    seams = Seams()
    cache = kvdist.testing.create(cfg, seams)
    slow = world.rank == world.size - 1
    try:
        d = IntegrityDriver(cache)
        _on_disk(d)
        if slow:
            seams.executor.hold("promote")
        ready = []
        for step in range(5):
            d.begin()
            if step == 0:
                assert cache.prefetch(1, A) == 4
            if step == 3 and slow:
                seams.executor.release("promote")
            d.end()
            ready.append(cache.prefetch_ready(1))
        # Held until the slow rank's step-3 end_step ran its reads; then ready everywhere.
        assert ready == [False, False, False, True, True]
        assert world.allgather(ready) == [ready] * world.size
        d.begin()
        assert d.add(1, A) == 16
        d.compute()
        d.end()
        assert cache.stats()["hit_tokens"]["host"] == 16 and d.mismatched_tokens == 0
        cache.check_consistency()
    finally:
        if slow:
            seams.executor.release("promote")
        cache.close()
