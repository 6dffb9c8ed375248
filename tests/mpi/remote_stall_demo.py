"""A rank stalls just before the remote tier's commit (fault site ``remote_stall``) while
every rank's host tier file, stamps and the node directory are in /dev/shm: its peers'
commit collective times out at the step deadline, it raises after its sleep, and each
rank removes its own files as it raises (``kvdist.distributed.remote_setup.commit_remote``).

Not collected by ``make mpi`` (the name does not start with ``test_``): a stall ends
every run-time collective of its process, so the case runs in a job of its own, started
by tests/test_remote_stall.py. By hand: ``MPIEXEC_TIMEOUT=120 .venv/bin/mpiexec -n 4
.venv/bin/python -m mpi4py -m pytest -q --with-mpi -p no:cacheprovider
tests/mpi/remote_stall_demo.py``."""

import os
import time

import pytest

import kvdist
from kvdist import faults
from tests.mpi.replica_harness import config, need_replicas


@pytest.mark.mpi(min_size=2)
def test_a_rank_stalled_at_the_remote_commit_fails_every_start_and_leaves_no_file(monkeypatch):
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    need_replicas(world.size)
    monkeypatch.setenv(faults.ENV, "remote_stall@1")
    cfg = config(world=world.size)
    cfg["distributed"].update(consensus_timeout_s=2, step_timeout_s=2)
    world.Barrier()
    before = set(os.listdir("/dev/shm"))
    t0 = time.monotonic()
    with pytest.raises(kvdist.KVDistError) as raised:
        kvdist.create(cfg)
    seconds = time.monotonic() - t0
    if world.rank == 1:
        assert isinstance(raised.value, kvdist.ConsensusTimeout), raised.value
        assert "before the remote tier's commit collective" in str(raised.value)
        assert seconds >= faults.stall_seconds(2), seconds
    else:
        assert "remote tier: commit" in str(raised.value), raised.value
        assert seconds < faults.stall_seconds(2), seconds
    world.Barrier()
    left = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("kvdist-")}
    assert left == set(), left
