"""The transfer engine against rule S2 itself, on random copy streams: a recording
executor whose events never complete keeps every batch pending, so every ordering the
engine owes must appear as a (transitive) dependency. Both entry points, ``copy`` and
``copy_many``, with hazards inside calls and conflicts with open batches."""

from __future__ import annotations

import numpy as np
import pytest

from kvdist.blocks import SlotSpace
from kvdist.transfer import (
    DEMOTE,
    OFFLOAD,
    ONBOARD,
    PROMOTE,
    RELOAD,
    SPILL,
    EngineSeams,
    Route,
    TransferEngine,
)


class _Event:
    __slots__ = ("index",)

    def __init__(self, index: int):
        self.index = index


class RecordingExecutor:
    """Keeps every batch: (direction, global src keys, global dst keys, dependency indexes)."""

    def __init__(self, space: SlotSpace):
        self.space = space
        self.batches: list[tuple[str, list[int], list[int], set[int]]] = []
        self.compute_events = 0

    def submit(self, route, src, dst, deps):
        src = (np.asarray(src) + self.space.base[route.src]).tolist()
        dst = (np.asarray(dst) + self.space.base[route.dst]).tolist()
        assert all(isinstance(e, _Event) for e in deps), deps
        self.batches.append((route.name, src, dst, {e.index for e in deps if e.index >= 0}))
        return _Event(len(self.batches) - 1)

    def record_compute(self):
        self.compute_events += 1
        return _Event(-self.compute_events)

    def compute_wait(self, events) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def is_done(self, event) -> bool:
        return False  # everything stays pending: every dependency must be explicit


def _closure(batches) -> list[set[int]]:
    """Batches each one waits for, directly or through others."""
    reach: list[set[int]] = []
    for _, _, _, deps in batches:
        r = set(deps)
        for d in deps:
            r |= reach[d]
        reach.append(r)
    return reach


def _check_s2(batches) -> None:
    reach = _closure(batches)
    for j, (dj, sj, tj, _) in enumerate(batches):
        rj, wj = set(sj), set(tj)
        assert len(wj) == len(tj), f"batch {j} ({dj}) writes one slot twice: {tj}"
        assert not rj & wj, f"batch {j} ({dj}) reads and writes slots {rj & wj}"
        for i in range(j):
            _, si, ti, _ = batches[i]
            ri, wi = set(si), set(ti)
            if wi & (rj | wj) or ri & wj:
                shared = (wi | ri) & (rj | wj)
                assert i in reach[j], f"batch {j} ({dj}) does not wait for batch {i}: shares {shared}"


def _random_moves(rng, space: SlotSpace, n: int) -> list[tuple[Route, int, int]]:
    """``n`` random copies (route, global src, global dst): of one route 80% of the time."""
    routes = [OFFLOAD, ONBOARD, DEMOTE, SPILL, RELOAD, PROMOTE]
    one = routes[rng.integers(len(routes))] if rng.random() < 0.8 else None
    moves = []
    for _ in range(n):
        r = one or routes[rng.integers(len(routes))]
        moves.append((r, int(space.base[r.src] + rng.integers(space.capacity[r.src])),
                       int(space.base[r.dst] + rng.integers(space.capacity[r.dst]))))
    return moves


def _queue(engine: TransferEngine, moves: list[tuple[Route, int, int]], bulk: bool) -> None:
    """``moves`` in one ``copy_many`` call when ``bulk`` and they share a route, else one
    ``copy`` each."""
    if bulk and len({r for r, _, _ in moves}) == 1:
        engine.copy_many(moves[0][0], [s for _, s, _ in moves], [d for _, _, d in moves])
    else:
        for r, s, d in moves:
            engine.copy(r, s, d)


@pytest.mark.parametrize("limit", [None, 3])
@pytest.mark.parametrize("seed", range(12))
def test_every_conflict_is_ordered_and_nothing_is_lost(seed, limit):
    """``limit``: demotions are submitted in batches of at most that many copies."""
    rng = np.random.default_rng(seed)
    space = SlotSpace((12, 16, 8))  # small tiers: frequent conflicts
    ex = RecordingExecutor(space)
    engine = TransferEngine(space, ex, batch_limits={DEMOTE: limit} if limit else None)
    wanted: list[tuple[int, int]] = []
    for _step in range(25):
        engine.begin_step()
        for _call in range(int(rng.integers(1, 6))):
            moves = _random_moves(rng, space, int(rng.integers(1, 9)))
            wanted += [(s, d) for _, s, d in moves]
            _queue(engine, moves, bulk=rng.random() < 0.5)
            engine.check_invariants()
        engine.before_compute()
        engine.check_invariants()
    _check_s2(ex.batches)
    done = sorted((s, d) for _, src, dst, _ in ex.batches for s, d in zip(src, dst))
    assert done == sorted(wanted)
    assert engine.stats.batches == len(ex.batches)
    if limit:
        sizes = [len(src) for name, src, _, _ in ex.batches if name == "demote"]
        assert max(sizes) <= 2 * limit - 1, sizes


def test_the_checker_catches_a_missing_wait():
    """Without S2 the same streams break the property the test above checks."""
    rng = np.random.default_rng(3)
    space = SlotSpace((12, 16, 8))
    ex = RecordingExecutor(space)
    engine = TransferEngine(space, ex, seams=EngineSeams(rules=frozenset({"S4", "S5"})))
    for _step in range(10):
        engine.begin_step()
        for _call in range(4):
            _queue(engine, _random_moves(rng, space, 6), bulk=True)
        engine.before_compute()
    with pytest.raises(AssertionError, match="does not wait|writes one slot twice|reads and writes"):
        _check_s2(ex.batches)


def test_copy_many_flushes_an_open_batch_reading_a_slot_it_overwrites():
    space = SlotSpace((4, 4, 0))
    ex = RecordingExecutor(space)
    engine = TransferEngine(space, ex)
    engine.begin_step()
    engine.copy_many(OFFLOAD, [0, 1], [4, 5])  # gpu 0, 1 -> host 0, 1
    engine.copy_many(ONBOARD, [6, 7], [1, 2])  # into gpu 1 (being read): flushes the offload first
    engine.check_invariants()
    engine.before_compute()
    assert [(d, s, t) for d, s, t, _ in ex.batches] == [
        ("offload", [0, 1], [4, 5]), ("onboard", [6, 7], [1, 2])]
    assert ex.batches[1][3] == {0} and engine.stats.conflict_flushes == 1


def test_a_batch_limit_submits_demotions_as_they_fill_a_batch():
    """``batch_limits={DEMOTE: 3}``: a demotion batch goes to the executor as soon as it
    holds 3 copies (single or bulk), so a later copy into one of its host slots waits
    for those 3 alone; other routes batch as before."""
    space = SlotSpace((4, 12, 12))
    ex = RecordingExecutor(space)
    engine = TransferEngine(space, ex, batch_limits={DEMOTE: 3})
    engine.begin_step()
    engine.copy_many(DEMOTE, list(range(4, 12)), list(range(16, 24)))  # 8 host -> disk
    assert [len(src) for _, src, _, _ in ex.batches] == [3, 3]  # 2 still open
    engine.copy(DEMOTE, 12, 24)  # a third copy fills the open batch
    assert [len(src) for _, src, _, _ in ex.batches] == [3, 3, 3]
    engine.copy_many(OFFLOAD, [0, 1, 2, 3], [4, 5, 13, 14])  # into demoted slots 4, 5
    engine.before_compute()
    names = [(name, len(src), deps) for name, src, _, deps in ex.batches]
    assert names == [("demote", 3, set()), ("demote", 3, set()), ("demote", 3, set()), ("offload", 4, {0})]
    engine.check_invariants()


class _ComputeDeps(RecordingExecutor):
    """Also keeps which compute events (negative indexes) each batch waits for; the
    compute events in ``done`` count as complete."""

    def __init__(self, space: SlotSpace):
        super().__init__(space)
        self.compute_deps: list[set[int]] = []
        self.done: set[int] = set()

    def submit(self, route, src, dst, deps):
        self.compute_deps.append({e.index for e in deps if e.index < 0})
        return super().submit(route, src, dst, deps)

    def is_done(self, event) -> bool:
        return event.index in self.done


def test_s4_makes_only_copies_touching_slots_the_kernels_use_wait():
    """S4 per slot: after a step whose block table held GPU slots 0 and 1, the next
    step's offload of slot 0 and onboard into slot 1 wait for the compute stream as it
    was at begin_step (event -2); an onboard into free slot 3 and a demotion do not.
    Once that event is done, nothing waits for it."""
    space = SlotSpace((8, 8, 8))
    ex = _ComputeDeps(space)
    engine = TransferEngine(space, ex)
    G, D = space.base[1], space.base[2]
    engine.begin_step()  # step 1: compute event -1
    engine.compute_uses(np.array([[0, 1], [1, -1]], dtype=np.int32))
    engine.begin_step()  # step 2: compute event -2, covering step 1's kernels
    engine.copy(OFFLOAD, 0, G + 0)
    engine.flush()
    engine.copy(ONBOARD, G + 5, 1)
    engine.flush()
    engine.copy(ONBOARD, G + 6, 3)
    engine.copy(DEMOTE, G + 7, D + 2)
    engine.flush()
    assert ex.compute_deps == [{-2}, {-2}, set(), set()]
    ex.done |= {-1, -2}  # the compute stream is FIFO
    engine.begin_step()  # step 3: step 2's begin_step event is done, so step 1's kernels are
    engine.copy(ONBOARD, G + 4, 0)
    engine.flush()
    assert ex.compute_deps[-1] == set()
    engine.compute_uses(np.array([[2]], dtype=np.int32))  # step 3's kernels use slot 2
    engine.begin_step()  # step 4: event -4
    engine.copy(OFFLOAD, 2, G + 3)
    engine.flush()
    assert ex.compute_deps[-1] == {-4}
    assert engine.pending_events([2]) and engine.pending_events([5]) == []
