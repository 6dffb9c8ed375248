"""The simulation's own communicator: the tensor-parallel model's allreduces and the
run's small agreements and gathers.

It is a Dup of COMM_WORLD made through :func:`kvdist.distributed.comm.resolve` (or a
one-rank stand-in without MPI), separate from the cache's communicator, so model
traffic never interleaves with the cache's collectives. Every collective is
deadline-bounded like the cache's (:mod:`kvdist.distributed.stall`): the model's
allreduces and the per-step agreement by ``distributed.step_timeout_s``, the phases'
barriers and the report's gathers (where rank 0 may write files meanwhile) by
``distributed.consensus_timeout_s``. A rank that does not arrive is named on every
rank that did (:class:`~kvdist.errors.RankStalled`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import xxhash

from ...config import CacheConfig
from ...distributed import comm as dist_comm

__all__ = ["TensorParallel"]


class TensorParallel:
    """Rank and size of the job, plus the collectives the model and the report need.
    ``step_timeout_s``: None = auto (see :class:`kvdist.distributed.stall.Pace`)."""

    def __init__(self, comm=None, step_timeout_s: float | None = None, consensus_timeout_s: float = 120.0):
        self._c = dist_comm.resolve(comm, consensus_timeout_s)
        self._c.run_time(step_timeout_s)
        self._long = consensus_timeout_s
        self.rank: int = self._c.rank
        self.size: int = self._c.size
        self.mpi = self._c.mpi  # None for a job without MPI

    @classmethod
    def of(cls, cfg: CacheConfig, comm=None) -> TensorParallel:
        """Over ``comm`` with ``cfg``'s deadlines (collective)."""
        d = cfg.distributed
        return cls(comm, None if d.step_timeout_s == "auto" else d.step_timeout_s, d.consensus_timeout_s)

    def allreduce_(self, t: torch.Tensor) -> torch.Tensor:
        """Sum ``t`` over the ranks in place (device tensors are staged through host
        memory: the MPI library is not assumed to be CUDA-aware)."""
        if self.mpi is None or self.size == 1:
            return t
        host = t.detach().to("cpu", copy=t.device.type != "cpu").contiguous()
        self._c.allreduce_sum_(host.numpy(), "the model's allreduce")
        if host.data_ptr() != t.data_ptr():
            t.copy_(host)
        return t

    def allreduce_min(self, values: list[int], what: str = "the scheduler's clock") -> list[int]:
        """The element-wise minimum of every rank's ``values`` (MAX: negate in and out)."""
        return self._c.allreduce_min(values, what)

    def agree(self, values: list[int], extra: int = 0,
              what: str = "the step's agreement") -> tuple[bool, int]:
        """(whether every rank passed the same ``values``, the MAX of ``extra`` over the
        ranks): one small allreduce of a fixed size (the length and a digest of
        ``values``: their minimum equals their maximum)."""
        digest = xxhash.xxh3_64_intdigest(np.asarray(values, dtype=np.int64).tobytes()) >> 1
        mine = [len(values), digest]
        both = self._c.allreduce_min([*mine, *(-v for v in mine), -extra], what)
        return both[:2] == [-v for v in both[2:4]], -both[-1]

    def barrier(self, what: str = "a phase's start") -> None:
        """Wait for every rank."""
        self._c.barrier(what, self._long)

    def gather(self, obj: object, what: str = "the report's figures") -> list | None:
        """Every rank's ``obj`` on rank 0 (None elsewhere)."""
        got = self._c.allgather(obj, what, self._long)
        return got if self.rank == 0 else None

    def allgather(self, obj: object, what: str = "the integrity references") -> list:
        """Every rank's ``obj`` on every rank."""
        return self._c.allgather(obj, what, self._long)

    def bcast(self, obj: object, what: str = "rank 0's value") -> object:
        return self._c.bcast(obj, what, self._long)

    def notify_all(self, obj: object) -> None:
        """Post ``obj`` to every other rank without a collective (rule R3)."""
        self._c.notify_all(obj)

    def take_notices(self) -> list:
        """What other ranks posted with ``notify_all`` since the last call."""
        return self._c.take_notices()

    def stop_waiting_on_notice(self, make: Callable[[list], BaseException | None]) -> None:
        """While waiting in a collective, end the wait by raising ``make(notices)`` when
        it returns an exception (the notices stay for ``take_notices``)."""
        c = self._c
        if self.mpi is not None:
            c.interrupt = lambda: make(c.peek_notices())

    def free(self) -> None:
        self._c.free()
        self.mpi = None
