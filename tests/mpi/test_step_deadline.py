"""Run-time collectives are bounded and tagged (kvdist/distributed/stall.py): ranks that
call different collectives get CollectiveMismatch naming the calls (not MPICH's
"truncation" or an UnpicklingError); a rank that does not arrive within
``distributed.step_timeout_s`` is named (world rank, node, pid, the collective) on every
rank, and learns the verdict itself when it arrives late; a rank slower than its peers
but within the deadline is not. Each test runs in a process of its own communicator
state: a stall ends the process's run-time collectives, so those tests go last."""

import os
import socket
import time
from pathlib import Path

import numpy as np
import pytest

import kvdist
from kvdist.distributed import comm as dist_comm
from kvdist.errors import CollectiveMismatch, RankStalled
from tests.conftest import make_cfg
from tests.mpi.test_sim import shared_dir

pytestmark = pytest.mark.mpi


def _world():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    if world.size < 2:
        pytest.skip("needs two ranks or more")
    return world


def _run_time_comm(world, step_timeout_s: float) -> dist_comm.MpiComm:
    c = dist_comm.resolve(world, 30)
    c.run_time(step_timeout_s)
    return c


def test_one_rank_calling_another_collective_is_named_with_both_calls():
    """The last rank makes a cache call alone (its replica's agreement) while the others
    compare their state: every rank raises CollectiveMismatch naming both calls."""
    world = _world()
    c = _run_time_comm(world, 20)
    last = world.size - 1
    try:
        with pytest.raises(CollectiveMismatch) as caught:
            if c.rank == last:
                c.allreduce_min_array(np.arange(5), "the remote tier's agreement (add_sequence)")
            else:
                c.allgather(b"digest", "cache state digest")
        alone = "the remote tier's agreement (add_sequence)"
        calls = {r: "cache state digest" for r in range(last)} | {last: alone}
        assert caught.value.calls == calls
        assert f"rank {last} called the remote tier's agreement (add_sequence)" in str(caught.value) or \
            c.rank == last
        assert not c.usable
    finally:
        c.free()


def test_a_slow_rank_within_the_deadline_is_not_named():
    world = _world()
    c = _run_time_comm(world, 3)
    try:
        if c.rank == world.size - 1:
            time.sleep(1.0)
        assert c.allreduce_min([c.rank + 7], "a slow step") == [7]
        assert c.usable
    finally:
        c.free()


def test_zz_a_rank_that_does_not_arrive_is_named_on_every_rank_and_learns_it_late(tmp_path_factory):
    """Through a cache: the last rank stays away from check_consistency for the deadline
    plus a second; the others name it within the deadline and the exchange's grace; then
    it arrives and raises the same verdict. Nothing of the caches is left."""
    world = _world()
    last = world.size - 1
    disk = Path(shared_dir(tmp_path_factory, "stall")) / "disk"
    cfg = make_cfg(cache={"device": "cpu", "gpu": {"blocks": 8}, "host": {"bytes": 64 * 1024},
                          "disk": {"path": str(disk), "bytes": 64 * 1024}},
                   distributed={"step_timeout_s": 1.0, "consensus_timeout_s": 30})
    cache = kvdist.create(cfg)
    try:
        cache.check_consistency()  # the first run-time collective is bounded by the start-up's
        host, pid = socket.gethostname(), world.bcast(os.getpid(), root=last)
        start = time.monotonic()
        if world.rank == last:
            time.sleep(2.5)
        with pytest.raises(RankStalled) as caught:
            cache.check_consistency()
        took = time.monotonic() - start
        assert list(caught.value.stalled) == [last]
        assert caught.value.stalled[last] == (
            f"rank {last} (node {host}, pid {pid}) has not reached cache state digest for 1 s "
            "(stopped? SIGSTOP, a debugger, swapping)")
        if world.rank != last:
            assert 1.0 <= took < 2.5, took  # the deadline plus the exchange's grace
        else:
            assert took >= 2.5
    finally:
        cache.close()
    assert os.listdir(disk) == []
