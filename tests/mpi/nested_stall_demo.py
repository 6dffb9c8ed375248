"""A rank stops while its peers wait in collectives of *different* communicators: the
rank beside it (the same TP group, the same node) waits in the group's collective, the
others in the whole job's. Every rank must name the stopped rank alone — never the
live rank that waits elsewhere (CI, 2026-12-02: the two-node stall test named both the
stopped rank and its node mate).

Not collected by ``make mpi`` (the name does not start with ``test_``): a stall ends
every run-time collective of its process, so each case runs in a job of its own,
started by tests/test_stall_nested.py (``KVDIST_NESTED_CASE``):

* ``group-first``: the group's deadline passes first: its waiter names the stopped rank
  in the group, while the job's waiters settle theirs;
* ``job-first``: the job's deadline passes first: the group's waiter hears the job's
  report while it waits in the group's collective;
* ``late-in-grace``: every rank calls the job's collective, the last one after the
  deadline but within the grace in which the others hear each other: it is the one
  named, by every rank (not each rank that waited naming itself).

By hand: ``KVDIST_NESTED_CASE=group-first MPIEXEC_TIMEOUT=120 .venv/bin/mpiexec -n 4
.venv/bin/python -m mpi4py -m pytest -q --with-mpi -p no:cacheprovider
tests/mpi/nested_stall_demo.py``."""

import os
import socket
import time

import pytest

from kvdist.distributed import comm as dist_comm
from kvdist.errors import RankStalled

CASES = {  # the job's deadline, the group's, the job's waiters late by, the stopped rank away for,
    # whether the stopped rank and its mate call the group's collective (else the job's)
    "group-first": (2.0, 1.5, 0.0, 5.0, True),
    "job-first": (2.0, 8.0, 0.3, 5.0, True),
    "late-in-grace": (1.5, 8.0, 0.0, 1.9, False),
}


@pytest.mark.mpi(min_size=3)
def test_the_stopped_rank_alone_is_named_whichever_collective_its_peers_wait_in():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    job_s, group_s, late_s, away_s, in_group_call = CASES[os.environ["KVDIST_NESTED_CASE"]]
    stopped, mate = world.size - 1, world.size - 2  # the group: the last two ranks
    in_group = world.rank >= mate
    split = world.Split(1 if in_group else 0, key=world.rank)
    job = dist_comm.resolve(world, 30)
    group = dist_comm.MpiComm(split, 30)
    split.Free()
    pid = world.bcast(os.getpid(), root=stopped)
    try:
        job.run_time(job_s)
        group.run_time(group_s)
        job.allreduce_min([0], "the first step")  # past the start-up's bound
        group.allreduce_min([0], "the group's first step")
        world.Barrier()
        start = time.monotonic()
        with pytest.raises(RankStalled) as caught:
            if world.rank == stopped:
                time.sleep(away_s)  # as if stopped (SIGSTOP): in no collective
            if world.rank >= mate and in_group_call:
                group.allreduce_min([1], "the group's agreement")
            else:
                time.sleep(late_s)
                job.allreduce_min([1], "the model's allreduce")
        took = time.monotonic() - start
        assert list(caught.value.stalled) == [stopped], str(caught.value)
        line = caught.value.stalled[stopped]
        named = f"rank {stopped} (node {socket.gethostname()}, pid {pid}) has not reached "
        assert line.startswith(named), line
        if world.rank != stopped:
            assert took < job_s + late_s + 2.5, f"named after {took:.1f} s: {caught.value}"
    finally:
        group.free()
        job.free()
