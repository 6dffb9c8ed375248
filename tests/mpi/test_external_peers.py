"""The remote tier under ``cache.gpu: external`` (``kvdist.external.peers``): replicas of
TP ranks (2 x TP 2 at 4 ranks; TP 1 at 2 or 3), each rank its own planner as under
vLLM's external_launcher. Replica A saves a prompt through the worker path into its
host tier; replica B, whose engine holds nothing, finds it in the directory, fetches
it into other engine block ids, and its bytes equal A's exactly (its own TP shard
from A's rank of the same TP index). A block A overwrote after the directory listed it
is a load error on every rank of B (R2), the others exact; a fetch that failed on
one TP rank of B fails on all (R1). Both transports: a copy out of a node peer's shared
host tier ("auto") and MPI messages ("messages"). Needs two replicas: skipped alone.
``KVDIST_TEST_DEVICE=cuda`` puts the engine's tensors on the GPU (the CUDA executor, the
landing rows copied to the device)."""

from __future__ import annotations

import os

import pytest
import torch

from kvdist import faults
from kvdist.external import ExternalPlanner, create
from tests.external_kv import L, T, config, snapshot, vllm_kv

pytestmark = pytest.mark.mpi

PROMPT = list(range(7, 7 + 4 * T + 1))  # 4 full blocks and a token to compute
OTHER = list(range(500, 500 + T + 1))
A, B = 0, 1
SAVED_TO = [2, 4, 6, 8]  # A's engine blocks holding the prompt
LOADED_TO = [1, 3, 5, 7]  # B's engine blocks vLLM allocated for it
STEPS = 2000
DEVICE = os.environ.get("KVDIST_TEST_DEVICE", "cpu")


@pytest.fixture
def world():
    from mpi4py import MPI

    if MPI.COMM_WORLD.size < 2:
        pytest.skip("needs two replicas")
    return MPI.COMM_WORLD


def _tp(world) -> int:
    return 2 if world.size % 2 == 0 and world.size >= 4 else 1


class Rank:
    """One rank: its worker, its engine's KV tensors, its own planner."""

    def __init__(self, world, transport: str, host_blocks: int = 8):
        self.world, self.tp = world, _tp(world)
        self.replica, self.tp_rank = world.rank // self.tp, world.rank % self.tp
        cfg = config(host_blocks=host_blocks)
        cfg["distributed"] = {"tp_size": self.tp, "remote": {"enabled": True, "transport": transport,
                                                             "directory_every_steps": 1}}
        self.worker = create(cfg, comm=world, device=DEVICE)
        self.kv = vllm_kv(10, seed=world.rank, device=DEVICE)  # each rank its own heads' bytes
        self.worker.register(self.kv)
        assert self.worker.peers is not None
        self.planner = ExternalPlanner(cfg, self.worker.tier_plan, peers=self.worker.peers)
        self.loaded: set = set()
        self.failed: set[int] = set()

    def step(self, transfers=None) -> None:
        """One engine step: the planner's copies, the step boundary, what finished."""
        self.worker.start(transfers if transfers is not None else self.planner.take())
        self.worker.synchronize()
        self.worker.end_step()
        self.loaded |= self.worker.finished().loaded
        self.failed |= self.worker.failed_blocks()

    def until(self, done) -> int:
        """Steps on every rank until ``done()`` holds on every rank; how many."""
        for n in range(1, STEPS):
            self.step()
            if self.world.allreduce(int(bool(done())), op=_min()) == 1:
                return n
        raise AssertionError(f"not done after {STEPS} steps")

    def close(self) -> None:
        self.worker.close()


def _min():
    from mpi4py import MPI

    return MPI.MIN


def _snapshot(kv) -> list[list[torch.Tensor]]:
    return [[b.cpu() for b in layer] for layer in snapshot(kv)]


def _saved_bytes(r: Rank) -> list[list[torch.Tensor]]:
    """On every rank: A's bytes of the prompt's blocks on the rank of A with this rank's
    TP index (``[block][layer]``)."""
    now = _snapshot(r.kv)
    mine = [[now[layer][b] for layer in range(L)] for b in SAVED_TO]
    everyone = r.world.allgather(mine if r.replica == A else None)
    return everyone[A * r.tp + r.tp_rank]


def _share_the_prompt(r: Rank) -> None:
    if r.replica == A:
        r.planner.plan_save("a", PROMPT, SAVED_TO)
    r.step()
    r.until(lambda: r.replica != B or r.planner.lookup(PROMPT) == 4 * T)


@pytest.mark.parametrize("transport", ["auto", "messages"])
def test_a_prefix_another_replica_saved_loads_into_other_engine_blocks(world, transport):
    r = Rank(world, transport)
    try:
        want = _saved_bytes(r)
        _share_the_prompt(r)
        if r.replica == B:
            assert r.planner.lookup(PROMPT) == 4 * T
            plan = r.planner.plan_load("b", PROMPT, LOADED_TO)
            assert plan.blocks == tuple(LOADED_TO) and plan.failed == () and plan.tokens == 4 * T
        r.until(lambda: r.replica != B or "b" in r.loaded)
        if r.replica == B:
            got = _snapshot(r.kv)
            wrong = [f"block {e} layer {layer}" for e, w in zip(LOADED_TO, want) for layer in range(L)
                     if not torch.equal(got[layer][e], w[layer])]
            assert wrong == [] and r.failed == set()
            s = r.worker.stats()["remote"]
            assert (s["blocks_landed"], s["blocks_failed"]) == (4, 0)
            assert r.planner.stats()["remote_hit_tokens"] == 4 * T
        r.worker.check_invariants()
    finally:
        r.close()


@pytest.mark.parametrize("transport", ["auto", "messages"])
def test_a_block_the_holder_overwrote_after_the_directory_listed_it_is_a_load_error(world, transport):
    r = Rank(world, transport, host_blocks=4)  # A's next save evicts the prompt's last block
    try:
        want = _saved_bytes(r)
        _share_the_prompt(r)
        transfers = None
        if r.replica == B:  # planned while the directory still lists all four
            assert r.planner.lookup(PROMPT) == 4 * T
            r.planner.plan_load("b", PROMPT, LOADED_TO)
            transfers = r.planner.take()
        if r.replica == A:
            r.planner.plan_save("q", OTHER, [9])
            assert r.planner.lookup(PROMPT) == 3 * T  # the prompt's last block made room
            r.worker.start(r.planner.take())
            r.worker.synchronize()
        world.Barrier()  # A's slot holds OTHER's block before B's fetch reads it
        if r.replica == B:
            r.worker.start(transfers)
        r.until(lambda: r.replica != B or "b" in r.loaded)
        if r.replica == B:
            assert r.failed == {LOADED_TO[3]}  # every TP rank: recompute that block
            got = _snapshot(r.kv)
            wrong = [f"block {e} layer {layer}" for e, w in zip(LOADED_TO[:3], want) for layer in range(L)
                     if not torch.equal(got[layer][e], w[layer])]
            assert wrong == []
    finally:
        r.close()


def test_a_fetch_one_tp_rank_failed_fails_on_every_tp_rank(world, monkeypatch):
    """Fault drill remote_fetch on B's last TP rank: every fetch of that rank fails;
    the replica's other ranks had the blocks whole and report them failed too (R1), and
    every rank's directory forgets the blocks given up (the planners stop offering them)."""
    tp = _tp(world)
    if tp < 2:
        pytest.skip("needs TP 2")
    monkeypatch.setenv(faults.ENV, f"remote_fetch@{B * tp + tp - 1}")
    r = Rank(world, "messages")
    monkeypatch.delenv(faults.ENV)
    try:
        _share_the_prompt(r)
        if r.replica == B:
            r.planner.plan_load("b", PROMPT, LOADED_TO)
        r.until(lambda: r.replica != B or "b" in r.loaded)
        if r.replica == B:
            assert r.failed == set(LOADED_TO)
            assert r.planner.lookup(PROMPT) == 0  # given up: no longer offered (until A lists it again)
    finally:
        r.close()


def test_blocks_beyond_the_landing_area_are_load_errors_and_the_rest_exact(world):
    """B's landing area has a row per host slot (4 here): a second load of the prompt in
    the same step finds none, and its blocks are load errors on every rank; the first's
    are exact; the rows are free again afterwards."""
    r = Rank(world, "messages", host_blocks=4)
    try:
        want = _saved_bytes(r)
        _share_the_prompt(r)
        if r.replica == B:
            r.planner.plan_load("b", PROMPT, LOADED_TO)
            r.planner.plan_load("c", PROMPT, [0, 2, 4, 6])
        r.until(lambda: r.replica != B or {"b", "c"} <= r.loaded)
        if r.replica == B:
            assert r.failed == {0, 2, 4, 6}
            got = _snapshot(r.kv)
            wrong = [f"block {e} layer {layer}" for e, w in zip(LOADED_TO, want) for layer in range(L)
                     if not torch.equal(got[layer][e], w[layer])]
            assert wrong == []
            s = r.worker.stats()["remote"]
            assert (s["no_landing_row"], s["blocks_landed"], s["landing_rows_free"]) == (4, 4, 4)
        r.worker.check_invariants()
    finally:
        r.close()
