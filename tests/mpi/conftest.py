"""The MPI phase (``make mpi``: every test here under ``mpiexec -n 4 ... --with-mpi``).

A test that fails on one rank while the others wait in a collective would hang the
job until ``MPIEXEC_TIMEOUT``: after any failed test the failing rank prints the
failure and aborts the whole MPI job, so the run ends within seconds, failed."""

from __future__ import annotations

import os

import pytest

from tests.mpi.job import abort_job

_with_mpi = [False]


@pytest.hookimpl(tryfirst=True)
def pytest_configure(config: pytest.Config) -> None:
    _with_mpi[0] = bool(config.getoption("with_mpi", False))
    # Each rank is a pytest run of its own: numbered base temp dirs (pytest-N) would have
    # a rank delete the oldest, another rank's, while that rank's tests still use it.
    # ``make mpi`` gives the job a directory (and removes it): one base dir per rank there.
    root = os.environ.get("KVDIST_MPI_BASETEMP")
    if _with_mpi[0] and root and not config.option.basetemp:
        from mpi4py import MPI

        config.option.basetemp = os.path.join(root, f"rank{MPI.COMM_WORLD.rank}")


@pytest.hookimpl(trylast=True)
def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if not report.failed or not _with_mpi[0]:
        return
    from mpi4py import MPI

    abort_job(f"{report.nodeid} failed on rank {MPI.COMM_WORLD.rank} ({report.when}):\n{report.longreprtext}")
