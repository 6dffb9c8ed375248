"""A deliberately failing replica test (not collected: the name does not start with
``test_``). The fetcher replica fails while the holder waits for it in a collective
of the test; the failing rank must not go on to close its cache (a collective the
holder never reaches, which would wait out ``consensus_timeout_s``, 120 s here): the
replica harness ends the job at once. tests/test_replica_fail_fast.py runs it on 2
ranks and checks that it ends within seconds."""

import pytest

from tests.mpi.replica_harness import FETCHER, Replica, config


@pytest.mark.mpi(min_size=2)
def test_the_fetcher_fails_while_the_holder_waits():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    cfg = config(world=world.size)
    cfg["distributed"]["consensus_timeout_s"] = 120
    with Replica(cfg) as r:
        assert r.replica != FETCHER, "the fetcher replica fails on purpose"
        world.Barrier()  # the holder waits here for the fetcher, which never comes
