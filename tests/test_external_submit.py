"""The order in which ``ExternalCache`` hands a call's copies to the transfer engine
(``kvdist.external.submit``): batches of at most ``SUBMIT_BYTES``, loads first and in
turns with saves when they touch no slot in common, else the planner's order; the
bytes are those of the planner's order either way."""

from __future__ import annotations

import pytest

from kvdist.external import ExternalPlanner, create
from kvdist.external import cache as external_cache
from kvdist.seams import Seams

from .external_kv import BLOCK_BYTES, L, T, config, snapshot, vllm_kv

PROMPT = list(range(100, 100 + 5 * T + 1))
OTHER = list(range(900, 900 + 4 * T + 1))


@pytest.fixture
def made(monkeypatch):
    """(planner, worker, kv, batch log) with batches of two blocks at most."""
    monkeypatch.setattr(external_cache, "SUBMIT_BYTES", 2 * BLOCK_BYTES)
    log: list = []
    kv = vllm_kv(16)
    worker = create(config(host_blocks=12), seams=Seams(batch_log=log))
    worker.register(kv)
    yield ExternalPlanner(config(host_blocks=12), worker.tier_plan), worker, kv, log
    worker.close()


def _landed(kv, before, moved: dict[int, int]) -> None:
    now = snapshot(kv)
    for layer in range(L):
        for b, got in enumerate(now[layer]):
            assert got.equal(before[layer][moved.get(b, b)]), (layer, b)


def test_loads_go_first_and_in_turns_with_saves_in_batches_of_submit_bytes(made):
    planner, worker, kv, log = made
    before = snapshot(kv)
    planner.plan_save("a", OTHER, [12, 13, 14, 15])
    worker.start(planner.take())
    log.clear()
    planner.plan_save("b", PROMPT, [0, 1, 2, 3, 4])  # host slots 4..8
    assert planner.plan_load("c", OTHER, [5, 6, 7, 8]).blocks == (5, 6, 7, 8)  # from host slots 0..3
    worker.start(planner.take())
    worker.synchronize()
    assert log == [("onboard", [0, 1], [5, 6]), ("offload", [0, 1], [4, 5]), ("onboard", [2, 3], [7, 8]),
                   ("offload", [2, 3], [6, 7]), ("offload", [4], [8])]
    assert worker.finished().loaded == {"c"}
    _landed(kv, before, {5: 12, 6: 13, 7: 14, 8: 15})
    planner.plan_load("d", PROMPT, [9, 10, 11, 0, 1])
    worker.start(planner.take())
    worker.synchronize()
    _landed(kv, before, {5: 12, 6: 13, 7: 14, 8: 15, 9: 0, 10: 1, 11: 2, 0: 3, 1: 4})


def test_loads_and_saves_sharing_a_slot_keep_the_planners_order(made):
    """The load reads the host slots the save of the same call writes: it must follow it."""
    planner, worker, kv, log = made
    before = snapshot(kv)
    planner.plan_save("a", PROMPT, [0, 1, 2])
    assert planner.plan_load("b", PROMPT, [5, 6, 7]).blocks == (5, 6, 7)
    worker.start(planner.take())
    worker.synchronize()
    assert log == [("offload", [0, 1], [0, 1]), ("offload", [2], [2]), ("onboard", [0], [5]),
                   ("onboard", [1, 2], [6, 7])]  # batches of two copies, cut across runs
    _landed(kv, before, {5: 0, 6: 1, 7: 2})
