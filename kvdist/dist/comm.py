"""The library's own communicator.

kvdist never uses ``COMM_WORLD`` directly: ``resolve`` Dups the communicator it is
given (or ``COMM_WORLD`` when MPI is running), and a job started without MPI gets a
single-rank stand-in that needs no MPI library at all."""

from __future__ import annotations

import os
import sys

_LAUNCHER_VARS = ("PMI_RANK", "PMI_SIZE", "PMIX_RANK", "OMPI_COMM_WORLD_SIZE",
                  "MPI_LOCALNRANKS", "HYDI_CONTROL_FD", "SLURM_STEP_NUM_TASKS")


def mpi_is_running() -> bool:
    """True when this process was started by an MPI launcher or has MPI initialized."""
    if "mpi4py.MPI" in sys.modules:
        return True
    return any(v in os.environ for v in _LAUNCHER_VARS)


class SingleComm:
    """World of one rank, without MPI."""

    rank = 0
    size = 1
    local_rank = 0
    local_size = 1
    mpi = None

    def free(self) -> None:
        pass


class MpiComm:
    """A Dup of an mpi4py communicator plus its node-local split."""

    def __init__(self, comm, timeout_s: float):
        from mpi4py import MPI

        self.MPI = MPI
        self.mpi = comm.Dup()
        self.timeout_s = timeout_s
        self.rank = self.mpi.Get_rank()
        self.size = self.mpi.Get_size()
        node = self.mpi.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
        self.local_rank = node.Get_rank()
        self.local_size = node.Get_size()
        node.Free()

    def free(self) -> None:
        if self.mpi is not None:
            self.mpi.Free()
            self.mpi = None


def resolve(comm=None, timeout_s: float = 120.0) -> SingleComm | MpiComm:
    """The library's communicator for ``comm`` (a Dup), or for COMM_WORLD when None and
    MPI is running, or a single-rank stand-in."""
    if comm is None:
        if not mpi_is_running():
            return SingleComm()
        from mpi4py import MPI

        comm = MPI.COMM_WORLD
    return MpiComm(comm, timeout_s)
