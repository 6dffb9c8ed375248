"""The five transfer races of issue 3, each built through ``kvdist.create`` and the cache
API with tiny tiers, so every slot id is known and asserted.

Each scenario runs with its rule (docs/design.md, "Synchronization rules") and without
it, switched off through the cache's test seams: with the rule the
bytes are exact, without it they are wrong (scenario 4: see its docstring). Here the
streams are simulated (``simulate_async``): nothing runs until something that must
follow it waits, adversarially ordered, and a test may hold a stream. The same
scenario functions run on CUDA in ``test_transfer_cuda.py``, with streams gated on a
host flag.

Geometry (tests/conftest.py): 2 layers x K/V x 4 tokens x 2 heads x 8 dims, fp16, so
a block is 512 bytes and a 4-token prompt fills one block. A block's content is a
tag: every K and V element of every layer holds that number."""

from __future__ import annotations

import pytest
import torch

import kvdist
import kvdist.testing
from kvdist.testing import Seams
from kvdist.transfer import ALL_RULES, OFFLOAD, ONBOARD, SimDeadlock

# Prompts of one block each (4 tokens), distinct from one another.
A, B, C, D, S, V, X, Y, Z = ([10 * i + k for k in range(1, 5)] for i in range(1, 10))
WITHOUT = {rule: ALL_RULES - {rule} for rule in ALL_RULES}


class SimHarness:
    """Drives a CPU cache whose copies run on simulated streams."""

    def __init__(self, cfg: dict, rules=ALL_RULES, tracking: str = "slot"):
        self.seams = Seams(rules=rules, tracking=tracking, batch_log=[])
        self.cache = kvdist.testing.create(cfg, self.seams)
        self.engine = self.seams.engine
        self.ex = self.seams.executor
        self.reused: dict[object, int] = {}
        self._held: list[str] = []

    # -- streams -------------------------------------------------------------------------
    def hold(self, stream: str) -> None:
        """Hold ``stream`` ("offload", "onboard" or "compute") until the compute barrier."""
        self.ex.hold(stream)
        self._held.append(stream)

    def release_all(self) -> None:
        for stream in self._held:
            self.ex.release(stream)
        self._held.clear()

    def block_table(self, seq_ids: list) -> torch.Tensor:
        # The host is the compute stream here and would wait for held work: release first.
        self.release_all()
        return self.cache.block_table(seq_ids)

    def go(self) -> None:
        """The step's kernels are launched: held streams may run (on CUDA; here they
        were released at the compute barrier already)."""
        self.release_all()

    def kernel_write(self, slot: int, tag: float) -> None:
        """A kernel on the compute stream that writes the whole block."""
        self.ex.kernel(lambda: fill(self.cache, slot, tag))

    def kernel_read(self, slot: int):
        """A kernel on the compute stream that reads the block, launched now; the
        returned callable gives what it read (after ``synchronize``)."""
        out = {}
        op = self.ex.kernel(lambda: out.setdefault("v", block_tag(self.cache, slot)))
        self.ex.force(op)
        return lambda: out["v"]

    def host_tag(self, slot: int):
        return host_tag(self.seams, slot)

    def queued(self) -> int:
        return self.ex.queued()

    def close(self) -> None:
        self.release_all()
        self.cache.close()

    # -- steps -----------------------------------------------------------------------------
    def add(self, sid, tokens: list[int], prio: int) -> list[int]:
        self.reused[sid] = self.cache.add_sequence(sid, tokens, prio)
        return list(self.seams.manager.seqs[sid].slots)

    def compute(self, sid, tag: float) -> None:
        """The forward pass writes ``tag`` into the blocks it computes (not the reused ones)."""
        tpb = self.cache.layout.tokens_per_block
        for slot in self.seams.manager.seqs[sid].slots[self.reused[sid] // tpb:]:
            fill(self.cache, slot, tag)

    def prefill(self, sid, tokens: list[int], prio: int, tag: float) -> list[int]:
        """One whole step: admit, block table, compute, end, release."""
        c = self.cache
        c.begin_step()
        slots = self.add(sid, tokens, prio)
        self.block_table([sid])
        self.compute(sid, tag)
        self.go()
        c.end_step()
        c.release(sid)
        c.check_invariants()
        return slots

    def mark(self) -> None:
        """Forget the batches submitted so far (``moves`` starts from here)."""
        self.seams.batch_log.clear()

    def moves(self, direction: str) -> list[tuple[list[int], list[int]]]:
        """(source, destination) tier-local slots of the batches of ``direction`` since ``mark``."""
        return [(s, d) for name, s, d in self.seams.batch_log if name == direction]


def fill(cache, slot: int, tag: float) -> None:
    for layer in range(cache.layout.num_layers):
        cache.kv_pool(layer)[slot] = tag


def tag_of(values: torch.Tensor):
    """The tag a block holds, or the set of values when it holds no single tag."""
    u = torch.unique(values.reshape(-1).float().cpu()).tolist()
    return u[0] if len(u) == 1 else tuple(u)


def block_tag(cache, slot: int):
    return tag_of(torch.stack([cache.kv_pool(layer)[slot] for layer in range(cache.layout.num_layers)]))


def host_tag(seams: Seams, slot: int):
    return tag_of(seams.host.raw[slot].view(torch.float16))


# -- the scenarios (shared with test_transfer_cuda.py) ------------------------------------------
def same_host_slot_twice(h) -> dict:
    """(1) Two GPU blocks offloaded into the same host slot in one step: A (priority 10)
    is evicted first into host slot 0; then C: the host is full, A is dropped from it
    and C goes into host slot 0 too. S2 keeps the two offloads in separate, ordered
    batches; without it they share one batch with no order, and A can land last."""
    c = h.cache
    assert h.prefill("c", C, 35, 30.0) == [0]
    assert h.prefill("a", A, 10, 10.0) == [1]
    assert h.prefill("b", B, 80, 20.0) == [2]
    h.mark()
    c.begin_step()
    h.hold("offload")
    assert h.add("d", D + S, 35) == [0, 1]  # two fresh blocks: A's and C's old slots
    h.block_table(["d"])
    h.compute("d", 40.0)
    h.go()
    c.end_step()
    c.release("d")
    c.check_invariants()
    c.synchronize()
    pairs = [(s, d) for src, dst in h.moves("offload") for s, d in zip(src, dst)]
    assert sorted(pairs) == [(0, 0), (1, 0)], pairs  # g1 (A) and g0 (C) both into host slot 0
    host0 = h.host_tag(0)
    c.begin_step()
    assert h.add("e", C + [99], 35) == [0, 1] and h.reused["e"] == 4  # C comes back from the host
    h.block_table(["e"])
    h.compute("e", 50.0)
    h.go()
    c.end_step()
    c.synchronize()
    reused = block_tag(c, 0)
    c.release("e")
    c.check_invariants()
    return {"host slot 0": host0, "C reused from host": reused}


SAME_HOST_SLOT_RIGHT = {"host slot 0": 30.0, "C reused from host": 30.0}


def swap_slots(h) -> dict:
    """(2) Blocks swap physical slots during offload: Y leaves host slot 0 (onboarded
    into GPU slot 0) while X is offloaded into host slot 0. The offload must wait for
    the onboard's read of host slot 0: pending copies follow the slot. Keyed by block
    id (X vs Y) the two copies look unrelated and X can overwrite Y before it is read."""
    c = h.cache
    assert h.prefill("y", Y, 10, 50.0) == [0]
    assert h.prefill("x", X, 35, 60.0) == [1]
    assert h.prefill("v", V + [1], 5, 70.0) == [0, 2]  # evicts Y into host slot 0
    h.mark()
    c.begin_step()
    h.hold("onboard")
    assert h.add("s1", Y + [2], 35) == [0, 2] and h.reused["s1"] == 4  # V dropped; Y -> g0
    assert h.add("s2", S, 35) == [1]  # evicts X into host slot 0, which Y just left
    h.block_table(["s1", "s2"])
    h.compute("s1", 71.0)
    h.compute("s2", 72.0)
    h.go()
    c.end_step()
    c.synchronize()
    assert h.moves("onboard") == [([0], [0])] and h.moves("offload") == [([1], [0])]
    got = {"Y reused in GPU slot 0": block_tag(c, 0), "host slot 0 (X)": h.host_tag(0)}
    c.release("s1")
    c.release("s2")
    c.check_invariants()
    return got


SWAP_RIGHT = {"Y reused in GPU slot 0": 50.0, "host slot 0 (X)": 60.0}


def onboard_into_offloading_slot(h) -> dict:
    """(3) Onboarding into a GPU slot whose previous content is still being offloaded:
    X leaves GPU slot 0 for host slot 1 while Y comes from host slot 0 into GPU slot 0.
    S2: the onboard waits for the offload's read of GPU slot 0."""
    c = h.cache
    assert h.prefill("y", Y, 10, 50.0) == [0]
    assert h.prefill("x", X + [1], 35, 60.0) == [0, 1]  # evicts Y into host slot 0
    h.mark()
    c.begin_step()
    h.hold("offload")
    assert h.add("s", Y + [2], 35) == [0, 1] and h.reused["s"] == 4
    h.block_table(["s"])
    h.compute("s", 70.0)
    h.go()
    c.end_step()
    c.release("s")
    c.check_invariants()
    c.synchronize()
    assert h.moves("offload") == [([0], [1])] and h.moves("onboard") == [([0], [0])]
    got = {"host slot 1 (X)": h.host_tag(1), "Y in GPU slot 0": block_tag(c, 0)}
    c.begin_step()
    h.add("x2", X + [3], 35)
    assert h.reused["x2"] == 4  # X comes back from host slot 1
    h.block_table(["x2"])
    h.compute("x2", 80.0)
    h.go()
    c.end_step()
    c.synchronize()
    got["X reused"] = block_tag(c, h.seams.manager.seqs["x2"].slots[0])
    c.release("x2")
    c.check_invariants()
    return got


ONBOARD_INTO_OFFLOADING_RIGHT = {"host slot 1 (X)": 60.0, "Y in GPU slot 0": 50.0, "X reused": 60.0}


def gpu_and_host_slot0(h) -> dict:
    """(4) GPU slot 0 and host slot 0 pending at once: X is offloaded from GPU slot 1
    into host slot 0 while Y is onboarded from host slot 1 into GPU slot 0. The copies
    are unrelated; tracked by global slot they run independently.

    Tier-local keys alias the two slots 0. In this engine every copy waits for all
    pending accesses of its keys, so aliasing only merges keys: it adds dependencies
    (never drops one) and cannot produce wrong bytes. What it produces is a false
    dependency: the onboard waits for the unrelated offload, serializing the two
    directions (a held offload stream holds the onboard too). The copies are queued
    directly on the cache's engine, since the manager's cascade never issues this pair
    without a real dependency between them."""
    c = h.cache
    tag = {"X": 60.0, "Y": 50.0}
    fill(c, 1, tag["X"])
    h.seams.host.raw[1].view(torch.float16).fill_(tag["Y"])
    G = h.seams.manager.space.base[1]  # global id of host slot 0
    c.synchronize()
    c.begin_step()
    h.hold("offload")
    h.engine.copy(OFFLOAD, 1, G + 0)  # X: GPU slot 1 -> host slot 0
    h.engine.copy(ONBOARD, G + 1, 0)  # Y: host slot 1 -> GPU slot 0
    h.engine.flush()
    independent = h.onboard_completes_while_offload_held()
    h.release_all()
    c.synchronize()
    return {"onboard independent of the held offload": independent,
            "GPU slot 0 (Y)": block_tag(c, 0), "host slot 0 (X)": h.host_tag(0)}


GPU_AND_HOST_SLOT0_RIGHT = {"onboard independent of the held offload": True,
                            "GPU slot 0 (Y)": 50.0, "host slot 0 (X)": 60.0}


def offload_while_kernel_writes(h) -> dict:
    """(5a) S4: offloading a block that the previous step's kernel is still writing.
    The kernel that writes X runs behind on a held compute stream when step 1 ends;
    step 2 evicts X. The offload must wait for the compute stream as it was at
    ``begin_step``."""
    c = h.cache
    c.begin_step()
    assert h.add("x", X, 35) == [0]
    h.block_table(["x"])
    h.hold("compute")
    h.kernel_write(0, 60.0)  # the forward pass is still writing X when the step ends
    c.end_step()
    c.release("x")
    c.begin_step()
    assert h.add("s", S + [1], 35) == [0, 1]  # evicts X into host slot 0
    h.block_table(["s"])
    h.compute("s", 70.0)
    h.go()
    c.end_step()
    c.release("s")
    c.check_invariants()
    c.synchronize()
    assert h.moves("offload") == [([0], [0])]
    return {"host slot 0 (X)": h.host_tag(0), "GPU slot 0 (S)": block_tag(c, 0)}


OFFLOAD_WHILE_KERNEL_WRITES_RIGHT = {"host slot 0 (X)": 60.0, "GPU slot 0 (S)": 70.0}


def kernel_reads_onboarding_block(h) -> dict:
    """(5b) S5: a kernel reading a block that is still being onboarded. Y comes back
    from host slot 0 into GPU slot 1 on a held onboard stream; the attention kernel
    reads it right after ``block_table``."""
    c = h.cache
    assert h.prefill("y", Y, 10, 50.0) == [0]
    assert h.prefill("x", X, 35, 60.0) == [1]
    assert h.prefill("z", Z + [1], 35, 70.0) == [0, 2]  # evicts Y into host slot 0
    h.mark()
    c.begin_step()
    h.hold("onboard")
    assert h.add("s", Y + [2], 35) == [1, 2] and h.reused["s"] == 4  # X dropped; Y -> g1
    h.block_table(["s"])
    seen = h.kernel_read(1)
    h.compute("s", 80.0)
    h.go()
    c.end_step()
    c.release("s")
    c.check_invariants()
    c.synchronize()
    assert h.moves("onboard") == [([0], [1])]
    return {"kernel read of Y": seen(), "GPU slot 1 (Y)": block_tag(c, 1)}


KERNEL_READS_ONBOARDING_RIGHT = {"kernel read of Y": 50.0, "GPU slot 1 (Y)": 50.0}

# (scenario, tier sizes (gpu, host), right result, the rule-off case)
SCENARIOS = {
    "1-same-host-slot": (same_host_slot_twice, (3, 1), SAME_HOST_SLOT_RIGHT, (WITHOUT["S2"], "slot")),
    "2-swap-slots": (swap_slots, (3, 1), SWAP_RIGHT, (ALL_RULES, "block")),
    "3-onboard-into-offloading": (onboard_into_offloading_slot, (2, 2), ONBOARD_INTO_OFFLOADING_RIGHT,
                                  (WITHOUT["S2"], "slot")),
    "4-gpu-and-host-slot0": (gpu_and_host_slot0, (4, 4), GPU_AND_HOST_SLOT0_RIGHT, (ALL_RULES, "local")),
    "5a-S4-kernel-still-writing": (offload_while_kernel_writes, (2, 2), OFFLOAD_WHILE_KERNEL_WRITES_RIGHT,
                                   (WITHOUT["S4"], "slot")),
    "5b-S5-kernel-reads-onboarding": (kernel_reads_onboarding_block, (3, 1), KERNEL_READS_ONBOARDING_RIGHT,
                                      (WITHOUT["S5"], "slot")),
}


class _SimHarness4(SimHarness):
    def onboard_completes_while_offload_held(self) -> bool:
        try:
            self.ex.force(self.ex.streams["onboard"].last)  # the onboard batch
        except SimDeadlock:
            return False
        return True


def _run_sim(cfg_factory, name: str, rule_on: bool, layer_groups: int = 1) -> tuple[dict, dict]:
    """The rule-off cases run with whole-step S5 (``layer_groups`` 1): the simulated
    streams run copies as late as the rules allow, and a missing S2 or S4 wait shows
    when S5 forces a whole step's copies at once, latest first. Waits by layer group
    have their own race tests (test_layerwise.py)."""
    fn, (gpu, host), right, (rules_off, tracking_off) = SCENARIOS[name]
    cfg = cfg_factory(gpu=gpu, host=host, simulate_async=True, layer_groups=layer_groups)
    h = _SimHarness4(cfg, *((ALL_RULES, "slot") if rule_on else (rules_off, tracking_off)))
    try:
        return fn(h), right
    finally:
        h.close()


@pytest.mark.parametrize("layer_groups", [1, 2], ids=["whole-step", "by-layer"])
@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_exact_bytes_with_the_rule(cfg_factory, name, layer_groups):
    got, right = _run_sim(cfg_factory, name, rule_on=True, layer_groups=layer_groups)
    assert got == right


@pytest.mark.parametrize("name", SCENARIOS)
def test_scenario_rule_off_goes_wrong(cfg_factory, name):
    got, right = _run_sim(cfg_factory, name, rule_on=False)
    if name == "4-gpu-and-host-slot0":
        # Aliased keys: the same right bytes, but the onboard now waits for the offload.
        assert got == {**right, "onboard independent of the held offload": False}
    else:
        assert got != right
        wrong = {k for k in right if got[k] != right[k]}
        assert wrong, got
    print(f"\n{name} rule off: {got} (right: {right})")


# -- how a batch becomes few copy calls (CPU: the planning is numpy) ------------------------
def test_coalesce_finds_runs_of_adjacent_slots():
    import numpy as np

    from kvdist.transfer.batchcopy import coalesce

    src = np.array([7, 3, 4, 5, 9, 8, 0])
    dst = np.array([2, 10, 11, 12, 30, 3, 40])
    s0, d0, n = coalesce(src, dst)
    # by source slot: 0->40 | 3,4,5->10,11,12 | 7,8->2,3 | 9->30
    assert s0.tolist() == [0, 3, 7, 9] and d0.tolist() == [40, 10, 2, 30] and n.tolist() == [1, 3, 2, 1]
    # Two copies into one slot (only without S2) never merge: each stays its own run.
    s0, d0, n = coalesce(np.array([1, 0]), np.array([0, 0]))
    assert s0.tolist() == [0, 1] and d0.tolist() == [0, 0] and n.tolist() == [1, 1]
    # A host tier registered in chunks of 4 blocks: no run crosses slot 4 or 8.
    s0, d0, n = coalesce(np.arange(2, 11), np.arange(2, 11) + 100, src_chunk=4)
    assert s0.tolist() == [2, 4, 8] and n.tolist() == [2, 4, 3]
    s0, d0, n = coalesce(np.arange(0, 6) + 50, np.arange(3, 9), dst_chunk=4)
    assert d0.tolist() == [3, 4, 8] and n.tolist() == [1, 4, 1]


def test_copy_many_is_copy_one_by_one(cfg_factory):
    """The bulk entry point makes the same batches, waits and bytes as ``copy`` in a
    loop, including when the copies conflict with open batches or among themselves."""
    results = []
    for bulk in (False, True):
        seams = Seams(batch_log=[])
        cache = kvdist.testing.create(cfg_factory(gpu=16, host=16, simulate_async=True), seams)
        try:
            engine, G = seams.engine, seams.manager.space.base[1]
            for slot in range(16):
                fill(cache, slot, float(slot + 1))
            rounds = [
                (OFFLOAD, [3, 1, 2, 9], [G + 0, G + 5, G + 6, G + 7]),
                (ONBOARD, [G + 5, G + 6], [10, 11]),  # reads host slots being written
                (OFFLOAD, [4, 5], [G + 8, G + 8]),  # two offloads into one host slot: a hazard inside
                (ONBOARD, [G + 0, G + 8], [12, 13]),
            ]
            engine.begin_step()
            for route, src, dst in rounds:
                if bulk:
                    engine.copy_many(route, src, dst)
                else:
                    for s, d in zip(src, dst):
                        engine.copy(route, s, d)
            engine.before_compute()
            cache.synchronize()
            results.append((seams.batch_log, [block_tag(cache, s) for s in range(16)],
                            [host_tag(seams, s) for s in range(16)], engine.stats.conflict_flushes,
                            engine.stats.waits))
        finally:
            cache.close()
    assert results[0] == results[1]
    log, gpu_tags, host_tags, flushes, waits = results[0]
    assert gpu_tags[10:14] == [2.0, 3.0, 4.0, 6.0] and host_tags[8] == 6.0 and flushes == 3
