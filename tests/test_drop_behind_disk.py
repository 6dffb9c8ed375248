"""An offload never waits on the host for a disk write (``BlockPool.drop_behind_disk``):
when the host slots ``demote_ahead`` freed are still being written to disk, the offload
takes the slot of the host tier's coldest block, which is dropped rather than demoted.

Simulated streams with the disk stream held make the wait visible without a GPU: an
offload into a slot a held demotion still reads can only run after it, so the next
step's compute, which overwrites the offloaded GPU slot, raises ``SimDeadlock``."""

from __future__ import annotations

import contextlib

import pytest

import kvdist
from kvdist.seams import Seams
from kvdist.testing import IntegrityDriver
from kvdist.transfer import SimDeadlock, SimExecutor


def _prompt(k: int) -> list[int]:
    return [10_000 * (k + 1) + j for j in range(8)] + [1]  # 2 full blocks and one token


def _run(cfg_factory, drop_behind: bool, peer: list[list[int]] | None = None):
    """Prompts of 2 blocks, one a step, on a GPU tier of 3 blocks over a host tier of 6
    and a disk tier whose stream is held from the start (no demotion ever finishes).
    ``peer``: instead, this rank's disk stream runs, and another rank of its TP group
    sends these figures to each end_step's MIN-reduce (what a held run answered)."""
    cfg = cfg_factory(gpu=3, host=6, disk=16, simulate_async=True)
    cfg["cache"]["disk"].update(demote_ahead=0.34, drop_behind=drop_behind)
    seams = Seams()
    cache = kvdist.testing.create(cfg, seams)
    ex = seams.executor
    assert isinstance(ex, SimExecutor)
    comm, reduce, answers = seams.comm, seams.comm.allreduce_min, []

    def group_min(values, what):  # this rank's figures, and the peer's when there is one
        answers.append(list(values))
        mine = reduce(values, what)
        if peer is None:
            return mine
        return [min(a, b) for a, b in zip(mine, peer[len(answers) - 1], strict=True)]
    comm.allreduce_min = group_min
    if peer is None:
        ex.hold("disk")
    d = IntegrityDriver(cache)
    try:
        for k in range(7):
            _step(d, k, _prompt(k))
        stats = cache.stats()
        stats["answers"] = answers
        ex.release("disk")
        comm.allreduce_min = reduce
        # Then each prompt once more, newest first: what of it each tier kept, its bytes checked.
        reused = [_step(d, f"again{k}", _prompt(k)) for k in (6, 5, 4, 3, 2, 1, 0)]
        return stats, reused, d
    finally:
        ex.release("disk")
        cache.close()


def _step(d: IntegrityDriver, seq_id, tokens: list[int]) -> int:
    d.begin()
    reused = d.add(seq_id, tokens)
    d.compute()
    d.end()
    d.release(seq_id)
    d.cache.check_invariants()
    return reused


def test_an_offload_drops_the_coldest_host_block_rather_than_wait_for_a_write(cfg_factory):
    """Prompts 0-6 of 2 blocks each: the GPU tier keeps the newest one, the host tier 3.
    The first end_step that finds the host tier full demotes prompt 0 (the coldest, 2
    blocks, on a held stream); from then on each offload drops a host block instead of
    taking the slots that demotion still reads: prompts 1-3 are lost, prompt 0 waits on
    disk, and nothing ever waited."""
    stats, reused, d = _run(cfg_factory, drop_behind=True)
    assert stats["blocks_moved"]["offload"] == 12 and stats["blocks_moved"]["demote"] == 2, stats
    assert stats["dropped_behind_disk"] == 6 and stats["dropped"] == 6, stats
    assert reused == [8, 8, 8, 0, 0, 0, 8]  # 6: GPU; 5, 4: host; 3, 2, 1: dropped; 0: disk
    assert d.mismatched_tokens == 0 and d.checked_tokens == 32, d.first_mismatch


def test_without_it_the_offload_waits_for_the_held_write(cfg_factory):
    with pytest.raises(SimDeadlock):
        _run(cfg_factory, drop_behind=False)


def test_a_long_churn_that_drops_behind_the_disk_keeps_every_byte(cfg_factory):
    """The reference model's long cascades with the disk stream held now and then, so
    that offloads find demotions unfinished and drop host blocks: every byte reused is
    still right and the pool's invariants hold."""
    from .test_reference_model import long_churn

    cfg = cfg_factory(gpu=90, host=96, disk=160, simulate_async=True)
    cfg["cache"]["disk"].update(demote_ahead=0.1, drop_behind=True)
    seams = Seams()
    cache = kvdist.testing.create(cfg, seams)
    ex = seams.executor

    @contextlib.contextmanager
    def admitting(i):  # 2 admissions of every 3 find the disk stream held
        if i % 3:
            ex.hold("disk")
        try:
            yield
        finally:
            ex.release("disk")

    try:
        drv = long_churn(cache, admitting=admitting)
        s = cache.stats()
        assert s["dropped_behind_disk"] > 0 and s["blocks_moved"]["demote"] > 0, s
        assert all(s["hit_tokens"][t] > 0 for t in ("gpu", "host", "disk")), s["hit_tokens"]
        assert drv.mismatched_tokens == 0 and drv.checked_tokens > 3000, drv.first_mismatch
        cache.check_invariants()
    finally:
        ex.release("disk")
        cache.close()


def test_a_rank_whose_writes_are_done_drops_as_its_slower_peer_does(cfg_factory):
    """Whether a write is done is timing: the TP group decides from its MIN at end_step,
    so a rank whose disk stream runs (it finds the demoted slots ready: 2 where the held
    rank found 0) drops exactly the blocks its held peer drops, and the caches stay alike."""
    held, held_reused, _ = _run(cfg_factory, drop_behind=True)
    stats, reused, d = _run(cfg_factory, drop_behind=True, peer=held["answers"][:7])
    ready = [a[-1] for a in stats["answers"][:7]]
    assert [a[-1] for a in held["answers"][:7]] == [6, 4, 2, 0, 0, 0, 0] and ready == [6, 4, 2, 2, 2, 2, 2]
    assert stats["dropped_behind_disk"] == held["dropped_behind_disk"] == 6, stats
    assert reused == held_reused == [8, 8, 8, 0, 0, 0, 8]
    assert d.mismatched_tokens == 0 and d.checked_tokens == 32, d.first_mismatch
