"""The subscriber side a router uses (``kvdist.events``): a gap-free stream from one
replica's sockets, the blocks each replica holds per medium, the longest cached prefix
of a prompt on each replica."""

from __future__ import annotations

import zmq

from kvdist.events import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ClusterBlocks,
    EventSubscriber,
    KVEventBatch,
    ReplicaBlocks,
    prompt_hashes,
)
from kvdist.events.wire import encoder
from kvdist.testing import Seams, create
from tests.test_events import Chains, cache_content, churn, events_cfg


def _stored(hashes, medium="GPU", parent=None):
    return BlockStored(block_hashes=list(hashes), parent_block_hash=parent, token_ids=[0] * 4 * len(hashes),
                       block_size=4, lora_id=None, medium=medium, lora_name=None)


def test_the_stream_is_gap_free_and_rebuilds_the_replica(tmp_path):
    seams = Seams()
    cache = create(events_cfg(tmp_path), seams)
    ev = cache.stats()["events"]
    sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"], "kv")
    try:
        churn(cache, Chains(cache.layout.hash_salt()), 40, seed=7)
        blocks, seqs = ReplicaBlocks(), []
        while sub.next_seq < cache.stats()["events"]["submitted"]:
            got = sub.poll(5000)
            assert got, "no batch arrived"
            for seq, batch in got:
                seqs.append(seq)
                blocks.apply(batch)
        assert seqs == list(range(cache.stats()["events"]["submitted"]))
        assert (sub.lost, sub.undecodable) == (0, 0)
        assert blocks.media == cache_content(seams)
        # A prompt's hashes as a router computes them: its cached prefix is found.
        prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13]
        cache.begin_step()
        cache.add_sequence("q", prompt)
        cache.block_table(["q"])
        cache.end_step()
        for _, batch in sub.poll(5000):
            blocks.apply(batch)
        hashes = prompt_hashes(prompt, cache.layout)
        assert len(hashes) == 2 and blocks.prefix_blocks(hashes) == 2
        assert blocks.prefix_blocks(hashes, media=["CPU", "DISK"]) == 0
    finally:
        sub.close()
        cache.close()


def test_a_late_subscriber_catches_up_and_a_lost_range_is_counted(tmp_path):
    seams = Seams()
    cache = create(events_cfg(tmp_path, buffer_steps=5), seams)
    try:
        churn(cache, Chains(cache.layout.hash_salt()), 12, seed=8)
        ev = cache.stats()["events"]
        late = EventSubscriber(ev["endpoint"], ev["replay_endpoint"], "kv")
        got = late.catch_up()
        n = ev["submitted"]
        assert [s for s, _ in got] == list(range(n - 5, n)), "only the last buffer_steps batches are kept"
        assert late.lost == n - 5 and late.next_seq == n
        late.close()
    finally:
        cache.close()


def test_a_gap_without_a_replay_socket_is_counted_as_lost():
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    sub = EventSubscriber(f"tcp://127.0.0.1:{port}", None, "", context=ctx)
    try:
        pack = encoder().encode
        payload = pack(KVEventBatch(ts=0.0, events=[_stored([1, 2])], data_parallel_rank=0))
        got = []
        while not got:  # until the subscription has reached the PUB socket
            pub.send_multipart((b"", (3).to_bytes(8, "big"), payload))
            got = sub.poll(100)
        assert [s for s, _ in got] == [3] and sub.lost == 3 and sub.next_seq == 4
        pub.send_multipart((b"", (4).to_bytes(8, "big"), b"\xc1not msgpack"))
        pub.send_multipart((b"", b"short", payload))
        pub.send_multipart((b"", (5).to_bytes(8, "big"), payload))
        got = []
        while sub.next_seq < 6:  # the copies of 3 sent while subscribing come first, skipped
            got += sub.poll(2000)
        assert [s for s, _ in got] == [5] and sub.undecodable == 2 and sub.lost == 3
    finally:
        sub.close()
        pub.close(linger=0)
        ctx.term()


def test_the_longest_prefix_on_each_replica():
    cluster = ClusterBlocks(3)
    cluster.apply(KVEventBatch(ts=0.0, events=[_stored([1, 2, 3])], data_parallel_rank=0))
    cluster.apply(KVEventBatch(ts=0.0, events=[_stored([1, 2], "GPU"), _stored([3, 4, 5], "CPU", parent=2)],
                               data_parallel_rank=1))
    cluster.apply(KVEventBatch(ts=0.0, events=[_stored([1, 2, 3, 4], "DISK")], data_parallel_rank=2))
    assert cluster.prefix_blocks([1, 2, 3, 4, 5, 6]) == [3, 5, 4]
    assert cluster.prefix_blocks([1, 2, 3, 4, 5, 6], media=["GPU"]) == [3, 2, 0]
    assert cluster.prefix_blocks([9, 1, 2]) == [0, 0, 0]
    # Removing a middle block cuts the prefix there; a clear forgets the replica.
    cluster.apply(KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[3], medium="CPU")]), replica=1)
    cluster.apply(KVEventBatch(ts=0.0, events=[AllBlocksCleared()], data_parallel_rank=2))
    assert cluster.prefix_blocks([1, 2, 3, 4, 5, 6]) == [3, 2, 0]
    assert len(cluster.replicas[1]) == 4 and len(cluster.replicas[2]) == 0
