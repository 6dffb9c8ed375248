"""The synchronization rules on the engine's blocks (``cache.gpu: external``), on CPU
with simulated streams: every copy is queued and runs only when something that must
follow it is forced, the latest first, copies by layer group. Each test shows wrong
bytes in the engine's tensors with its rule switched off (``Seams(rules=...)``) and
the right ones with it on."""

from __future__ import annotations

import pytest
import torch

from kvdist.external import ExternalPlanner, create
from kvdist.seams import Seams
from kvdist.transfer import ALL_RULES

from .external_kv import L, T, block_bytes, config, vllm_kv

A = list(range(1, T + 2))  # one full block and a token
B = list(range(50, 50 + T + 1))


def _pair(rules, host_blocks: int = 1):
    cfg = config(host_blocks=host_blocks, simulate_async=True, layer_groups=L)
    worker = create(cfg, seams=Seams(rules=rules))
    kv = vllm_kv(8)
    worker.register(kv)
    assert worker.executor.layered, "copies by layer group: compute waits layer by layer"
    return ExternalPlanner(cfg, worker.tier_plan), worker, kv


def _layers(kv, block: int) -> list[torch.Tensor]:
    return [block_bytes(kv, block, layer) for layer in range(L)]


@pytest.mark.parametrize("rules", [ALL_RULES, ALL_RULES - {"S2"}], ids=["S2", "S2-off"])
def test_s2_a_save_into_a_host_slot_waits_for_the_load_still_reading_it(rules):
    """One host slot: block A is loaded into engine block 5 while, in the same step, a
    save of block B evicts A and takes its slot. The save's write must wait for the
    load's read of the slot."""
    planner, worker, kv = _pair(rules)
    want = _layers(kv, 0)
    planner.plan_save("a", A, [0])
    worker.start(planner.take())
    worker.synchronize()
    planner.plan_load("r", A, [5])
    planner.plan_save("b", B, [1])  # evicts A (no disk: dropped), reuses its slot
    t = planner.take()
    assert [r.name for r in t.routes()] == ["onboard", "offload"] and t.src[0] == t.dst[1] == 0
    worker.start(t)
    worker.synchronize()  # the host waits for every copy: the latest is forced first
    got = _layers(kv, 5)
    if "S2" in rules:
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    else:
        assert not any(torch.equal(g, w) for g, w in zip(got, want)), "S2 off and still right"
    worker.close()


@pytest.mark.parametrize("rules", [ALL_RULES, ALL_RULES - {"S4"}], ids=["S4", "S4-off"])
def test_s4_a_save_waits_for_the_forward_pass_that_wrote_its_block(rules):
    """The forward pass writes engine block 0 (a kernel queued on the simulated compute
    stream, not run yet); the save of block 0 is issued after it. The save must copy
    what the kernel wrote: reloaded into block 5, the kernel's bytes."""
    planner, worker, kv = _pair(rules)
    fresh = vllm_kv(8, seed=7)
    want = _layers(fresh, 0)

    def forward() -> None:
        for layer in range(L):
            kv[layer][0] = fresh[layer][0]
    worker.executor.simulated_compute.kernel(forward)
    planner.plan_save("a", A, [0])
    worker.start(planner.take())
    planner.plan_load("r", A, [5])
    worker.start(planner.take())
    worker.synchronize()
    got = _layers(kv, 5)
    if "S4" in rules:
        assert all(torch.equal(g, w) for g, w in zip(got, want))
    else:
        assert not any(torch.equal(g, w) for g, w in zip(got, want)), "S4 off and still right"
    worker.close()


@pytest.mark.parametrize("rules", [ALL_RULES, ALL_RULES - {"S5"}], ids=["S5", "S5-off"])
def test_s5_attention_reads_a_layer_only_after_its_load_landed(rules):
    """A block is loaded into engine block 5; the forward pass (a kernel) reads block 5
    layer by layer, each after ``wait_layer``. Every layer must hold the loaded bytes;
    the loads of later layers need not have run when an earlier layer is read."""
    planner, worker, kv = _pair(rules)
    want = _layers(kv, 0)
    planner.plan_save("a", A, [0])
    worker.start(planner.take())
    worker.synchronize()
    planner.plan_load("r", A, [5])
    worker.start(planner.take())
    seen: list[torch.Tensor] = []
    pending: list[int] = []
    sim = worker.executor

    def forward() -> None:
        for layer in range(L):
            worker.wait_layer(layer)
            seen.append(block_bytes(kv, 5, layer))
            pending.append(sim.queued())
    sim.force(sim.simulated_compute.kernel(forward))
    if "S5" in rules:
        assert all(torch.equal(g, w) for g, w in zip(seen, want))
        # queued at each read: the later layers' groups, and the running kernel itself
        assert pending == [3, 2, 1], "each layer's group runs when that layer is read, not before"
    else:
        assert not any(torch.equal(g, w) for g, w in zip(seen, want)), "S5 off and still right"
    worker.synchronize()
    worker.close()


@pytest.mark.parametrize("rules", [ALL_RULES, ALL_RULES - {"S5"}], ids=["fence", "fence-off"])
def test_a_fence_holds_the_forward_until_the_saves_of_blocks_freed_early_ran(rules):
    """A save issued behind a step's forward (``save``) is still queued when the engine
    frees its block early (a preempted request) and the next forward writes it: ``fence``
    makes that forward wait for the save, which copies the bytes the block held."""
    planner, worker, kv = _pair(rules)
    want = _layers(kv, 0)
    planner.plan_save("a", A, [0])
    worker.save(planner.take())
    assert worker.executor.queued() == L and worker.saving() == {"a"}  # a copy a layer group, none run
    worker.fence(["a"])
    for t in kv:  # the next forward writes engine block 0 (freed) ...
        t[0] = 0
    worker.synchronize()
    planner.plan_load("r", A, [5])  # ... and what kvdist saved is loaded elsewhere
    worker.start(planner.take())
    worker.synchronize()
    got = _layers(kv, 5)
    if "S5" in rules:
        assert all(torch.equal(g, w) for g, w in zip(got, want))
        assert worker.finished().saved == {"a"} and worker.saving() == set()
    else:
        assert not any(torch.equal(g, w) for g, w in zip(got, want)), "fence off and still right"
    worker.close()
