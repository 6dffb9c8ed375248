"""Exact behaviour of the compact structures: free stack, eviction lists, prefix index."""

import random

import numpy as np
import pytest

from kvdist.blocks import NO_SLOT, BlockMeta, FreeStack, SlotSpace
from kvdist.eviction import PriorityLRU
from kvdist.prefix import PrefixIndex, chain_hashes, split, token_bytes


def test_slot_space_never_aliases():
    sp = SlotSpace((4, 3, 2))
    assert [sp.tier_of(s) for s in range(9)] == [0, 0, 0, 0, 1, 1, 1, 2, 2]
    assert [sp.local(s) for s in range(9)] == [0, 1, 2, 3, 0, 1, 2, 0, 1]
    assert sp.base == (0, 4, 7)


def test_free_stack_exact_order():
    fs = FreeStack(10, 5)
    assert fs.pop() == 10 and fs.pop() == 11
    assert fs.pop_many(2).tolist() == [12, 13]
    fs.push(11)
    assert fs.snapshot().tolist() == [11, 14]
    assert fs.pop_many(2).tolist() == [11, 14]
    assert fs.pop() == NO_SLOT and len(fs) == 0


def test_priority_lru_order():
    meta = BlockMeta(10)
    lru = PriorityLRU(meta)
    for slot, prio in [(0, 35), (1, 10), (2, 35), (3, 80), (4, 10)]:
        meta.prio[slot] = prio
        lru.push(slot)
        lru.check_invariants()
    assert list(lru) == [1, 4, 0, 2, 3]
    lru.remove(4)
    lru.check_invariants()
    lru.push(4)  # touched: most recent of priority 10
    assert list(lru) == [1, 4, 0, 2, 3]
    lru.remove(1)
    lru.push(1)
    assert list(lru) == [4, 1, 0, 2, 3]
    assert [lru.pop_victim() for _ in range(6)] == [4, 1, 0, 2, 3, NO_SLOT]
    lru.check_invariants()


def _index_with(hashes):
    meta = BlockMeta(len(hashes))
    for s, h in enumerate(hashes):
        meta.hash_hi[s], meta.hash_lo[s] = split(h)
    return meta, PrefixIndex(len(hashes), meta)


def test_index_collisions_and_backward_shift():
    # Five keys whose low bits land on the same home bucket, and two that differ only
    # in the high half: the index must tell them apart and survive deletes mid-cluster.
    size = 16  # capacity 8 -> table of 16
    hashes = [(k << 64) | (k * size + 3) for k in range(1, 6)] + [(9 << 64) | 5, (10 << 64) | 5, 7]
    meta, idx = _index_with(hashes)
    assert idx._mask + 1 == size
    for s in range(len(hashes)):
        assert idx.insert(s)
    assert not idx.insert(0)  # same hash again
    for s, h in enumerate(hashes):
        assert idx.find(h) == s
    assert idx.find((11 << 64) | 5) == NO_SLOT
    for s in (1, 5, 3):
        idx.remove(s)
        idx.check_invariants()
        assert idx.find(hashes[s]) == NO_SLOT
    for s in (0, 2, 4, 6, 7):
        assert idx.find(hashes[s]) == s
    meta.move(4, 1)  # slot 1 was removed above; the block of slot 4 moves there
    idx.retarget(4, 1)
    assert idx.find(hashes[4]) == 1


def test_index_against_dict_randomized():
    rng = random.Random(7)
    n = 200
    hashes = [rng.getrandbits(128) for _ in range(n)]
    for s in range(0, n, 3):  # force low-half collisions
        hashes[s] = (hashes[s] >> 64 << 64) | 42
    meta, idx = _index_with(hashes)
    ref = {}
    for _ in range(3000):
        s = rng.randrange(n)
        if s in ref.values():
            idx.remove(s)
            del ref[hashes[s]]
        else:
            assert idx.insert(s)
            ref[hashes[s]] = s
        assert len(idx) == len(ref)
    idx.check_invariants()
    for h in hashes:
        assert idx.find(h) == ref.get(h, NO_SLOT)


def test_chain_hashes_depend_on_whole_prefix_and_salt():
    a = token_bytes([1, 2, 3, 4, 5, 6, 7, 8])
    b = token_bytes([9, 2, 3, 4, 5, 6, 7, 8])
    ha = chain_hashes(b"\0" * 16, a, 0, 2, 4)
    hb = chain_hashes(b"\0" * 16, b, 0, 2, 4)
    assert ha[0] != hb[0] and ha[1] != hb[1]  # same second block, different parent
    assert chain_hashes(b"\1" * 16, a, 0, 2, 4)[0] != ha[0]
    assert chain_hashes(ha[0].to_bytes(16, "little"), a, 1, 1, 4) == ha[1:]
    with pytest.raises(ValueError):
        token_bytes([2**40])


def test_metadata_is_compact():
    meta = BlockMeta(1 << 16)
    assert meta.nbytes == 26 * (1 << 16)
    assert np.all(meta.lru_pos == NO_SLOT)


# -- the single-rank cache's modules ---------------------------------------------------------------
# Lowest first: each may import only modules before it (and anything outside this list).
SINGLE_RANK = ["blocks", "prefix", "eviction", "recompute_policy", "counters", "sequences",
               "admission_plan", "block_pool", "manager_checks", "manager", "landing"]


def _tree(name: str):
    import ast
    from pathlib import Path

    import kvdist

    path = Path(kvdist.__file__).parent / f"{name}.py"
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _kvdist_imports(name: str) -> set[str]:
    """Every kvdist module ``name`` imports, TYPE_CHECKING blocks included."""
    import ast

    out = set()
    for node in ast.walk(_tree(name)):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            if node.module:
                out.add(node.module.split(".")[0])
            else:
                out.update(a.name for a in node.names)
    return out


def test_the_single_rank_cache_imports_only_downward():
    above = {}
    for i, name in enumerate(SINGLE_RANK):
        up = _kvdist_imports(name) & set(SINGLE_RANK[i:])
        if up:
            above[name] = sorted(up)
    assert above == {}


def test_the_single_rank_cache_reads_no_private_name_of_another_object():
    import ast

    found = {}
    for name in SINGLE_RANK:
        for node in ast.walk(_tree(name)):
            if isinstance(node, ast.Attribute) and node.attr.startswith("_") and \
                    not node.attr.startswith("__") and \
                    not (isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
                found.setdefault(name, []).append(f"{ast.unparse(node)} (line {node.lineno})")
    assert found == {}


class _Recorder:
    def __init__(self):
        self.events = []

    def host_changed(self, emptied, filled):
        self.events.append((list(emptied), list(filled)))


def test_the_host_observer_hears_every_host_slot_change_once_per_run():
    """One call per run of moves (and per landed block), naming every host slot
    emptied and filled, in the run's order."""
    from kvdist.blocks import GPU, HOST
    from kvdist.landing import ManagerSlots
    from kvdist.layout import KVLayout
    from kvdist.manager import CacheManager
    from kvdist.transfer.executors import NullExecutor

    m = CacheManager(KVLayout(1, 1, 1, "float16", 4), (2, 2, 1), NullExecutor())
    rec = m.host_observer = _Recorder()

    def run(seq_id, start):
        m.begin_step()
        m.add_sequence(seq_id, list(range(start, start + 8)))
        m.end_step()
        m.release(seq_id)
        m.check_invariants()

    run("a", 0)  # GPU 0, 1
    assert rec.events == []
    run("b", 100)  # a's blocks offloaded to host 2, 3: one run
    assert rec.events == [([], [2, 3])]
    del rec.events[:]
    # b's blocks offloaded: host 2 demoted to disk 4, then host 3 too (disk 4 dropped).
    run("c", 200)
    assert rec.events == [([2, 3], [2, 3])]
    del rec.events[:]
    slots = ManagerSlots(m)
    m.begin_step()
    assert slots.reserve(HOST, 1) == [2]  # host 2 demoted (its bytes stay until reused)
    assert rec.events == [([2], [])]
    assert slots.land(2, 12345)
    assert rec.events == [([2], []), ([], [2])]
    del rec.events[:]
    [g] = slots.reserve(GPU, 1)  # GPU block offloaded into host 3, whose block is demoted
    slots.release(g)  # a GPU landing slot: nothing to hear
    m.end_step()
    assert g == 1 and rec.events == [([3], [3])]
    assert m.counters.blocks_moved["demote"] == 4 and m.counters.dropped == 3
    m.check_invariants()
