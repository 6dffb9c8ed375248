"""Four independent single-rank caches (comm=COMM_SELF), one per rank, sharing one
config and one disk directory: none may touch another's file or blocks."""

import os

import pytest

import kvdist
import kvdist.testing
from kvdist.testing import Seams
from tests.conftest import make_cfg
from tests.test_integrity import churn

pytestmark = pytest.mark.mpi


def test_comm_self_caches_share_a_directory(tmp_path_factory):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    shared = world.bcast(str(tmp_path_factory.mktemp("disk")) if world.rank == 0 else None)
    block = 512
    cfg = kvdist.load_config(make_cfg(cache={
        "gpu": {"blocks": 24}, "host": {"bytes": 8 * block},
        "disk": {"path": shared, "bytes": 128 * block}}))
    seams = Seams()
    cache = kvdist.testing.create(cfg, seams, comm=MPI.COMM_SELF)
    try:
        assert (cache.rank, cache.world_size) == (0, 1)
        my_file = seams.disk.path
        files = world.allgather(my_file)
        assert len(set(files)) == world.size and all(os.path.dirname(f) == shared for f in files)
        # Different ranks churn different token streams, so shared files would corrupt.
        d = churn(cache, steps=160, seed=100 + world.rank)
        s = cache.stats()
        assert all(s["hit_tokens"][t] > 0 for t in cache.tiers), s["hit_tokens"]
        assert d.mismatched_tokens == 0, d.first_mismatch
    finally:
        cache.close()
    assert not os.path.exists(my_file)
    world.Barrier()
    if world.rank == 0:
        assert os.listdir(shared) == []
