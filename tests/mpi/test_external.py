"""``cache.gpu: external`` under mpiexec: every rank is one TP worker of the engine,
holding its own heads in its own tensors; one planner (the engine's scheduler, on rank
0 here) decides for all of them and every rank replays the same copies (rule R1). The
start-up consensus runs over the host and disk tiers alone: a rank that cannot have
its host tier makes every rank drop theirs, and the planner must number slots as the
ranks committed. Valid at any world size."""

from __future__ import annotations

import pytest
import torch

from kvdist import faults
from kvdist.distributed.consensus import HostTierWarning, InitStatus
from kvdist.errors import KVDistError
from kvdist.external import ExternalPlanner, TierPlan, create
from tests.external_kv import L, T, config, snapshot, vllm_kv

pytestmark = pytest.mark.mpi

PROMPT = list(range(7, 7 + 4 * T + 1))


@pytest.fixture
def world():
    from mpi4py import MPI

    return MPI.COMM_WORLD


def _moved(kv, before, moved: dict[int, int]) -> list[str]:
    now = snapshot(kv)
    return [f"layer {layer} block {b}" for layer in range(L) for b in range(len(now[layer]))
            if not torch.equal(now[layer][b], before[layer][moved.get(b, b)])]


def test_one_planner_drives_every_tp_rank_alike(world):
    cfg = config()
    worker = create(cfg, comm=world)
    try:
        kv = vllm_kv(10, seed=world.rank)  # each rank its own heads' bytes
        worker.register(kv)
        before = snapshot(kv)
        planner = ExternalPlanner(cfg, worker.tier_plan) if world.rank == 0 else None
        if planner:
            planner.plan_save("a", PROMPT, [2, 4, 6, 8])
        worker.start(world.bcast(planner.take() if planner else None))  # the step's metadata
        if planner:
            assert planner.lookup(PROMPT) == 4 * T
            planner.plan_load("b", PROMPT, [1, 3, 5, 7])
        worker.start(world.bcast(planner.take() if planner else None))
        worker.synchronize()
        done = worker.finished()
        assert done.saved == {"a"} and done.loaded == {"b"}
        wrong = world.allgather(_moved(kv, before, {1: 2, 3: 4, 5: 6, 7: 8}))
        assert wrong == [[]] * world.size
    finally:
        worker.close()


def test_a_rank_without_its_host_tier_makes_every_rank_drop_theirs(world, monkeypatch, tmp_path):
    """host_tier fails on the last rank: every rank commits the disk tier alone
    (USE_NO_HOST); a planner of the config's tiers is refused; one of the ranks' tiers
    spills to disk and reloads."""
    path = world.bcast(str(tmp_path))
    cfg = config(host_blocks=4, disk_blocks=8, disk_path=path)
    monkeypatch.setenv(faults.ENV, f"host_tier@{world.size - 1}")
    with pytest.warns(HostTierWarning):
        worker = create(cfg, comm=world)
    monkeypatch.delenv(faults.ENV)
    try:
        assert worker.init_status == InitStatus.USE_NO_HOST
        assert worker.tier_plan == TierPlan(host_blocks=0, disk_blocks=8) and worker.tiers == ("disk",)
        kv = vllm_kv(6, seed=world.rank)
        worker.register(kv)
        before = snapshot(kv)
        stale = ExternalPlanner(cfg)
        stale.plan_save("x", PROMPT, [0])
        with pytest.raises(KVDistError, match="build ExternalPlanner with the workers' tier_plan"):
            worker.start(stale.take())
        planner = ExternalPlanner(cfg, worker.tier_plan)
        planner.plan_save("a", PROMPT, [0, 1])
        planner.plan_load("b", PROMPT, [4, 5])
        t = planner.take()
        assert [r.name for r in t.routes()] == ["spill", "spill", "reload", "reload"]
        worker.start(t)
        worker.synchronize()
        assert world.allgather(_moved(kv, before, {4: 0, 5: 1})) == [[]] * world.size
    finally:
        worker.close()
