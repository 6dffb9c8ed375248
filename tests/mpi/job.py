"""Ending the whole MPI job from one rank (the MPI phase's rule: a test that fails on
one rank must not leave the others waiting in a collective until MPIEXEC_TIMEOUT)."""

from __future__ import annotations

import sys


def abort_job(what: str) -> None:
    """Print ``what`` on this rank and abort every rank of the job (no return when
    the world has more than one rank)."""
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size == 1:
        return
    sys.stderr.write(f"\n{what}\nrank {world.rank}: aborting the MPI job, whose other ranks may be "
                     "waiting for this one\n")
    sys.stderr.flush()
    world.Abort(1)
