"""The compact structures and the whole cache bookkeeping against simple reference
models: randomized operation sequences, exact agreement after every operation.

* FreeStack vs a Python list used as a stack, FreeQueue vs a deque;
* PriorityLRU vs a dict of (priority, insertion stamp), ordered by sorting;
* PrefixIndex vs a dict, with keys forced onto the same home bucket (equal low bits)
  and keys that differ only in their high half;
* CacheManager vs :class:`RefCache`, a small pure-Python cache with the same tiers and
  cascade rules written the obvious way (lists, dicts, ``min`` over the evictable
  blocks): same slots, same hits, same counters, same free-stack and eviction order.

Last, long cascades (dozens of blocks moved by one admission, which reach the transfer
engine through ``copy_many``) keep every reused token's bytes exact under simulated
streams, and corrupt them with rule S2 off."""

from __future__ import annotations

import contextlib
import random
from array import array
from collections import Counter, deque
from dataclasses import dataclass

import numpy as np
import pytest
import xxhash

import kvdist
import kvdist.block_pool
import kvdist.prefix
import kvdist.testing
from kvdist.blocks import CACHED, NO_SLOT, BlockMeta, FreeQueue, FreeStack
from kvdist.errors import OutOfBlocksError
from kvdist.eviction import NUM_PRIORITIES, PriorityLRU
from kvdist.layout import KVLayout
from kvdist.manager import CacheManager
from kvdist.prefix import (
    MASK64,
    VECTOR_FROM,
    PrefixIndex,
    chain_digests,
    chain_hashes,
    digests_to_ints,
    split,
    token_bytes,
)
from kvdist.testing import IntegrityDriver, Seams
from kvdist.transfer.executors import NullExecutor

# -- FreeStack, FreeQueue ---------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["stack", "queue"])
@pytest.mark.parametrize("seed", range(4))
def test_free_list_against_python(seed, kind):
    """FreeStack against a list used as a stack, FreeQueue against a deque: both pop
    ascending ids first, then the last freed (stack) or the first freed (queue)."""
    rng = random.Random(seed)
    base, cap = 100 * seed, 40
    if kind == "stack":
        fs = FreeStack(base, cap)
        ref = deque(range(base + cap - 1, base - 1, -1))
        take, order = ref.pop, lambda: list(ref)[::-1]
    else:
        fs = FreeQueue(base, cap)
        ref = deque(range(base, base + cap))
        take, order = ref.popleft, lambda: list(ref)
    out: list[int] = []  # popped slots, the only ones that may be pushed back
    for _ in range(600):
        op = rng.random()
        if op < 0.35:
            expect = take() if ref else NO_SLOT
            assert fs.pop() == expect
            if expect != NO_SLOT:
                out.append(expect)
        elif op < 0.55:
            n = rng.randint(0, len(ref))
            expect = [take() for _ in range(n)]
            assert fs.pop_many(n).tolist() == expect
            out.extend(expect)
        elif op < 0.65 and out:  # a run freed at once
            run = [out.pop(rng.randrange(len(out))) for _ in range(rng.randint(1, len(out)))]
            fs.push_many(run)
            ref.extend(run)
        elif out:
            s = out.pop(rng.randrange(len(out)))
            fs.push(s)
            ref.append(s)
        assert len(fs) == len(ref)
        assert fs.snapshot().tolist() == order()


# -- PriorityLRU --------------------------------------------------------------------------------


class RefLRU:
    def __init__(self):
        self.entries: dict[int, tuple[int, int]] = {}
        self.stamp = 0

    def push(self, slot: int, prio: int) -> None:
        self.entries[slot] = (prio, self.stamp)
        self.stamp += 1

    def order(self) -> list[int]:
        return sorted(self.entries, key=self.entries.__getitem__)


@pytest.mark.parametrize("seed,n", [(0, 64), (1, 64), (2, 64), (3, 64), (4, 700), (5, 700)])
def test_priority_lru_against_sorted_reference(seed, n):
    """Including lists longer than a first array and a victim scan's first window
    (n = 700), with holes left by removals."""
    rng = random.Random(seed)
    meta = BlockMeta(n)
    lru, ref = PriorityLRU(meta), RefLRU()
    prios = [0, 1, 35, 63, 64, 100] if seed % 2 else list(range(NUM_PRIORITIES))
    for _ in range(1500):
        op = rng.random()
        outside = [s for s in range(n) if s not in ref.entries]
        if op < 0.35 and outside:
            s = rng.choice(outside)
            meta.prio[s] = p = rng.choice(prios)
            lru.push(s)
            ref.push(s, p)
        elif op < 0.45 and len(outside) > 1:  # a released sequence's blocks, in order
            run = rng.sample(outside, rng.randint(0, len(outside)))
            p = rng.choice(prios)
            for s in run:  # usually one priority; sometimes not
                meta.prio[s] = p if rng.random() < 0.9 else rng.choice(prios)
                ref.push(s, int(meta.prio[s]))
            lru.push_run(run)
        elif op < 0.7 and ref.entries:
            s = rng.choice(list(ref.entries))
            lru.remove(s)
            del ref.entries[s]
        elif op < 0.8 and ref.entries:  # a reuse: out of the lists, later back as most recent
            s = rng.choice(list(ref.entries))
            lru.remove(s)
            lru.push(s)
            ref.push(s, ref.entries[s][0])
        elif op < 0.85 and ref.entries:  # a prompt's colder hits, at once
            run = rng.sample(list(ref.entries), rng.randint(1, len(ref.entries)))
            lru.remove_many(run)
            for s in run:
                del ref.entries[s]
        elif op < 0.9:  # a run of victims (more than there are, at times)
            k = rng.randint(0, len(ref.entries) + 2)
            expect = ref.order()[:k]
            assert lru.pop_victims(k).tolist() == expect
            for s in expect:
                del ref.entries[s]
        else:
            order = ref.order()
            expect = order[0] if order else NO_SLOT
            assert next(iter(lru), NO_SLOT) == expect
            assert lru.pop_victim() == expect
            ref.entries.pop(expect, None)
        lru.check_invariants()
        assert len(lru) == len(ref.entries)
        assert list(lru) == ref.order()


# -- PrefixIndex --------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_prefix_index_against_dict_with_collisions(seed):
    rng = random.Random(seed)
    n = 48  # slots; the table has 128 entries
    keys = [rng.getrandbits(128) for _ in range(24)]
    for i in range(0, 24, 2):  # half the keys share one home bucket
        keys[i] = (keys[i] >> 64 << 64) | (rng.getrandbits(57) << 7) | 5
    keys += [(k ^ (1 << 100)) for k in keys[:6]]  # same low half, other high half
    keys += [(k >> 7 << 7) | 127 for k in keys[6:10]]  # the bucket just before wrapping
    meta = BlockMeta(n)
    idx = PrefixIndex(n, meta)
    assert idx._mask == 127
    ref: dict[int, int] = {}  # hash -> slot
    holds: dict[int, int] = {}  # slot -> hash, for every slot holding a block
    for _ in range(2000):
        op = rng.random()
        free = [s for s in range(n) if s not in holds]
        if op < 0.4 and free:
            s, h = rng.choice(free), rng.choice(keys)
            meta.hash_hi[s], meta.hash_lo[s] = split(h)
            added = idx.insert(s)
            assert added == (h not in ref)
            if added:
                ref[h] = s
                holds[s] = h
        elif op < 0.7 and ref:
            h = rng.choice(list(ref))
            idx.remove(ref[h])
            del holds[ref.pop(h)]
        elif op < 0.85 and ref and free:  # the block moves to another slot (a tier move)
            h = rng.choice(list(ref))
            old, new = ref[h], rng.choice(free)
            meta.move(old, new)
            idx.retarget(old, new)
            ref[h] = new
            holds[new] = holds.pop(old)
        else:
            chain = rng.sample(keys, rng.randint(0, 6))
            expect = []
            for h in chain:
                if h not in ref:
                    break
                expect.append(ref[h])
            assert idx.match(chain) == expect
        idx.check_invariants()
        assert len(idx) == len(ref)
        for h in keys:
            assert idx.find(h) == ref.get(h, NO_SLOT)
        assert sorted(idx.slots().tolist()) == sorted(ref.values())


def _digests_of(hashes: list[int]) -> np.ndarray:
    return np.array([[h & MASK64, h >> 64] for h in hashes], dtype=np.uint64).reshape(-1, 2)


@pytest.mark.parametrize("seed", range(4))
def test_prefix_index_runs_against_dict_with_collisions(seed):
    """The index's operations on runs (``insert_many``, ``retarget_many``,
    ``match_digests``: all keys probing at once from ``VECTOR_FROM`` keys, one by one
    below) against a dict, in long clusters: keys sharing a home bucket, keys that differ
    only in their high half, duplicates inside one run (the first one in the run wins)."""
    rng = random.Random(seed)
    n = 200  # slots; the table has 512 entries
    keys = [rng.getrandbits(128) for _ in range(150)]
    for i in range(0, 150, 3):  # a third of the keys share one of two home buckets
        keys[i] = (keys[i] >> 64 << 64) | (rng.getrandbits(55) << 9) | rng.choice((17, 511))
    keys += [(k ^ (1 << 100)) for k in keys[:20]]  # same low half, other high half
    meta = BlockMeta(n)
    idx = PrefixIndex(n, meta)
    assert idx._mask == 511
    ref: dict[int, int] = {}  # hash -> slot
    holds: dict[int, int] = {}  # slot -> hash, for every slot holding a block
    sizes = (0, 1, 5, VECTOR_FROM - 1, VECTOR_FROM, 70)
    for _ in range(400):
        op = rng.random()
        free = [s for s in range(n) if s not in holds]
        k = rng.choice(sizes)
        if op < 0.35 and free:  # a step's filled blocks, registered at once
            run = rng.sample(free, min(k, len(free)))
            hashes = [rng.choice(keys) for _ in run]
            for s, h in zip(run, hashes):
                meta.hash_hi[s], meta.hash_lo[s] = split(h)
            expect = []
            for s, h in zip(run, hashes):
                expect.append(h not in ref)
                if expect[-1]:
                    ref[h] = s
                    holds[s] = h
            assert idx.insert_many(np.array(run, dtype=np.int64)).tolist() == expect
        elif op < 0.5 and ref:
            h = rng.choice(list(ref))
            idx.remove(ref[h])
            del holds[ref.pop(h)]
        elif op < 0.7 and ref and free:  # a run of blocks moved to other slots (a tier's run of moves)
            moved = rng.sample(list(ref), min(k, len(ref), len(free)))
            olds, news = [ref[h] for h in moved], rng.sample(free, len(moved))
            meta.move_many(np.array(olds, dtype=np.intp), np.array(news, dtype=np.intp))
            idx.retarget_many(np.array(olds, dtype=np.int64), np.array(news, dtype=np.int64))
            for h, old, new in zip(moved, olds, news):
                ref[h] = new
                holds[new] = holds.pop(old)
        else:  # a prompt's prefix: mostly indexed keys, then maybe one that is not
            chain = rng.sample(list(ref), min(k, len(ref))) + rng.sample(keys, rng.randint(0, 2))
            expect = []
            for h in chain:
                if h not in ref:
                    break
                expect.append(ref[h])
            assert idx.match_digests(_digests_of(chain)).tolist() == expect
            assert idx.match(chain) == expect
        idx.check_invariants()
        assert len(idx) == len(ref)
        for h in keys:
            assert idx.find(h) == ref.get(h, NO_SLOT)
        assert sorted(idx.slots().tolist()) == sorted(ref.values())


def test_chain_digests_are_the_chained_hashes():
    """The array of hash halves holds the same hashes as ``chain_hashes``, chained alike
    from any block on (its last row's bytes are the next block's parent)."""
    rng = np.random.default_rng(0)
    tok = token_bytes(rng.integers(-2**31, 2**31, 16 * 40).tolist())
    salt = b"\7" * 16
    d = chain_digests(salt, tok, 0, 40, 16)
    assert d.shape == (40, 2) and digests_to_ints(d) == chain_hashes(salt, tok, 0, 40, 16)
    rest = chain_digests(d[24].tobytes(), tok, 25, 15, 16)
    assert rest.tolist() == d[25:].tolist()
    expect, parent = [], salt
    for i in range(40):  # the definition: xxh3-128 of the parent's 16 little-endian bytes and the tokens
        h = xxhash.xxh3_128_intdigest(parent + bytes(tok[64 * i: 64 * (i + 1)]))
        expect.append(h)
        parent = h.to_bytes(16, "little")
    assert digests_to_ints(d) == expect


# -- the whole cache ----------------------------------------------------------------------------


@dataclass
class RefSeq:
    tokens: list[int]
    slots: list[int]
    priority: int
    registered: int  # leading full blocks registered (indexed or duplicate)


class RefCache:
    """The cache's bookkeeping, written plainly. Tier ``t`` owns global slots
    ``[base[t], base[t] + capacity[t])``; a free stack per tier (a list, popped at the
    end), but a queue (first freed, first reused) for the host tier above a disk tier and
    for the disk tier;
    an eviction order per tier (slot -> (priority, stamp), victim = min)."""

    def __init__(self, capacity, tpb, salt, offload_min_priority, enable_reuse):
        self.capacity, self.tpb, self.salt = capacity, tpb, salt
        self.omp, self.reuse = offload_min_priority, enable_reuse
        self.base = (0, capacity[0], capacity[0] + capacity[1])
        self.free = [list(range(b + c - 1, b - 1, -1)) for b, c in zip(self.base, capacity)]
        self.fifo = [False, bool(capacity[2]), True]
        for t in (1, 2):
            if self.fifo[t]:
                self.free[t] = deque(reversed(self.free[t]))
        self.order: list[dict[int, tuple[int, int]]] = [{}, {}, {}]
        self.stamp = 0
        self.hash: dict[int, int] = {}  # slot -> hash of its cached block
        self.prio: dict[int, int] = {}
        self.ref: dict[int, int] = {}  # GPU slot -> references (absent when 0)
        self.index: dict[int, int] = {}  # hash -> slot
        self.seqs: dict[object, RefSeq] = {}
        self.dirty: dict[object, RefSeq] = {}
        self.deferred: list[RefSeq] = []
        self.hit_tokens = [0, 0, 0]
        self.evictions = [0, 0, 0]
        self.moved: Counter = Counter()
        self.dropped = 0
        self.colder = {0: [t for t in (1, 2) if capacity[t]], 1: [2] if capacity[2] else [], 2: []}

    def tier(self, s: int) -> int:
        return 0 if s < self.base[1] else 1 if s < self.base[2] else 2

    def hashes(self, tokens: list[int], n: int) -> list[int]:
        out, parent = [], self.salt
        for i in range(n):
            block = array("i", tokens[i * self.tpb : (i + 1) * self.tpb]).tobytes()
            h = xxhash.xxh3_128_intdigest(parent + block)
            out.append(h)
            parent = h.to_bytes(16, "little")
        return out

    # eviction cascade
    def push_lru(self, s: int) -> None:
        self.order[self.tier(s)][s] = (self.prio[s], self.stamp)
        self.stamp += 1

    def pop_lru(self, t: int) -> int | None:
        if not self.order[t]:
            return None
        s = min(self.order[t], key=self.order[t].__getitem__)
        del self.order[t][s]
        return s

    def pop_free(self, t: int) -> int:
        return self.free[t].popleft() if self.fifo[t] else self.free[t].pop()

    def free_order(self, t: int) -> list[int]:
        """Free slots of tier ``t``, next to pop first."""
        return list(self.free[t]) if self.fifo[t] else self.free[t][::-1]

    def take_slot(self, t: int) -> int | None:
        if self.free[t]:
            return self.pop_free(t)
        victim = self.pop_lru(t)
        if victim is None:
            return None
        self.evict(victim)
        return self.pop_free(t)

    def move(self, s: int, d: int) -> None:
        self.hash[d], self.prio[d] = self.hash.pop(s), self.prio[s]
        self.index[self.hash[d]] = d
        self.free[self.tier(s)].append(s)
        self.moved[self.tier(s), self.tier(d)] += 1

    def evict(self, s: int) -> None:
        t = self.tier(s)
        self.evictions[t] += 1
        if not (t == 0 and self.prio[s] < self.omp):
            for c in self.colder[t]:
                d = self.take_slot(c)
                if d is not None:
                    self.move(s, d)
                    self.push_lru(d)
                    return
        del self.index[self.hash.pop(s)]
        self.free[t].append(s)
        self.dropped += 1

    def alloc_gpu(self, n: int, priority: int) -> list[int]:
        for _ in range(n - len(self.free[0])):
            self.evict(self.pop_lru(0))
        out = [self.free[0].pop() for _ in range(n)]
        for s in out:
            self.ref[s] = 1
            self.prio[s] = priority
        return out

    # the step API
    def add_sequence(self, sid, tokens: list[int], priority: int) -> int:
        tpb, n = self.tpb, len(tokens)
        hits = []
        if self.reuse:
            for h in self.hashes(tokens, (n - 1) // tpb):
                if h not in self.index:
                    break
                hits.append(self.index[h])
        on_gpu = [s for s in hits if self.tier(s) == 0]
        need = -(-n // tpb) - len(on_gpu)
        available = len(self.free[0]) + len(self.order[0]) - sum(s not in self.ref for s in on_gpu)
        if need > available:
            raise OutOfBlocksError(need, available, "reference")
        for s in hits:
            if self.tier(s) == 0:
                self.order[0].pop(s, None)
                self.ref[s] = self.ref.get(s, 0) + 1
            else:
                del self.order[self.tier(s)][s]
        fresh = self.alloc_gpu(need, priority)
        # Host and disk hits come back into the first of the fresh slots, the lowest
        # source slot into the lowest of them (runs of adjacent slots stay runs).
        cold = sorted(s for s in hits if self.tier(s) != 0)
        into = dict(zip(cold, sorted(fresh[:len(cold)]), strict=True))
        fresh = fresh[len(cold):]
        slots = []
        for s in hits:
            self.hit_tokens[self.tier(s)] += tpb
            if self.tier(s) != 0:
                g = into[s]
                self.move(s, g)
                s = g
            self.prio[s] = max(self.prio[s], priority)
            slots.append(s)
        self.seqs[sid] = self.dirty[sid] = RefSeq(list(tokens), slots + fresh, priority, len(hits))
        return len(hits) * tpb

    def append_tokens(self, sid, tokens: list[int]) -> None:
        seq = self.seqs[sid]
        need = -(-(len(seq.tokens) + len(tokens)) // self.tpb) - len(seq.slots)
        if need > 0:
            available = len(self.free[0]) + len(self.order[0])
            if need > available:
                raise OutOfBlocksError(need, available, "reference")
            seq.slots += self.alloc_gpu(need, seq.priority)
        seq.tokens += tokens
        self.dirty[sid] = seq

    def end_step(self) -> None:
        if self.reuse:
            for seq in [*self.dirty.values(), *self.deferred]:
                full = len(seq.tokens) // self.tpb
                for i, h in enumerate(self.hashes(seq.tokens, full)[seq.registered:], seq.registered):
                    if h not in self.index:
                        self.index[h] = seq.slots[i]
                        self.hash[seq.slots[i]] = h
                seq.registered = max(seq.registered, full)
        self.dirty.clear()
        for seq in self.deferred:
            self.free_blocks(seq)
        self.deferred.clear()

    def release(self, sid) -> None:
        seq = self.seqs.pop(sid)
        if self.dirty.pop(sid, None) is not None:
            self.deferred.append(seq)
        else:
            self.free_blocks(seq)

    def free_blocks(self, seq: RefSeq) -> None:
        for s in reversed(seq.slots):
            self.ref[s] -= 1
            if self.ref[s] == 0:
                del self.ref[s]
                if s in self.hash:
                    self.push_lru(s)
                else:
                    self.free[0].append(s)


def assert_same(m: CacheManager, ref: RefCache) -> None:
    """Every observable of the bookkeeping agrees exactly."""
    assert {sid: s.slots for sid, s in m.seqs.items()} == {sid: s.slots for sid, s in ref.seqs.items()}
    assert {sid: list(s.tokens) for sid, s in m.seqs.items()} == \
        {sid: s.tokens for sid, s in ref.seqs.items()}
    for t in range(3):
        if ref.capacity[t]:
            assert m.free[t].snapshot().tolist() == ref.free_order(t), f"free stack of tier {t}"
        assert list(m.lru[t]) == sorted(ref.order[t], key=ref.order[t].__getitem__), f"lru of tier {t}"
    indexed = {(int(m.meta.hash_hi[s]) << 64) | int(m.meta.hash_lo[s]): s for s in m.index.slots().tolist()}
    assert indexed == ref.index
    cached = np.flatnonzero(m.meta.state == CACHED).tolist()
    assert cached == sorted(ref.index.values())
    assert {s: int(m.meta.prio[s]) for s in cached} == {s: ref.prio[s] for s in cached}
    refs = {s: int(r) for s, r in enumerate(m.meta.refcnt.tolist()) if r}
    assert refs == ref.ref
    c = m.counters
    assert c.hit_tokens == ref.hit_tokens
    assert c.evictions == ref.evictions
    assert c.dropped == ref.dropped
    directions = {(0, 1): "offload", (1, 0): "onboard", (1, 2): "demote", (0, 2): "spill", (2, 0): "reload",
                  (2, 1): "promote"}
    assert c.blocks_moved == {d: ref.moved[k] for k, d in directions.items()}


CASES = [  # (gpu, host, disk), offload_min_priority, enable_reuse
    ((6, 0, 0), 0, True),
    ((6, 5, 0), 0, True),
    ((5, 0, 6), 0, True),
    ((6, 4, 7), 0, True),
    ((8, 6, 5), 30, True),
    ((7, 5, 5), 0, False),
    ((96, 40, 40), 0, True),  # long sequences
]


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("capacity,omp,reuse", CASES)
def test_cache_manager_against_reference_cache(capacity, omp, reuse, seed):
    _against_reference_cache(capacity, omp, reuse, seed)


@pytest.mark.parametrize("capacity,omp,reuse", CASES)
def test_cache_manager_in_runs_against_reference_cache(capacity, omp, reuse, monkeypatch):
    """The same with every run of slots, however short, through the numpy paths (the
    index probing all keys at once; pin, unpin, allocate and register over arrays)."""
    monkeypatch.setattr(kvdist.prefix, "VECTOR_FROM", 1)
    monkeypatch.setattr(kvdist.block_pool, "VECTOR_FROM", 1)
    _against_reference_cache(capacity, omp, reuse, 0)


def _against_reference_cache(capacity, omp, reuse, seed):
    rng = random.Random(hash((capacity, omp, reuse, seed)) & 0xFFFF)
    tpb = 4
    layout = KVLayout(1, 1, 2, "float16", tpb)
    m = CacheManager(layout, capacity, NullExecutor(), enable_reuse=reuse, offload_min_priority=omp)
    ref = RefCache(capacity, tpb, layout.hash_salt(), omp, reuse)
    # A few shared prefixes over a tiny vocabulary: hits in every tier, duplicate blocks.
    scale = max(1, capacity[0] // 12)  # prompt lengths grow with the GPU tier
    prefixes = [[rng.randrange(3) for _ in range(rng.randint(0, 13 * scale))] for _ in range(4)]
    live: list[object] = []
    next_id = 0
    for _ in range(200 if scale == 1 else 60):
        m.begin_step()
        for _ in range(rng.randint(1, 4)):
            op = rng.random()
            if op < 0.4 or not live:
                sid = live.pop() if live and rng.random() < 0.1 else next_id  # sometimes an id
                if sid == next_id:                                           # released this step
                    next_id += 1
                else:
                    m.release(sid)
                    ref.release(sid)
                tokens = rng.choice(prefixes) + [rng.randrange(3) for _ in range(rng.randint(1, 9 * scale))]
                prio = rng.choice([0, 10, 35, 35, 80])
                try:
                    expect = ref.add_sequence(sid, tokens, prio)
                except OutOfBlocksError:
                    with pytest.raises(OutOfBlocksError):
                        m.add_sequence(sid, tokens, prio)
                else:
                    assert m.add_sequence(sid, tokens, prio) == expect
                    live.append(sid)
            elif op < 0.75:
                sid = rng.choice(live)
                tokens = [rng.randrange(3) for _ in range(rng.randint(1, 6 * scale))]
                try:
                    ref.append_tokens(sid, tokens)
                except OutOfBlocksError:
                    with pytest.raises(OutOfBlocksError):
                        m.append_tokens(sid, tokens)
                else:
                    m.append_tokens(sid, tokens)
            else:
                sid = live.pop(rng.randrange(len(live)))
                m.release(sid)
                ref.release(sid)
            assert_same(m, ref)
            m.check_invariants()
        if live:
            table = m.table_rows(live)
            width = max(len(ref.seqs[s].slots) for s in live)
            assert table.tolist() == [ref.seqs[s].slots + [-1] * (width - len(ref.seqs[s].slots))
                                      for s in live]
        m.before_compute()
        m.end_step()
        ref.end_step()
        assert_same(m, ref)
        m.check_invariants()
    assert sum(ref.hit_tokens) > 0 or not reuse
    for t in range(3):
        if capacity[t] and reuse:
            assert ref.evictions[t] > 0, f"the run never evicted from tier {t}"


def test_release_and_add_the_same_id_in_one_step_registers_both():
    """The released sequence's blocks become reusable at end_step even though a new
    sequence took its id in the same step."""
    layout = KVLayout(1, 1, 2, "float16", 4)
    m = CacheManager(layout, (8, 0, 0), NullExecutor())
    m.begin_step()
    m.add_sequence("a", list(range(8)))
    m.release("a")
    m.add_sequence("a", list(range(100, 108)))
    m.end_step()
    m.check_invariants()
    assert len(m.index) == 4
    m.release("a")
    m.begin_step()
    assert m.add_sequence("b", list(range(9))) == 8
    assert m.add_sequence("c", list(range(100, 109))) == 8


# -- long cascades, bytes checked -----------------------------------------------------------------


def long_churn(cache, steps=40, seed=0, admitting=contextlib.nullcontext):
    """Prompts of 25-70 blocks over 4-token blocks: one admission moves dozens of blocks.
    ``admitting(i)``: a context each step's admission runs in."""
    drv = IntegrityDriver(cache)
    rng = random.Random(seed)
    systems = [[rng.randrange(50) for _ in range(rng.randrange(100, 200))] for _ in range(4)]
    history: list[list[int]] = []
    for i in range(steps):
        drv.begin()
        head = rng.choice(history) if history and rng.random() < 0.5 else rng.choice(systems)
        with admitting(i):
            drv.add(i, head + [rng.randrange(50) for _ in range(rng.randrange(1, 80))])
        drv.compute()
        drv.end()
        drv.begin()
        drv.append(i, [rng.randrange(50) for _ in range(3)])
        drv.compute()
        drv.end()
        history.append(list(drv.seqs[i].tokens)[:220])
        drv.release(i)
    cache.synchronize()
    return drv


@pytest.mark.parametrize("rules", [None, frozenset({"S4", "S5"})], ids=["all-rules", "S2-off"])
def test_long_cascades_keep_every_byte(cfg_factory, rules):
    bulk: list[int] = []
    seams = Seams(copy_many_sizes=bulk) if rules is None else Seams(rules=rules, copy_many_sizes=bulk)
    cfg = cfg_factory(gpu=90, host=96, disk=160, simulate_async=True)
    # Cascades down to disk inside a step are what this checks: offloads wait for the
    # demotions they follow, rather than drop host blocks (test_drop_behind_disk.py).
    cfg["cache"]["disk"]["drop_behind"] = False
    cache = kvdist.testing.create(cfg, seams)
    try:
        drv = long_churn(cache)
        s = cache.stats()
        assert len(bulk) >= 10 and min(bulk) >= 32, bulk
        assert all(s["hit_tokens"][t] > 0 for t in ("gpu", "host", "disk")), s["hit_tokens"]
        assert drv.checked_tokens > 5000
        if rules is None:
            assert drv.mismatched_tokens == 0, drv.first_mismatch
            cache.check_invariants()
        else:
            assert drv.mismatched_tokens > 0
    finally:
        cache.close()


# -- moves in runs ------------------------------------------------------------------------------


class _Recorder(NullExecutor):
    """Copies nothing; records every copy handed to it."""

    def __init__(self) -> None:
        super().__init__()
        self.copies: list[tuple[str, list[int], list[int]]] = []

    def submit(self, route, src, dst, deps):
        self.copies.append((route.name, src.tolist(), dst.tolist()))
        return super().submit(route, src, dst, deps)


def _turns(batch_moves: bool, blocks: int, disk: int, steps: int = 9) -> tuple[CacheManager, _Recorder]:
    """bench manager's breakdown: three prompts take turns on a GPU tier holding two,
    each step onboarding one from the host tier (or the disk) and offloading as many."""
    ex = _Recorder()
    m = CacheManager(KVLayout(1, 1, 2, "float16", 2), (2 * blocks + 3, 3 * blocks + 5, disk), ex)
    m.pool.batch_moves = batch_moves
    rng = random.Random(blocks + disk)
    prompts = [[rng.randrange(50) for _ in range(2 * blocks + 1)] for _ in range(3)]
    for i in range(steps):
        m.begin_step()
        m.add_sequence(i, prompts[i % 3] + [i], priority=rng.choice([10, 35, 80]))
        m.table_rows([i])
        m.before_compute()
        m.end_step()
        if i:
            m.release(i - 1)
        m.check_invariants()
    m.synchronize()
    return m, ex


@pytest.mark.parametrize("blocks,disk", [(40, 0), (40, 30), (7, 200)])
def test_moves_in_runs_leave_the_cache_as_block_by_block_does(blocks, disk):
    """The same admissions with ``batch_moves`` on and off: every slot's state, hash,
    priority and reference count, the free and eviction lists in order, the index, the
    counters and the copies handed to the engine are the same."""
    (a, copies_a), (b, copies_b) = _turns(True, blocks, disk), _turns(False, blocks, disk)
    for name in ("hash_hi", "hash_lo", "prio", "refcnt", "state"):
        assert getattr(a.meta, name).tolist() == getattr(b.meta, name).tolist(), name
    sa, sb = a.pool.snapshot(), b.pool.snapshot()
    assert [None if f is None else f.tolist() for f in sa.free] == [None if f is None else f.tolist()
                                                                    for f in sb.free]
    assert [x.tolist() for x in sa.lru] == [x.tolist() for x in sb.lru]
    assert sorted(a.index.slots().tolist()) == sorted(b.index.slots().tolist())
    assert a.counters.blocks_moved == b.counters.blocks_moved and a.counters.evictions == b.counters.evictions
    assert a.counters.blocks_moved["onboard"] > 4 * blocks and a.counters.blocks_moved["offload"] > 4 * blocks
    assert copies_a.copies == copies_b.copies and len(copies_a.copies) > 8
