"""A deliberately failing MPI test (not collected: the name does not start with
``test_``). Rank 1 fails while the other ranks wait for it in a collective of the
test's own communicator, and goes on to the next test, whose collective the others
never reach: without the MPI phase's conftest the job would hang until
MPIEXEC_TIMEOUT; with it, rank 1 aborts the job at once. Run it by hand:

    MPIEXEC_TIMEOUT=120 .venv/bin/mpiexec -n 4 .venv/bin/python -m mpi4py -m pytest -q \\
        --with-mpi -p no:cacheprovider tests/mpi/failing_demo.py

(tests/test_mpi_phase.py runs it on 2 ranks and checks that it ends within seconds)."""

import pytest


@pytest.mark.mpi(min_size=2)
def test_rank_1_fails_while_the_others_wait():
    from mpi4py import MPI

    comm = MPI.COMM_WORLD.Dup()  # as a cache's or a model's communicator
    assert comm.rank != 1, "rank 1 fails on purpose"
    comm.Barrier()  # the other ranks wait here for rank 1, which never comes
    comm.Free()


@pytest.mark.mpi(min_size=2)
def test_the_next_test():
    from mpi4py import MPI

    MPI.COMM_WORLD.Barrier()  # rank 1 waits here, the others are still in the test above
