"""The node directory in one process: a holder replica's writer and two reader TP ranks
map one file (docs/design.md, "Remote tier"). A lookup made at an agreed epoch gives
the same answer whenever it is made, however the holder changed its host tier since
(rule R4 without messages); an entry's way is reused only once every reader has moved
past the epoch it died at; the writer's TP ranks say when their stamps are published."""

from __future__ import annotations

import numpy as np

from kvdist.distributed.directory import Directory
from kvdist.distributed.node_directory import WAYS, NodeDirectory, NodeShape

H = 64  # host slots a rank
SHAPE = NodeShape(replicas=(0, 1), tp_size=2, host_slots=H)
MASK64 = (1 << 64) - 1


def _files(tmp_path):
    """Holder replica 0 (TP ranks 0 and 1), reader replica 1 (TP ranks 0 and 1)."""
    path = str(tmp_path / "kvdist-test.node")
    made = NodeDirectory(path, SHAPE, 0, 0, (), create=True)
    views = [NodeDirectory(path, SHAPE, r, t, (1 - r,)) for r in (0, 1) for t in (0, 1)]
    made.unlink()
    made.close()
    return views  # holder t0 (the writer), holder t1, reader t0, reader t1


def _advance(holders, slots, hashes):
    """Both holder TP ranks at one boundary: slots now hold ``hashes`` (0: empty)."""
    slots = np.array(slots, dtype=np.int64)
    held = np.array([h != 0 for h in hashes])
    hi = np.array([h >> 64 for h in hashes], dtype=np.uint64)
    lo = np.array([h & MASK64 for h in hashes], dtype=np.uint64)
    for h in holders:
        h.advance(slots, held, hi, lo)


def _agree(readers):
    """The reader TP group's agreement: the MIN of what each saw published."""
    seen = []
    for r in readers:
        c = np.zeros(2, dtype=np.int64)
        r.observe(c)
        seen.append(c)
    agreed = np.minimum(*seen)
    for r in readers:
        r.use(agreed)
    return agreed


def _find(view, h) -> int:
    return view.find(h >> 64, h & MASK64)


def test_a_lookup_at_an_agreed_epoch_gives_one_answer_whenever_it_is_made(tmp_path):
    w, h1, r0, r1 = views = _files(tmp_path)
    try:
        a, b, c = (k << 64 | (k * 0x9E3779B97F4A7C15) & MASK64 for k in (1, 2, 3))
        _advance([w], [3, 5], [a, b])  # TP rank 1 has not published yet
        assert _agree([r0, r1]).tolist() == [0, 0]  # the replica reads at epoch 0: nothing
        assert _find(r0, a) == -1 and len(Directory(2, 1, H, r0)) == 0
        _advance([h1], [3, 5], [a, b])
        assert _agree([r0, r1]).tolist() == [1, 0]
        assert _find(r0, a) == 3 and _find(r0, b) == 5  # entry = replica 0 x H + slot
        r1.hold(True)  # TP rank 1 will see epoch 2 later than rank 0
        _advance([w, h1], [3, 5], [c, 0])  # slot 3 now holds c, slot 5 nothing
        c0 = np.zeros(2, dtype=np.int64)
        r0.observe(c0)
        assert c0[0] == 2
        # Until the replica agrees, both ranks read at epoch 1: the same answers as
        # before the holder changed, on either rank (slot 3's block is now a stale miss).
        for r in (r0, r1):
            assert (_find(r, a), _find(r, b), _find(r, c)) == (3, 5, -1)
        assert _agree([r0, r1]).tolist() == [1, 0]  # rank 1 has not seen epoch 2
        r1.hold(False)
        assert _agree([r0, r1]).tolist() == [2, 0]
        for r in (r0, r1):
            assert (_find(r, a), _find(r, b), _find(r, c)) == (-1, -1, 3)
        assert len(Directory(2, 1, H, r1)) == 1 and r1.known() == 1
        assert Directory(2, 1, H, r0).digest() == Directory(2, 1, H, r1).digest()
        w.check_invariants()
    finally:
        for v in views:
            v.close()


def test_a_dead_entrys_way_is_reused_only_once_every_reader_is_past_it(tmp_path):
    """WAYS blocks of one bucket are listed, then replaced by WAYS others of that bucket.
    While a reader still reads at the old epoch, the old entries keep their ways (the
    new blocks go unlisted) and the reader still finds them; once both reader ranks
    read at a later epoch, the ways are reused."""
    w, h1, r0, r1 = views = _files(tmp_path)
    try:
        bucket = 5
        first = [(k << 64) | (k << 40) | bucket for k in range(1, WAYS + 1)]
        second = [(k << 64) | (k << 40) | bucket for k in range(WAYS + 1, 2 * WAYS + 1)]
        slots = list(range(WAYS))
        _advance([w, h1], slots, first)
        _agree([r0, r1])
        assert [_find(r0, x) for x in first] == slots
        _advance([w, h1], slots, second)  # epoch 2: the first ones died, the readers are at 1
        assert w.unlisted == WAYS
        for r in (r0, r1):
            assert [_find(r, x) for x in first] == slots
        r0.use(np.array([2, 0]))  # one reader rank moved on, the other has not
        _advance([w, h1], slots, second)  # epoch 3: still no way free
        assert w.unlisted == 2 * WAYS
        assert [_find(r1, x) for x in first] == slots
        _agree([r0, r1])  # both at 3
        _advance([w, h1], slots, second)  # epoch 4: the ways of epoch 2's dead are free
        assert w.unlisted == 2 * WAYS
        _agree([r0, r1])
        for r in (r0, r1):
            assert [_find(r, x) for x in second] == slots and [_find(r, x) for x in first] == [-1] * WAYS
        w.check_invariants()
    finally:
        for v in views:
            v.close()


def test_lookups_take_the_node_peers_first_then_the_mirror(tmp_path):
    """A reader's Directory with a node directory: the longest run of leading hashes
    held by node peers or message peers (the mirror), node peers first."""
    from kvdist.distributed.directory import encode

    path = str(tmp_path / "kvdist-test.node")
    shape = NodeShape(replicas=(0, 1), tp_size=1, host_slots=H)
    made = NodeDirectory(path, shape, 0, 0, (), create=True)
    w, r = NodeDirectory(path, shape, 0, 0, (1,)), NodeDirectory(path, shape, 1, 0, (0,))
    try:
        hs = [(k << 64) | (k * 7919 + 11) for k in range(1, 5)]
        w.advance(np.array([9, 10]), np.array([True, True]),
                  np.array([x >> 64 for x in hs[:2]], dtype=np.uint64),
                  np.array([x & MASK64 for x in hs[:2]], dtype=np.uint64))
        c = np.zeros(3, dtype=np.int64)
        r.observe(c)
        r.use(c)
        d = Directory(3, 1, H, r)  # replica 2 is on another node: records
        d.apply([(2, encode(np.array([4, 7]), np.array([1, 1]),
                            np.array([hs[1] >> 64, hs[2] >> 64], dtype=np.uint64),
                            np.array([hs[1] & MASK64, hs[2] & MASK64], dtype=np.uint64)))])
        assert [d.holder(g) for g in d.match(hs)] == [(0, 9), (0, 10), (2, 7)]
    finally:
        for v in (made, w, r):
            v.close()
