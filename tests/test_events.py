"""KV cache events, read the way a vLLM subscriber reads them: the msgspec structs are
declared here from vLLM v0.33.0's ``vllm/distributed/kv_events.py`` (not imported from
kvdist), the sockets are plain pyzmq. A run with GPU, host and disk tiers churns blocks
through every tier (offload, demote, drop, onboard, promote, decode-filled blocks); the
subscriber decodes every batch and rebuilds, per medium, exactly the blocks each tier
holds; sequence numbers have no gap; a late subscriber converges by replay; garbage on
the replay socket gets nothing and breaks nothing."""

from __future__ import annotations

import random
from typing import Any

import msgspec
import pytest
import xxhash
import zmq

from kvdist.blocks import TIER_NAMES
from kvdist.testing import Seams, create
from tests.conftest import make_cfg

MASK64 = (1 << 64) - 1
TPB = 4
MEDIUM = {"gpu": "GPU", "host": "CPU", "disk": "DISK"}
# How long a subscriber waits for a batch or a replay's next frame before it fails: the
# publisher's process answers at once and publishes every few tens of ms, but a CI box
# of two cores under load can keep it off a CPU for seconds. Waits end as soon as what
# they wait for has come: a long bound costs a passing run nothing.
WAIT_S = 60.0


# -- vLLM v0.33.0's wire format, declared here --------------------------------------------------
class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None
    lookahead_token_ids: list[list[int]] | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


DECODE = msgspec.msgpack.Decoder(type=KVEventBatch).decode


class VllmSubscriber:
    """SUB on the PUB endpoint, DEALER on the replay endpoint, as a vLLM consumer."""

    def __init__(self, ctx: zmq.Context, endpoint: str, replay: str, topic: bytes):
        self.topic = topic
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, topic)
        self.sub.connect(endpoint)
        self.req = ctx.socket(zmq.DEALER)
        self.req.connect(replay)
        self.next = 0  # the next sequence number this subscriber has not seen

    def live(self, until: int, timeout_s: float = WAIT_S) -> list[tuple[int, KVEventBatch]]:
        """The batches not had yet that come on the SUB socket, until batch ``until - 1``
        has come, or none has for ``timeout_s`` (the publisher's process publishes
        every PERIOD_S or IDLE_S: on a loaded box, later)."""
        out = []
        while self.next < until and self.sub.poll(int(timeout_s * 1000)):
            topic, seq, payload = self.sub.recv_multipart()
            assert topic == self.topic and len(seq) == 8
            n = int.from_bytes(seq, "big")
            if n >= self.next:  # not had by replay already
                out.append((n, DECODE(payload)))
                self.next = n + 1
        return out

    def replay(self, start: int) -> list[tuple[int, KVEventBatch]]:
        self.req.send_multipart([b"", start.to_bytes(8, "big")])
        out = []
        while True:
            assert self.req.poll(int(WAIT_S * 1000)), "the replay did not end with seq -1"
            delim, topic, seq, payload = self.req.recv_multipart()
            assert delim == b""
            n = int.from_bytes(seq, "big", signed=True)
            if n == -1:
                assert (topic, payload) == (b"", b"")
                return out
            assert topic == self.topic
            out.append((n, DECODE(payload)))
            self.next = max(self.next, n + 1)

    def close(self) -> None:
        self.sub.close(linger=0)
        self.req.close(linger=0)


def rebuild(batches: list[tuple[int, KVEventBatch]]) -> dict[str, set[int]]:
    held: dict[str, set[int]] = {"GPU": set(), "CPU": set(), "DISK": set()}
    for _, batch in batches:
        for ev in batch.events:
            if isinstance(ev, BlockStored):
                for h in ev.block_hashes:
                    assert h not in held[ev.medium], f"{h:#x} stored twice in {ev.medium}"
                    held[ev.medium].add(h)
            elif isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    held[ev.medium].remove(h)  # KeyError: removed without being stored
            else:
                for s in held.values():
                    s.clear()
    return held


def cache_content(seams: Seams) -> dict[str, set[int]]:
    """What each tier holds, read from the manager: every indexed slot's hash."""
    m = seams.manager
    out = {MEDIUM[TIER_NAMES[t]]: set() for t in range(3)}
    for s in m.index.slots().tolist():
        out[MEDIUM[TIER_NAMES[m.space.tier_of(s)]]].add(int(m.meta.hash_lo[s]))
    return out


class Chains:
    """The hash chain of every token stream the test gave the cache, computed here:
    wire hash -> (parent wire hash or None, the block's token ids)."""

    def __init__(self, salt: bytes):
        self.salt = salt
        self.blocks: dict[int, tuple[int | None, list[int]]] = {}

    def add(self, tokens: list[int]) -> None:
        parent, parent_wire = self.salt, None
        for i in range(len(tokens) // TPB):
            block = tokens[i * TPB:(i + 1) * TPB]
            data = b"".join(t.to_bytes(4, "little", signed=True) for t in block)
            h = xxhash.xxh3_128_intdigest(parent + data)
            self.blocks[h & MASK64] = (parent_wire, block)
            parent, parent_wire = h.to_bytes(16, "little"), h & MASK64


def events_cfg(tmp_path, **events):
    block = 2 * 2 * TPB * 2 * 8 * 2
    return make_cfg(cache={
        "gpu": {"blocks": 24}, "host": {"bytes": 16 * block},
        "disk": {"path": str(tmp_path / "disk"), "bytes": 24 * block},
        "recompute_when_faster": False,
        "events": {"enabled": True, "endpoint": "tcp://127.0.0.1:0",
                   "replay_endpoint": "tcp://127.0.0.1:0", "topic": "kv", **events}})


def churn(cache, chains: Chains, steps: int, seed: int = 0) -> None:
    """Prompts over a few shared prefixes, decode growth, prefetches: blocks offloaded,
    demoted, dropped from disk, onboarded and promoted back; blocks filled again while
    cached (not stored twice)."""
    rnd = random.Random(seed)
    prefixes = [[rnd.randrange(1000) for _ in range(4 * TPB)] for _ in range(6)]
    live: dict[tuple[int, int], list[int]] = {}
    for step in range(steps):
        prompt = (rnd.choice(prefixes)[: rnd.randrange(1, 5) * TPB]
                  + [rnd.randrange(1000) for _ in range(rnd.randrange(1, 9))])
        if step % 7 == 3:  # whole blocks only: the last, cached, is computed again (a private copy)
            prompt = rnd.choice(prefixes)[: 2 * TPB]
        if step % 5 == 0:
            cache.prefetch(f"p{step}", prompt)
        cache.begin_step()
        cache.add_sequence((seed, step), prompt)
        live[(seed, step)] = prompt
        for sid in list(live)[:-1]:
            tok = rnd.randrange(1000)
            cache.append_tokens(sid, [tok])
            live[sid].append(tok)
        cache.block_table(list(live))
        cache.end_step()
        chains.add(live[(seed, step)])
        while len(live) > (2 if step < steps - 1 else 0):
            sid = next(iter(live))
            chains.add(live.pop(sid))
            cache.release(sid)


def received_until(sub: VllmSubscriber, cache, min_live: int = 0) -> list[tuple[int, KVEventBatch]]:
    """Every batch numbered so far and not yet received: live, and by replay those
    the subscriber joined too late for (a PUB socket drops what it sends before a
    subscription reaches it) or that are still on their way. The live ones have no gap."""
    want = cache.stats()["events"]["submitted"]
    start = sub.next
    live = sub.live(want, timeout_s=5.0)  # silence: the rest (all, if subscribed too late) by replay
    seqs = [s for s, _ in live]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs))) if seqs else True, "live numbers have a gap"
    assert len(live) >= min_live, f"only {len(live)} batch(es) came live"
    replayed = [b for b in sub.replay(start) if b[0] < want and b[0] not in seqs]
    out = sorted(live + replayed, key=lambda b: b[0])
    assert [s for s, _ in out] == list(range(start, want)), "sequence numbers have a gap"
    return out


def test_a_vllm_subscriber_rebuilds_every_tier_exactly(tmp_path):
    seams = Seams()
    cache = create(events_cfg(tmp_path), seams)
    ctx = zmq.Context()
    ev = cache.stats()["events"]
    sub = VllmSubscriber(ctx, ev["endpoint"], ev["replay_endpoint"], b"kv")
    try:
        chains = Chains(cache.layout.hash_salt())
        churn(cache, chains, 120)
        st = cache.stats()
        moved = st["blocks_moved"]
        assert min(moved["offload"], moved["demote"], moved["onboard"], moved["reload"], moved["promote"],
                   st["dropped"]) > 0, f"the churn must reach every tier and route: {moved}, {st['dropped']}"
        batches = received_until(sub, cache, min_live=10)
        assert [s for s, _ in batches] == list(range(st["events"]["submitted"]))
        assert all(b.data_parallel_rank == 0 for _, b in batches)
        held = rebuild(batches)
        assert held == cache_content(seams)
        assert all(held.values()), f"every tier holds blocks at the end: {held}"
        # Every stored block names its parent and its tokens as the test computed them
        # (blocks chain through parent_block_hash; one event may carry a chained run).
        n_stored = 0
        for _, b in batches:
            for e in b.events:
                if isinstance(e, BlockStored):
                    assert e.block_size == TPB and e.lora_id is None and e.lora_name is None
                    assert len(e.token_ids) == TPB * len(e.block_hashes)
                    parent = e.parent_block_hash
                    for i, h in enumerate(e.block_hashes):
                        assert chains.blocks[h] == (parent, e.token_ids[i * TPB:(i + 1) * TPB])
                        parent = h
                        n_stored += 1
        assert n_stored > st["blocks_moved"]["offload"]
    finally:
        sub.close()
        cache.close()
    ctx.term()


def test_a_late_subscriber_converges_by_replay(tmp_path):
    seams = Seams()
    cache = create(events_cfg(tmp_path), seams)
    ctx = zmq.Context()
    try:
        churn(cache, Chains(cache.layout.hash_salt()), 60, seed=1)
        ev = cache.stats()["events"]
        late = VllmSubscriber(ctx, ev["endpoint"], ev["replay_endpoint"], b"kv")
        got = late.replay(0)
        assert [s for s, _ in got] == list(range(ev["submitted"]))
        held = rebuild(got)
        assert held == cache_content(seams)
        # Replay from the middle: exactly the tail; past the end: only the end marker.
        assert [s for s, _ in late.replay(ev["submitted"] - 3)] == list(range(ev["submitted"] - 3,
                                                                              ev["submitted"]))
        assert late.replay(ev["submitted"] + 100) == []
        # Then live batches continue where the replay ended.
        churn(cache, Chains(cache.layout.hash_salt()), 10, seed=2)
        tail = received_until(late, cache)
        assert rebuild(got + tail) == cache_content(seams)
        late.close()
    finally:
        cache.close()
    ctx.term()


def test_garbage_replay_requests_get_nothing_and_break_nothing(tmp_path):
    seams = Seams()
    cache = create(events_cfg(tmp_path), seams)
    ctx = zmq.Context()
    try:
        churn(cache, Chains(cache.layout.hash_salt()), 20, seed=3)
        ev = cache.stats()["events"]
        bad = ctx.socket(zmq.DEALER)
        bad.connect(ev["replay_endpoint"])
        for frames in ([b"", b"\x00\x01\x02"], [b"no delimiter"], [b"", (0).to_bytes(8, "big"), b"extra"],
                       [b"x", (0).to_bytes(8, "big")], [b"", b""], [b"", b"\xff" * 9]):
            bad.send_multipart(frames)
        assert not bad.poll(500), f"a garbage replay request was answered: {bad.recv_multipart()}"
        # The replay socket and the stream still work, for that client and a new one.
        good = VllmSubscriber(ctx, ev["endpoint"], ev["replay_endpoint"], b"kv")
        first = good.replay(0)
        assert [s for s, _ in first] == list(range(ev["submitted"]))
        bad.send_multipart([b"", (ev["submitted"] - 1).to_bytes(8, "big")])
        assert bad.poll(int(WAIT_S * 1000))
        assert int.from_bytes(bad.recv_multipart()[2], "big") == ev["submitted"] - 1
        churn(cache, Chains(cache.layout.hash_salt()), 5, seed=4)
        assert rebuild(first + received_until(good, cache)) == cache_content(seams)
        bad.close(linger=0)
        good.close()
    finally:
        cache.close()
    ctx.term()


def test_close_publishes_all_blocks_cleared(tmp_path):
    seams = Seams()
    cache = create(events_cfg(tmp_path), seams)
    ctx = zmq.Context()
    ev = cache.stats()["events"]
    sub = VllmSubscriber(ctx, ev["endpoint"], ev["replay_endpoint"], b"kv")
    try:
        churn(cache, Chains(cache.layout.hash_salt()), 10, seed=5)
        before = received_until(sub, cache)
        assert sum(map(len, rebuild(before).values())) > 0
        submitted = cache.stats()["events"]["submitted"]
    finally:
        cache.close()
    last = sub.live(submitted + 1)
    assert [s for s, _ in last] == [submitted]
    assert isinstance(last[0][1].events[-1], AllBlocksCleared)
    assert rebuild(before + last) == {"GPU": set(), "CPU": set(), "DISK": set()}
    sub.close()
    ctx.term()


def test_events_off_attach_nothing(tmp_path):
    seams = Seams()
    cfg = events_cfg(tmp_path)
    cfg["cache"]["events"]["enabled"] = False
    cache = create(cfg, seams)
    try:
        assert seams.manager.pool.block_observer is None
        assert seams.rank_cache.events is None
        assert cache.stats()["events"] == {}
    finally:
        cache.close()


@pytest.mark.parametrize("topic", ["", "kv"])
def test_a_topic_filter_sees_only_its_topic(tmp_path, topic):
    cache = create(events_cfg(tmp_path, topic=topic), Seams())
    ctx = zmq.Context()
    ev = cache.stats()["events"]
    other = ctx.socket(zmq.SUB)
    other.setsockopt(zmq.SUBSCRIBE, b"other")
    other.connect(ev["endpoint"])
    sub = VllmSubscriber(ctx, ev["endpoint"], ev["replay_endpoint"], topic.encode())
    try:
        churn(cache, Chains(cache.layout.hash_salt()), 5, seed=6)
        assert [s for s, _ in received_until(sub, cache)] == list(range(cache.stats()["events"]["submitted"]))
        assert not other.poll(200)
    finally:
        other.close(linger=0)
        sub.close()
        cache.close()
    ctx.term()
