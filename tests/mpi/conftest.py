"""The MPI phase (``make mpi``: every test here under ``mpiexec -n 4 ... --with-mpi``).

A test that fails on one rank while the others wait in a collective would hang the
job until ``MPIEXEC_TIMEOUT``: after any failed test the failing rank prints the
failure and aborts the whole MPI job, so the run ends within seconds, failed."""

from __future__ import annotations

import sys

import pytest

_with_mpi = [False]


def pytest_configure(config: pytest.Config) -> None:
    _with_mpi[0] = bool(config.getoption("with_mpi", False))


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or not _with_mpi[0]:
        return
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size == 1:
        return
    sys.stderr.write(f"\n{report.nodeid} failed on rank {world.rank} ({report.when}):\n"
                     f"{report.longreprtext}\nrank {world.rank}: aborting the MPI job, "
                     "whose other ranks may be waiting for this one\n")
    sys.stderr.flush()
    world.Abort(1)
