"""The events' two halves without sockets: the pool's block observer (the recorder, on
the step's thread) and the builder (the publisher's thread) turn a manager's block
changes into events that, applied in order, give each tier's blocks exactly — after
every step, through the eviction cascade's corner cases."""

from __future__ import annotations

import random

import pytest

msgspec = pytest.importorskip("msgspec")

from kvdist.events import prompt_hashes  # noqa: E402
from kvdist.events.batcher import EventBuilder  # noqa: E402
from kvdist.events.recorder import DROPPED, MOVED, REGISTERED, BlockRecorder, Steps, records  # noqa: E402
from kvdist.events.wire import MEDIA, AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decoder  # noqa: E402
from kvdist.layout import KVLayout  # noqa: E402
from kvdist.manager import CacheManager  # noqa: E402
from kvdist.transfer.executors import NullExecutor  # noqa: E402

TPB = 4


class Stream:
    """A manager with the recorder on its pool, each step's records built right away,
    the events applied to per-medium sets."""

    def __init__(self, capacity: tuple[int, int, int], tpb: int = TPB):
        self.m = CacheManager(KVLayout(1, 1, 1, "float16", tpb), capacity, NullExecutor())
        self.recorder = BlockRecorder()
        self.builder = EventBuilder(self.m.space, tpb, self.m.salt)
        self.m.pool.block_observer = self.recorder
        self.held: dict[str, set[int]] = {m: set() for m in MEDIA}
        self.events: list = []

    def step(self, adds=(), appends=(), releases=()) -> None:
        m = self.m
        m.begin_step()
        for sid, tokens in adds:
            m.add_sequence(sid, tokens)
        for sid, tokens in appends:
            m.append_tokens(sid, tokens)
        m.before_compute()
        m.end_step()
        for sid in releases:
            m.release(sid)
        self.apply()

    def apply(self) -> None:
        step = self.recorder.take()
        events = self.builder.events(step) if step is not None else []
        self.events += events
        for ev in events:
            if type(ev) is BlockStored:
                for h in ev.block_hashes:
                    assert h not in self.held[ev.medium], f"{h:#x} stored twice in {ev.medium}"
                    self.held[ev.medium].add(h)
            elif type(ev) is BlockRemoved:
                for h in ev.block_hashes:
                    self.held[ev.medium].remove(h)
            else:
                assert type(ev) is AllBlocksCleared
                for s in self.held.values():
                    s.clear()

    def content(self) -> dict[str, set[int]]:
        m = self.m
        out: dict[str, set[int]] = {mm: set() for mm in MEDIA}
        for s in m.index.slots().tolist():
            out[MEDIA[m.space.tier_of(s)]].add(int(m.meta.hash_lo[s]))
        return out


def blocks(first: int, n: int) -> list[int]:
    return [first + i for i in range(n * TPB)]


def test_a_block_moved_in_and_dropped_in_one_run_of_moves():
    """GPU 4, host 1, no disk: freeing two GPU slots offloads the coldest block into
    the host slot, then evicts it from there (dropped: no colder tier) to offload the
    next into the same slot — a drop between two moves of one run, the second into the
    slot the drop freed."""
    s = Stream((4, 1, 0))
    s.step(adds=[("a", blocks(0, 2))], releases=["a"])
    assert s.held == s.content() and len(s.held["GPU"]) == 2
    evictions, dropped = s.m.counters.evictions[0], s.m.counters.dropped
    s.step(adds=[("b", blocks(100, 4))])
    assert s.m.counters.evictions[0] - evictions == 2 and s.m.counters.dropped - dropped == 1
    assert s.held == s.content()
    assert len(s.held["CPU"]) == 1 and len(s.held["GPU"]) == 4


@pytest.mark.parametrize("capacity", [(10, 1, 0), (10, 2, 1), (12, 3, 2), (16, 6, 12)])
def test_every_step_rebuilds_every_tier(capacity):
    """Shared prefixes, decode growth, releases and re-admissions over small tiers:
    after every step, the events applied so far give exactly what each tier indexes."""
    s = Stream(capacity)
    prefixes = [blocks(1000 * k, 3) for k in range(5)]
    for step in range(80):
        prompt = prefixes[step % 5][: (step % 3 + 1) * TPB] + [step, step + 1]
        s.step(adds=[(step, prompt)], appends=[(step - 1, [step] * 3)] if step else [],
               releases=[step - 1] if step else [])
        assert s.held == s.content(), f"step {step}"
    s.m.release(79)
    s.apply()
    assert s.held == s.content()
    c = s.m.counters
    assert sum(c.blocks_moved.values()) > 0 and c.evictions[0] > 0, "the churn must move blocks"


def test_a_block_computed_again_while_cached_is_stored_once():
    """A prompt of whole blocks, all cached: its last block is computed again into a
    private slot and registered there (the index keeps the cached one): no event."""
    s = Stream((10, 2, 2))
    s.step(adds=[("a", blocks(0, 2))], releases=["a"])
    stored = [e for e in s.events if type(e) is BlockStored]
    assert [len(e.block_hashes) for e in stored] == [2]
    s.step(adds=[("b", blocks(0, 2))], releases=["b"])
    assert [e for e in s.events if type(e) is BlockStored] == stored
    assert s.held == s.content() and len(s.held["GPU"]) == 2


WIDE = [0, 127, 128, 255, 256, 65535, 65536, 2**31 - 1, -1, -32, -33, -128, -129, -32768, -32769, -2**31]


def test_token_ids_of_every_msgpack_width_survive_moves_and_chained_runs():
    """The builder sends a block's token ids as the bytes encoded when it was
    registered (``msgspec.Raw``), alone after a move or joined under one list header in
    a chained run: decoded, every BlockStored names exactly its blocks' ids, whatever
    the width each id takes in msgpack (positive and negative fixints, 8, 16 and 32
    bits)."""
    s = Stream((6, 2, 3))
    layout = s.m.layout
    ids: dict[int, list[int]] = {}
    prompts = [WIDE[i:] + WIDE[:i] for i in range(0, 16, 3)]  # 16 ids: 4 blocks each
    for k, p in enumerate(prompts):
        for i, h in enumerate(prompt_hashes(p, layout)):
            ids[h] = p[i * TPB:(i + 1) * TPB]
        s.step(adds=[(k, p[:3 * TPB])])
        s.step(appends=[(k, p[3 * TPB:] + [7])], releases=[k])
    assert s.held == s.content()
    c = s.m.counters
    assert c.blocks_moved["offload"] > 0 and c.blocks_moved["demote"] > 0, "blocks must move down the tiers"
    encode, decode = msgspec.msgpack.Encoder().encode, decoder().decode
    batch = decode(encode(KVEventBatch(ts=0.0, events=s.events, data_parallel_rank=0)))
    stored = [e for e in batch.events if type(e) is BlockStored]
    assert {e.medium for e in stored} == set(MEDIA)
    assert any(len(e.block_hashes) > 1 for e in stored), "a chained run of blocks in one event"
    for e in stored:
        assert e.token_ids == [t for h in e.block_hashes for t in ids[h]]


def test_an_odd_block_size_pads_each_registration_to_whole_words():
    """Three token ids a block: a registration of an odd number of blocks has an odd
    number of ids, two a word in the step's records, the last word padded. Every
    registration, of one block or several, after others or before a move, gives each
    block exactly its ids, and the tiers exactly."""
    tpb = 3
    s = Stream((6, 2, 2), tpb=tpb)
    layout = s.m.layout
    ids: dict[int, list[int]] = {}
    for k in range(12):
        prompt = [k * 100 + i for i in range((k % 3 + 1) * tpb + 1)]  # 1-3 blocks and one id more
        s.step(adds=[(k, prompt)])
        grown = prompt + [-k - 1] * (tpb - 1)  # the last block fills: registered alone
        s.step(appends=[(k, [-k - 1] * (tpb - 1))], releases=[k])
        for i, h in enumerate(prompt_hashes(grown, layout)):
            ids[h] = grown[i * tpb:(i + 1) * tpb]
        assert s.held == s.content(), f"prompt {k}"
    encode, decode = msgspec.msgpack.Encoder().encode, decoder().decode
    batch = decode(encode(KVEventBatch(ts=0.0, events=s.events, data_parallel_rank=0)))
    stored = [e for e in batch.events if type(e) is BlockStored]
    assert sum(len(e.block_hashes) for e in stored) > len(ids), "blocks must be stored again after moves"
    for e in stored:
        assert e.block_size == tpb and e.token_ids == [t for h in e.block_hashes for t in ids[h]]


@pytest.mark.parametrize("tpb", [TPB, 3])
def test_the_stream_cut_anywhere_gives_back_each_step_whole(tpb):
    """The publisher reads the log in pieces cut anywhere (a read between the writer's
    stores, or a step published in parts when the log was full): fed the steps' bytes
    in random pieces, ``Steps`` gives back exactly the steps, in order, each once its
    trailer has come — registrations (padded, for an odd block size), moves and drops."""
    s = Stream((10, 2, 1), tpb=tpb)
    steps = []
    for step in range(60):
        prompt = [7] * tpb * (step % 4 + 1) + [step] * (tpb + 1)
        s.m.begin_step()
        s.m.add_sequence(step, prompt)
        s.m.before_compute()
        s.m.end_step()
        if step:
            s.m.release(step - 1)
        got = s.recorder.take()
        if got is not None:
            steps.append(got)
    kinds = {r[0] for st in steps for r in records(st, tpb)}
    assert {REGISTERED, MOVED, DROPPED} <= kinds, kinds
    data = b"".join(st.tobytes() for st in steps)
    rng = random.Random(tpb)
    cut, at, out = Steps(tpb), 0, []
    while at < len(data):
        n = rng.choice([1, 3, 8, 13, 64, 500])
        out += cut.feed(data[at : at + n])
        at += n
    assert [o.tobytes() for o in out] == [st.tobytes() for st in steps]
    assert cut.feed(b"") == []
