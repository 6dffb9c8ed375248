"""A stopped rank is named alone while its peers wait in collectives of different
communicators (its TP group's, the job's): tests/mpi/nested_stall_demo.py, one MPI job a
case (a stall ends every run-time collective of its process)."""

import pytest

from .launching import run_mpi_tests


@pytest.mark.parametrize("case", ["group-first", "job-first", "late-in-grace"])
def test_the_stopped_rank_alone_is_named(case):
    run_mpi_tests("tests/mpi/nested_stall_demo.py", env={"KVDIST_NESTED_CASE": case})
