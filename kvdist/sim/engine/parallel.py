"""The simulation's own communicator: the tensor-parallel model's allreduces and the
run's small agreements and gathers.

It is a Dup of COMM_WORLD made through :func:`kvdist.distributed.comm.resolve` (or a
one-rank stand-in without MPI), separate from the cache's communicator, so model
traffic never interleaves with the cache's collectives."""

from __future__ import annotations

import os

import numpy as np
import torch

from ...distributed import comm as dist_comm


class TensorParallel:
    """Rank and size of the job, plus the collectives the model and the report need."""

    def __init__(self, comm=None):
        self._c = dist_comm.resolve(comm)
        self.rank: int = self._c.rank
        self.size: int = self._c.size
        self.mpi = self._c.mpi  # None for a job without MPI

    @staticmethod
    def _wait(req) -> None:
        """Complete a non-blocking collective, yielding the core while waiting: ranks
        often outnumber cores (4 ranks on a 2-core CI machine), and MPI's blocking
        collectives spin, taking the core from the rank everyone waits for."""
        while not req.Test():
            os.sched_yield()

    def allreduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (device tensors are staged through host
        memory: the MPI library is not assumed to be CUDA-aware)."""
        if self.mpi is None or self.size == 1:
            return t
        host = t.detach().to("cpu", copy=t.device.type != "cpu").contiguous()
        self._wait(self.mpi.Iallreduce(self._c.MPI.IN_PLACE, host.numpy(), op=self._c.MPI.SUM))
        if host.data_ptr() != t.data_ptr():
            t.copy_(host)
        return t

    def allreduce_min(self, values: list[int]) -> list[int]:
        """The element-wise minimum of every rank's ``values`` (MAX: negate in and out)."""
        if self.mpi is None:
            return list(values)
        a = np.asarray(values, dtype=np.int64)
        self._wait(self.mpi.Iallreduce(self._c.MPI.IN_PLACE, a, op=self._c.MPI.MIN))
        return a.tolist()

    def agree(self, values: list[int], extra: int = 0) -> tuple[bool, int]:
        """(whether every rank passed the same ``values``, the MAX of ``extra`` over the
        ranks): one small allreduce (the minimum equals the maximum)."""
        n = len(values)
        both = self.allreduce_min([*values, *(-v for v in values), -extra])
        return both[:n] == [-v for v in both[n:2 * n]], -both[-1]

    def barrier(self) -> None:
        """Wait for every rank, yielding the core (early ranks must not spin)."""
        if self.mpi is not None:
            self._wait(self.mpi.Ibarrier())

    def gather(self, obj: object) -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        if self.mpi is None:
            return [obj]
        self.barrier()
        return self.mpi.gather(obj, root=0)

    def allgather(self, obj: object) -> list:
        """Every rank's ``obj`` on every rank."""
        if self.mpi is None:
            return [obj]
        self.barrier()
        return self.mpi.allgather(obj)

    def bcast(self, obj: object) -> object:
        return obj if self.mpi is None else self.mpi.bcast(obj, root=0)

    def free(self) -> None:
        self._c.free()
        self.mpi = None
