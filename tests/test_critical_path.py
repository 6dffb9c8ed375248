"""The main job's critical path: running ahead, the host waits for nothing but a
step's first tokens. The digests that verify every reused and written block are
queued behind the pass and compared later (``readback``), exactly and in step order;
the forward pass queues its uploads instead of synchronizing the stream (CUDA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvdist.layout import KVLayout
from kvdist.sim.experiment import clock
from kvdist.sim.experiment.integrity import BlockLedger
from kvdist.sim.experiment.job import solo
from kvdist.sim.experiment.options import RunOptions
from kvdist.sim.experiment.readback import Readback, StepDigests

from .test_sim_unit import sim_cfg


def _realtime_run(tmp_path, monkeypatch, *, ahead: bool, every: int) -> tuple[dict, int]:
    """The main job in real time; its results and how often its clock synchronized
    the device."""
    syncs = []
    monkeypatch.setattr(clock.StepTime, "sync", lambda self: syncs.append(1))
    cfg = sim_cfg(tmp_path, run_ahead=ahead, verify_logits_every=every, request_rate=1e6)
    sim = solo(cfg, RunOptions(out=None, progress=False), realtime=True, label="all tiers")
    try:
        return sim.run(), len(syncs)
    finally:
        sim.close()


def test_running_ahead_the_checks_never_synchronize(tmp_path, monkeypatch):
    """Without a logits recompute due, a step running ahead never pauses the clock
    (which synchronizes the device): only the run's start does. Every reused block is
    still compared, as many as the serial loop compares, and none mismatches."""
    serial, serial_syncs = _realtime_run(tmp_path / "a", monkeypatch, ahead=False, every=0)
    ahead, syncs = _realtime_run(tmp_path / "b", monkeypatch, ahead=True, every=0)
    assert ahead["ok"] and serial["ok"]
    assert ahead["integrity"]["blocks_checked"] == serial["integrity"]["blocks_checked"] > 100
    assert ahead["integrity_mismatches"] == 0
    assert serial_syncs > 2 * serial["steps"] > 0  # the serial loop pauses around every step's checks
    assert syncs == 1  # RealTime.start


def test_running_ahead_pauses_only_for_a_logits_recompute(tmp_path, monkeypatch):
    """A logits recompute due pauses the clock (twice synchronized) on that step only."""
    r, syncs = _realtime_run(tmp_path, monkeypatch, ahead=True, every=7)
    checked = r["integrity"]["logits_checked"]
    assert r["ok"] and checked > 2
    assert 1 + 2 * checked // 2 <= syncs <= 1 + 2 * checked  # a step may hold several due


# -- the readback, on its own ------------------------------------------------------------------
class _Event:
    """A CUDA event's stand-in: completed when the test says so."""

    def __init__(self):
        self.completed = False

    def query(self) -> bool:
        return self.completed

    def synchronize(self) -> None:
        self.completed = True

    def elapsed_time(self, end) -> float:
        return 2.0  # ms


def _ledger():
    return BlockLedger(KVLayout(2, 1, 4, "float32", 4), torch.device("cpu"))


def test_the_readback_compares_steps_in_order_once_their_digests_arrived():
    """Step 1 wrote two blocks, step 2 reused them (one of them changed). Until step
    1's digests arrived nothing is compared, step 2's included (its references would be
    missing); then both, in order: exactly one mismatch."""
    ledger = _ledger()
    rng = np.random.default_rng(0)
    ledger.admit("w", np.arange(8))
    ledger.admit("r", np.arange(9))
    kv = torch.from_numpy(rng.standard_normal((8, 2, 2, 1, 4)).astype(np.float32))
    keys = ledger.queue_written("w", 0, 8)
    written = ledger.token_digests(kv, ledger.positions([(0, 8)]))  # a share a token
    assert keys == ledger.keys("r", 2)  # the same prefix
    blocks = kv.unflatten(0, (2, 4)).transpose(1, 2).transpose(2, 3).clone()
    blocks[1, 0, 0, 0, 0, 0] += 1.0
    reread = ledger.digest_queued(blocks)
    first, second = _Event(), _Event()
    readback = Readback(ledger)
    readback.add(StepDigests([], [("w", 0, 8, keys)], written, done=first, started=first))
    readback.add(StepDigests([("r", keys)], [], reread, done=second, started=second))
    second.completed = True
    assert readback.poll() == 0.0 and len(readback) == 2 and ledger.checked_blocks == 0
    first.completed = True
    assert readback.poll() == pytest.approx(4e-3) and len(readback) == 0
    assert ledger.checked_blocks == 2 and ledger.mismatched_blocks == 1
    assert ledger.first_mismatch == "sequence 'r' block 1: bytes differ from every write"


def test_draining_waits_for_every_queued_step():
    ledger = _ledger()
    ledger.admit("w", np.arange(4))
    kv = torch.ones(4, 2, 2, 1, 4)
    keys = ledger.queue_written("w", 0, 4)
    written = ledger.token_digests(kv, ledger.positions([(0, 4)]))
    reread = ledger.digest_queued(kv.unflatten(0, (1, 4)).transpose(1, 2).transpose(2, 3))
    first, second = _Event(), _Event()
    readback = Readback(ledger)
    readback.add(StepDigests([], [("w", 0, 4, keys)], written, done=first, started=first))
    readback.add(StepDigests([("w", keys)], [], reread, done=second, started=second))
    assert readback.drain() == pytest.approx(4e-3) and first.completed and second.completed
    assert len(readback) == 0 and ledger.checked_blocks == 1 and ledger.mismatched_blocks == 0


# -- on a GPU ----------------------------------------------------------------------------------
ON_THE_PATH = ("kvdist/sim/engine/", "kvdist/sim/experiment/forward.py", "kvdist/sim/experiment/readback.py")


@pytest.mark.gpu
def test_cuda_running_ahead_the_pass_and_the_digests_never_synchronize(tmp_path):
    """Under CUDA's sync debug mode ('warn': every synchronizing call warns, naming its
    line), the main job runs ahead without logits recomputes: nothing of the forward
    pass (kvdist/sim/engine) nor of the queued digests synchronizes the stream. Every
    other synchronizing line is printed (the cache's, the run's end)."""
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    import warnings

    cfg = sim_cfg(tmp_path, run_ahead=True, verify_logits_every=0)
    cfg = cfg.replace(cache={"device": "cuda"}, workload={"compute_dtype": "float32", "cuda_graphs": False})
    sim = solo(cfg, RunOptions(out=None, progress=False))
    try:
        torch.cuda.synchronize()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            torch.cuda.set_sync_debug_mode("warn")
            try:
                r = sim.run()
            finally:
                torch.cuda.set_sync_debug_mode("default")
        sites: dict[str, int] = {}
        for w in caught:
            if "synchroniz" in str(w.message):
                where = f"{w.filename.split('/kvdist/', 1)[-1]}:{w.lineno}"
                sites[where] = sites.get(where, 0) + 1
        print(f"\nsynchronizing lines over {r['steps']} steps: {sites or 'none'}")
        assert r["ok"] and r["integrity_mismatches"] == 0 and r["integrity"]["blocks_checked"] > 100
        on_path = {k: n for k, n in sites.items() if any(("kvdist/" + k).startswith(p) for p in ON_THE_PATH)}
        assert not on_path, f"the forward pass or the digests synchronize: {on_path}"
    finally:
        sim.close()


# -- the cache's host cost a block (bench manager's breakdown) ---------------------------------
def test_the_breakdown_moves_the_same_blocks_both_ways():
    """bench manager's per-call breakdown: a step onboards a whole prompt from the host
    tier and offloads as many, block by block and in runs alike."""
    from kvdist.bench.manager import CALLS, breakdown

    runs = [breakdown(64, batch_moves=batch, steps=2) for batch in (False, True)]
    assert [r.mode for r in runs] == ["block by block", "runs at once"]
    assert runs[0].moved == runs[1].moved > 64  # a whole prompt onboarded, most of one offloaded
    for r in runs:
        assert set(r.calls) == set(CALLS) and all(len(v) == 2 for v in r.calls.values())


def test_a_step_digests_its_tokens_and_blocks_carry_over_steps_and_release():
    """Two steps' tokens digested a share a token, steps resolved later in order: a
    block begun in step 1 and completed in step 2 gets the digest of the whole block
    (as the cache's blocks are digested when reused), and the partial block of a
    sequence released before its digests arrived is dropped once they did."""
    ledger = _ledger()
    rng = np.random.default_rng(1)
    kv = torch.from_numpy(rng.standard_normal((14, 2, 2, 1, 4)).astype(np.float32))
    ledger.admit("a", np.arange(10))
    ledger.admit("b", np.arange(100, 105))
    step1 = [("a", 0, 6, ledger.queue_written("a", 0, 6)), ("b", 0, 5, ledger.queue_written("b", 0, 5))]
    assert ledger.positions([(0, 6), (0, 5)]).tolist() == [0, 1, 2, 3, 0, 1, 0, 1, 2, 3, 0]
    one = ledger.token_digests(torch.cat([kv[:6], kv[8:13]]), ledger.positions([(0, 6), (0, 5)]))
    step2 = [("a", 6, 2, ledger.queue_written("a", 6, 2))]
    two = ledger.token_digests(kv[6:8], ledger.positions([(6, 2)]))
    assert step2[0][3] == ledger.keys("a", 2)[1:] and ledger.positions([(6, 2)]).tolist() == [2, 3]
    first, second = _Event(), _Event()
    readback = Readback(ledger)
    readback.add(StepDigests([], step1, one, done=first, started=first))
    readback.add(StepDigests([], step2, two, done=second, started=second))
    ledger.release("a")
    ledger.release("b")
    ledger.check_invariants()
    first.completed = True
    readback.poll()
    ledger.check_invariants()
    assert ledger.partial_blocks == 1  # a's block 1 waits for step 2; b's partial block dropped
    second.completed = True
    readback.poll()
    ledger.check_invariants()
    assert ledger.partial_blocks == 0
    blocks = lambda t: t.unflatten(0, (-1, 4)).transpose(1, 2).transpose(2, 3)  # noqa: E731
    a_blocks = ledger.digest_queued(blocks(kv[:8])).tolist()
    b_block = ledger.digest_queued(blocks(kv[8:12])).tolist()
    ledger.admit("r", np.arange(8))
    ledger.admit("s", np.arange(100, 104))
    assert ledger.check_reused("r", a_blocks) == 0 and ledger.check_reused("s", b_block) == 0
    assert ledger.checked_blocks == 3 and len(ledger.ref) == 3
    changed = kv[:8].clone()
    changed[5, 1, 0, 0, 2] += 1.0  # a token of a's block 1, written in step 1
    assert ledger.check_reused("r", ledger.digest_queued(blocks(changed)).tolist()) == 1
