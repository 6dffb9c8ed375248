"""What the ranks check on two nodes x 2 ranks: run under MPI by ``test_two_nodes.py`` on
the test bed (``kvdist-launch --module pytest``), not collected on its own. It runs on
real nodes too (see the README: hostfile, ``KVDIST_BED_SCRATCH``); the checks that need
the bed's veth pair or its made-up memory sizes then skip.

The first node holds ranks 0-1, the second ranks 2-3. ``KVDIST_BED_SCRATCH`` is a path
where each node has its own (node-local) directory; the bed also gives its node names
(``KVDIST_BED_HOSTS``) and the memory each node's /proc/meminfo shows
(``KVDIST_BED_MEM``). The launcher forwards ``KVDIST_*`` to every rank."""

from __future__ import annotations

import json
import logging
import os
import socket
import tempfile
from pathlib import Path

import numpy as np
import pytest
import yaml

import kvdist
import kvdist.candidate
from kvdist.distributed import comm as dist_comm
from kvdist.storage.host_sizing import available_memory
from tests.conftest import make_cfg
from tests.mpi.test_consensus import (
    BLOCK,
    BUILD_REASON,
    HOST_REASON,
    OK_HOST,
    OK_NO_HOST,
    _assert_aborted,
    assert_clean,
    assert_committed,
    attempt,
    config,
)

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[2]
HOSTS = os.environ.get("KVDIST_BED_HOSTS", "").split()
SCRATCH = os.environ.get("KVDIST_BED_SCRATCH", "")
MEM = [int(m) for m in os.environ.get("KVDIST_BED_MEM", "").split()]


@pytest.fixture
def world():
    from mpi4py import MPI

    w = MPI.COMM_WORLD
    assert w.size == 4 and SCRATCH, "2 nodes x 2 ranks with KVDIST_BED_SCRATCH (see test_two_nodes.py)"
    assert os.environ.get(dist_comm.FAKE_RANKS_PER_NODE_ENV) is None, "the nodes must be real"
    yield w
    w.Barrier()


@pytest.fixture
def hosts(world) -> list[str]:
    """The two nodes' host names: the bed's, or on real nodes those of ranks 0 and 2."""
    seen = world.allgather(socket.gethostname())
    return HOSTS or [seen[0], seen[2]]


def node_of(rank: int) -> int:
    return rank // 2


def gathered_listing(world, directory: str, prefix: str) -> list[list[str]]:
    """Every rank's sorted listing of ``directory`` (entries starting with ``prefix``)."""
    return world.allgather(sorted(f for f in os.listdir(directory) if f.startswith(prefix)))


def test_ranks_run_on_two_hosts(world, hosts):
    """Host names, MPI's node-local split, and node-private /dev/shm and scratch."""
    from mpi4py import MPI

    r = world.rank
    assert hosts[0] != hosts[1]
    assert world.allgather(socket.gethostname()) == [hosts[0], hosts[0], hosts[1], hosts[1]]
    assert MPI.Get_processor_name() == hosts[node_of(r)]
    assert dist_comm.node_info(world) == dist_comm.NodeInfo(r % 2, 2, node_of(r), 2)
    mine = {"shm": f"/dev/shm/kvdist-bed-{r}", "scratch": os.path.join(SCRATCH, f"kvdist-bed-{r}")}
    for path in mine.values():
        open(path, "w", encoding="utf-8").close()
    world.Barrier()
    try:
        for where in mine:
            seen = gathered_listing(world, os.path.dirname(mine[where]), "kvdist-bed-")
            assert seen == [["kvdist-bed-0", "kvdist-bed-1"]] * 2 + [["kvdist-bed-2", "kvdist-bed-3"]] * 2, \
                (where, seen)
    finally:
        world.Barrier()
        for path in mine.values():
            os.remove(path)


def veth_bytes() -> int:
    """Bytes sent and received on this node's end of the bed's veth pair (named after the node)."""
    stats = f"/sys/class/net/{socket.gethostname()}/statistics"
    return sum(int(open(f"{stats}/{d}_bytes", encoding="utf-8").read()) for d in ("rx", "tx"))


def test_mpi_traffic_between_nodes_crosses_the_veth(world):
    """A 2 MiB allreduce moves at least 2 MiB through each node's veth end."""
    if not HOSTS:
        pytest.skip("counts the bytes through the test bed's veth pair")
    size = 2 << 20
    world.Barrier()
    before = veth_bytes()
    data = np.full(size // 8, world.rank, dtype=np.int64)
    out = np.empty_like(data)
    world.Allreduce(data, out)
    world.Barrier()
    moved = veth_bytes() - before
    assert (out == 6).all()
    assert moved >= size, f"{moved} bytes through the veth"


def test_consensus_healthy_disk_files_on_each_node(world, probe):
    """KEEP_HOST everywhere; each rank's disk file lives on its own node's disk (the
    scratch directory, as the node's own mounts see it) and has no name there, so none
    is left on either node afterwards, however the job ends."""
    cache = kvdist.create(config(SCRATCH))
    try:
        committed = (cache.init_status, cache.tiers, cache.stats()["capacity_blocks"])
        files = gathered_listing(world, SCRATCH, "")
        assert len(probe.files) == 1, probe.files  # this rank's disk file
        where = world.allgather(probe.files[0])
    finally:
        cache.close()
    world.Barrier()
    assert committed == (kvdist.InitStatus.KEEP_HOST, ("gpu", "host", "disk"),
                         {"gpu": 8, "host": 4, "disk": 16})
    assert all(w.startswith(SCRATCH + "/") and w.endswith(" (deleted)") for w in where), where
    assert files == [[]] * 4, files
    assert gathered_listing(world, SCRATCH, "") == [[]] * 4


def test_host_tier_fails_on_the_second_node(world, monkeypatch, probe):
    """host_tier@3 (node b): USE_NO_HOST on all four ranks, rank 3 named everywhere."""
    outcomes = attempt(world, monkeypatch, probe, config(SCRATCH), "host_tier@3", SCRATCH)
    assert_committed(outcomes, kvdist.InitStatus.USE_NO_HOST, ("gpu", "disk"), {"gpu": 8, "disk": 16})
    for o in outcomes:
        first = (True, False, "HostTierUnavailable") if o["rank"] == 3 else OK_HOST
        assert o["builds"] == [first, OK_NO_HOST], o
        assert o["init_failures"] == {3: HOST_REASON.format(3)}, o
        assert len(o["warnings"]) == 1 and f"rank 3: {HOST_REASON.format(3)}" in o["warnings"][0], o
    assert_clean(outcomes)


def test_build_error_on_the_first_node(world, monkeypatch, probe):
    """build@1 (node a): ABORT on all four ranks, each naming rank 1."""
    outcomes = attempt(world, monkeypatch, probe, config(SCRATCH), "build@1", SCRATCH)
    why = BUILD_REASON.format("build", 1)
    _assert_aborted(outcomes, {1: ("KVDistError", why.removeprefix("KVDistError: "))}, {1: why})
    for o in outcomes:
        assert o["builds"] == [(True, False, "KVDistError") if o["rank"] == 1 else OK_HOST], o
    assert_clean(outcomes)


def test_stalled_rank_on_the_second_node(world, monkeypatch, probe):
    """stall@2 (node b): the other three ranks raise ConsensusTimeout after the timeout."""
    timeout = 1.5
    cfg = config(SCRATCH, timeout=timeout)
    outcomes = attempt(world, monkeypatch, probe, cfg, "stall@2", SCRATCH)
    for o in outcomes:
        assert o["kind"] == "ConsensusTimeout", o
        if o["rank"] != 2:
            assert "phase 1: status" in o["message"] and timeout <= o["seconds"] < timeout + 4.0, o
    assert_clean(outcomes)


def test_config_differs_between_nodes(world, monkeypatch, probe):
    """Node b's ranks were given another disk size: ABORT before any tier is built."""
    on_b = node_of(world.rank) == 1
    cfg = config(SCRATCH)
    if on_b:
        cfg["cache"]["disk"]["bytes"] = 32 * BLOCK
    outcomes = attempt(world, monkeypatch, probe, cfg, "", SCRATCH)
    why = f"config differs from rank 0's: cache.disk.bytes={32 * BLOCK} (reference {16 * BLOCK})"
    for o in outcomes:
        assert (o["kind"], o["failures"]) == ("ConsensusAbort", {2: why, 3: why}), o
        assert "differ on rank(s) 2, 3" in o["message"] and o["builds"] == [], o
    assert_clean(outcomes)


def test_host_auto_shares_each_node_memory_among_its_ranks(world, monkeypatch, caplog):
    """``host.bytes: auto``: a rank plans half its node's available memory / the node's
    2 ranks (not the world's 4); the nodes show different memory, and every rank
    commits the MIN, node b's plan."""
    if not MEM:
        pytest.skip("needs the test bed's per-node /proc/meminfo")
    # Each node's own /proc/meminfo, or this test would size tiers from the whole machine.
    assert available_memory() == MEM[node_of(world.rank)]
    plans = []
    real_plan = kvdist.candidate.CandidateBuilder.plan
    monkeypatch.setattr(kvdist.candidate.CandidateBuilder, "plan",
                        lambda self: plans.append(real_plan(self)) or plans[-1])
    cfg = make_cfg(cache={"gpu": {"blocks": 64},
                          "host": {"bytes": "auto", "auto_memory_fraction": 0.5, "auto_gpu_ratio": 1e6},
                          "disk": {"path": SCRATCH, "bytes": 16 * BLOCK}})
    caplog.set_level(logging.INFO, logger="kvdist")
    cache = kvdist.create(cfg)
    try:
        committed = cache.stats()["capacity_blocks"]
    finally:
        cache.close()
    per_node = [int(m * 0.5) // 2 // BLOCK for m in MEM]
    assert per_node[0] > per_node[1]
    assert plans == [(64, per_node[node_of(world.rank)], 16)], plans
    assert world.allgather(committed) == [{"gpu": 64, "host": per_node[1], "disk": 16}] * 4
    if world.rank == 0:
        reduced = "; ".join(f"rank {r}: host {per_node[0]}->{per_node[1]}" for r in (0, 1))
        assert f"MIN-reduced across ranks to (64, {per_node[1]}, 16) blocks: {reduced}" in caplog.text


def test_main_job_tp4_across_two_nodes(world, hosts):
    """``python -m kvdist run`` (its entry point, on every rank): one tensor-parallel group
    of 4 ranks over both nodes, a short trace of configs/default.yaml with the disk tier
    on each node's scratch. Every check of the job passes, the ranks sit where the
    hostfile put them, and no disk file is left on either node."""
    from kvdist.cli import main

    cfg = yaml.safe_load((ROOT / "configs" / "default.yaml").read_text(encoding="utf-8"))
    cfg["cache"]["disk"]["path"] = SCRATCH
    cfg["workload"]["conversations"] = 16
    cfg["distributed"]["check_consistency_every"] = 10
    with tempfile.TemporaryDirectory(prefix="kvdist-job-") as mine:
        (Path(mine) / "job.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
        out = Path(mine) / "runs"  # only rank 0 writes results
        code = main(["run", "--config", f"{mine}/job.yaml", "--requests", "24", "--out", str(out), "--quiet"])
        latest = out / "latest" / "results.json"
        results = json.loads(latest.read_text(encoding="utf-8")) if world.rank == 0 else None
    assert code == 0
    world.Barrier()
    assert gathered_listing(world, SCRATCH, "") == [[]] * 4
    if world.rank == 0:
        assert [(p["host"], p["node"], p["local_rank"], p["local_size"]) for p in results["placement"]] == \
            [(hosts[0], 0, 0, 2), (hosts[0], 0, 1, 2), (hosts[1], 1, 0, 2), (hosts[1], 1, 1, 2)]
        assert results["ok"] and (results["world_size"], results["nodes"]) == (4, 2)
        assert results["requests"] == 24 and results["integrity"]["blocks_checked"] > 0
        assert results["integrity_mismatches"] == 0 and results["integrity"]["consistency"]["error"] is None


def test_replicas_fetch_remote_blocks_across_nodes(world):
    """2 replicas x TP 2, replica 0 on node a and replica 1 on node b, sharing their host
    tiers (configs/replicas.yaml with a GPU tier of 32 blocks and short turns, so blocks
    reach the host tiers within a short trace): the replicas reuse blocks the other one
    computed, fetched over the network (MPI messages between the nodes: at least the
    bytes a node's replica fetched went through its end of the veth pair), and the job
    checks them against the digests their writer recorded. A fetch may take up to 1 s
    (a loaded CI machine) before it counts as a miss."""
    from kvdist.cli import main

    cfg = yaml.safe_load((ROOT / "configs" / "replicas.yaml").read_text(encoding="utf-8"))
    cfg["cache"]["gpu"]["blocks"] = 32
    cfg["cache"]["host"]["bytes"] = "8MiB"  # the run checks its memory against the bed's (32 MiB a rank)
    cfg["distributed"]["remote"]["fetch_timeout_ms"] = 1000
    cfg["workload"].update(conversations=8, turns=[3, 6], output_tokens=[4, 8], think_steps=10,
                           system_prompt_tokens=256)  # prompts that overflow the 32 GPU blocks
    counting = bool(HOSTS)  # the bed's veth pair: its byte counters
    with tempfile.TemporaryDirectory(prefix="kvdist-job-") as mine:
        (Path(mine) / "job.yaml").write_text(yaml.safe_dump(cfg), encoding="utf-8")
        out = Path(mine) / "runs"
        world.Barrier()
        before = veth_bytes() if counting else 0
        code = main(["run", "--config", f"{mine}/job.yaml", "--requests", "24", "--out", str(out), "--quiet"])
        moved = world.allgather(veth_bytes() - before if counting else 0)
        latest = out / "latest" / "results.json"
        results = json.loads(latest.read_text(encoding="utf-8")) if world.rank == 0 else None
    assert code == 0
    results = world.bcast(results)
    assert results["ok"] and (results["replicas"], results["tp_size"]) == (2, 2), results["ok"]
    assert results["integrity_mismatches"] == 0 and results["integrity"]["blocks_checked"] > 0
    sharing = results["runs"]["sharing"]["replicas"]
    assert sum(row["reused_tokens"].get("remote", 0) for row in sharing) > 0, sharing
    assert results["bytes_fetched_remote"] == sum(row["bytes_fetched_remote"] for row in sharing) > 0
    if counting:  # node k runs replica k: what it fetched came in through its veth end
        for k, row in enumerate(sharing):
            assert moved[2 * k] >= row["bytes_fetched_remote"], (moved, sharing)
