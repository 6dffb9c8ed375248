"""Rule S4 while the scheduler runs ahead: step N+1's onboards into GPU slots that step
N's kernels do not use start while those kernels still run. Only a copy touching a slot
an unfinished step's kernels use waits for them (``KVCache.block_table`` submits the
step's queued copies before it marks the step's own rows as used by its kernels).

On simulated streams (``simulate_async``), with the driver one step ahead of its
kernels (``runs_behind``): step N's kernel is queued and runs only when something
waits for it; an onboard that waits for it makes it run."""

from __future__ import annotations

import pytest

from kvdist.transfer import ALL_RULES

from .test_transfer_scenarios import SimHarness, X, Y, Z, block_tag, fill


def _step_n_kernel_still_running(h: SimHarness, tail: list[int], slots: list[int]) -> object:
    """Step N: X's sequence continues with ``tail`` in ``slots``; its kernel, which
    writes 65 into the block after X's, is queued behind and not run."""
    c = h.cache
    c.begin_step()
    assert h.add("x2", X + tail, 35) == slots and h.reused["x2"] == 4
    h.block_table(["x2"])
    kernel = h.ex.kernel(lambda: fill(c, slots[1], 65.0))
    c.end_step()
    return kernel


def test_next_steps_onboard_runs_while_this_steps_kernels_run(cfg_factory):
    h = SimHarness(cfg_factory(gpu=4, host=4, simulate_async=True))
    c = h.cache
    try:
        assert h.prefill("y", Y, 10, 50.0) == [0]
        assert h.prefill("x", X, 35, 60.0) == [1]
        assert h.prefill("z", Z + [1] * 8, 35, 70.0) == [0, 2, 3]  # Y goes to host slot 0
        h.ex.runs_behind = True  # the driver runs one step ahead of its kernels
        kernel = _step_n_kernel_still_running(h, [3], [1, 3])
        h.mark()
        c.begin_step()  # S4's compute event: step N's kernel, still queued
        assert h.add("s", Y + [2], 35) == [0, 2] and h.reused["s"] == 4  # Y -> GPU slot 0
        h.block_table(["x2", "s"])  # S5: compute runs the copies it waits for, here on the host
        assert h.moves("offload") == [([2, 0], [2, 3])] and h.moves("onboard") == [([0], [0])]
        assert not kernel.done, ("step N+1's onboard into GPU slot 0 waited for step N's kernel, "
                                 "which never uses slot 0")
        assert block_tag(c, 0) == 50.0  # Y landed while step N still runs
        h.release_all()
        c.end_step()
        c.synchronize()
        assert block_tag(c, 3) == 65.0
        c.release("x2")
        c.release("s")
        c.check_invariants()
    finally:
        h.close()


MOVES = [("offload", [0, 2], [1, 2]), ("onboard", [0], [2])]  # z's and x2's blocks out, Y in


@pytest.mark.parametrize("rules", ["all", "without-S4"])
def test_an_onboard_into_a_slot_step_n_uses_still_waits(cfg_factory, rules):
    """The other side: x2 finishes while its step N kernel is still queued, and Y comes
    back into GPU slot 2, which that kernel writes, after x2's block there is offloaded.
    Both copies wait for the kernel (S4): the host keeps x2's block as the kernel wrote
    it, and Y's bytes survive. Without S4 the offload reads slot 2 before the kernel
    writes it, and the kernel then overwrites Y."""
    h = SimHarness(cfg_factory(gpu=3, host=4, simulate_async=True),
                   ALL_RULES if rules == "all" else ALL_RULES - {"S4"})
    c = h.cache
    try:
        assert h.prefill("y", Y, 10, 50.0) == [0]
        assert h.prefill("x", X, 35, 60.0) == [1]
        assert h.prefill("z", Z + [1], 35, 70.0) == [0, 2]  # Y goes to host slot 0
        h.ex.runs_behind = True
        kernel = _step_n_kernel_still_running(h, [3] * 4, [1, 2])
        c.release("x2")  # finished: its blocks go back to the pool while its kernel runs
        h.mark()
        c.begin_step()
        slots = h.add("s", Y + [2], 35)
        h.block_table(["s"])
        moves = h.seams.batch_log[:]
        c.end_step()
        c.synchronize()
        assert kernel.done
        got = (slots, h.reused["s"], moves, block_tag(c, 2), h.host_tag(2))
        c.release("s")
        c.check_invariants()
    finally:
        h.close()
    print(got)
    if rules == "all":
        assert got == ([2, 0], 4, MOVES, 50.0, 65.0)
    else:
        assert got[:3] == ([2, 0], 4, MOVES) and got[3:] != (50.0, 65.0)
