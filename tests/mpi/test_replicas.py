"""Replicas under mpiexec: ``distributed.tp_size`` splits the world into TP groups;
``check_consistency`` compares the ranks of one replica only (replicas serve
different requests). Written for ``mpiexec -n 4`` (2 replicas x TP 2), valid at any
world size: TP 2 when the world is even, else TP 1."""

import pytest

import kvdist
from tests.conftest import make_cfg

pytestmark = pytest.mark.mpi


def _tp(world: int) -> int:
    return 2 if world % 2 == 0 else 1


def test_replica_layout_and_consistency_inside_each_replica():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    T = _tp(world.size)
    cache = kvdist.create(make_cfg(cache={"gpu": {"blocks": 32}},
                                   distributed={"tp_size": T, "consensus_timeout_s": 20}))
    try:
        assert (cache.tp_size, cache.num_replicas) == (T, world.size // T)
        assert (cache.replica, cache.tp_rank) == (world.rank // T, world.rank % T)
        # Replicas serve different prompts: their states differ, yet each is consistent.
        cache.begin_step()
        cache.add_sequence("s", [cache.replica] * 9 + list(range(20)))
        cache.block_table(["s"])
        cache.end_step()
        cache.check_consistency()
        # One TP rank of replica 0 (when it has two) diverges: only replica 0 raises,
        # naming that rank by its world rank.
        cache.begin_step()
        if world.rank == 1 and T == 2:
            cache.add_sequence("odd", list(range(100, 120)))
        cache.end_step()
        if T == 2 and cache.replica == 0:
            with pytest.raises(kvdist.ConsistencyError) as ei:
                cache.check_consistency()
            assert ei.value.diverged == [1]
            assert ("replica 0" in str(ei.value)) == (cache.num_replicas > 1)
        else:
            cache.check_consistency()
    finally:
        cache.close()
