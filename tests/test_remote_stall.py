"""A rank stalled before the remote tier's commit fails every rank's start-up and no
rank leaves a file in /dev/shm: tests/mpi/remote_stall_demo.py, in an MPI job of its own
(a stall ends every run-time collective of its process)."""

from .launching import run_mpi_tests


def test_a_rank_stalled_at_the_remote_commit_leaves_no_file():
    run_mpi_tests("tests/mpi/remote_stall_demo.py")
