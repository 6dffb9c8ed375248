"""KV cache events under mpiexec: with ``distributed.tp_size`` 2 only TP rank 0 of each
replica publishes, on the base port offset by its replica (the replay socket likewise),
its batches tagged with the replica as ``data_parallel_rank``. Written for
``mpiexec -n 4`` (2 replicas x TP 2), valid at any world size: TP 2 when the world is
even, else TP 1."""

import socket

import pytest

import kvdist
from kvdist.events import EventSubscriber, ReplicaBlocks, prompt_hashes
from tests.conftest import make_cfg
from tests.mpi.replica_harness import need_replicas

pytestmark = pytest.mark.mpi


def _free_run(n: int) -> int:
    """A base port p with p .. p+n-1 free now (found by binding port 0, never fixed)."""
    while True:
        socks = [socket.socket()]
        socks[0].bind(("127.0.0.1", 0))
        base = socks[0].getsockname()[1]
        try:
            for i in range(1, n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", base + i))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()


def test_only_tp_rank_0_of_each_replica_publishes_on_its_port():
    from mpi4py import MPI

    world = MPI.COMM_WORLD
    T = 2 if world.size % 2 == 0 else 1
    R = world.size // T
    base = world.bcast(_free_run(2 * R) if world.rank == 0 else None)
    cfg = make_cfg(cache={"gpu": {"blocks": 32},
                          "events": {"enabled": True, "endpoint": f"tcp://127.0.0.1:{base}",
                                     "replay_endpoint": f"tcp://127.0.0.1:{base + R}", "topic": "kv"}},
                   distributed={"tp_size": T, "consensus_timeout_s": 30})
    cache = kvdist.create(cfg)
    try:
        r = cache.replica
        ev = cache.stats()["events"]
        if cache.tp_rank == 0:
            assert (ev["endpoint"], ev["replay_endpoint"]) == \
                (f"tcp://127.0.0.1:{base + r}", f"tcp://127.0.0.1:{base + R + r}")
        else:
            assert ev == {}
        prompt = [100 * r + i for i in range(4 * (r + 2) + 1)]  # r + 2 full blocks of 4
        cache.begin_step()
        cache.add_sequence("s", prompt)
        cache.block_table(["s"])
        cache.end_step()
        world.barrier()
        if world.rank == 0:
            for rep in range(R):
                sub = EventSubscriber(f"tcp://127.0.0.1:{base + rep}",
                                      f"tcp://127.0.0.1:{base + R + rep}", "kv")
                got = sub.catch_up()
                sub.close()
                assert [s for s, _ in got] == [0] and got[0][1].data_parallel_rank == rep
                blocks = ReplicaBlocks()
                blocks.apply(got[0][1])
                hashes = prompt_hashes([100 * rep + i for i in range(4 * (rep + 2) + 1)], cache.layout)
                assert blocks.media["GPU"] == set(hashes) and len(hashes) == rep + 2
        world.barrier()
    finally:
        cache.close()


def test_blocks_landed_from_another_replica_are_announced_by_their_hash():
    """The remote tier: the fetching replica's blocks that landed from the holder are
    stored by hash alone (no parent, no token ids); each publishing rank's stream still
    rebuilds exactly what its tiers hold."""
    from mpi4py import MPI

    from tests.mpi.replica_harness import FETCHER, FULL, HOLDER, PROMPT, Replica, config, exchange_digests
    from tests.test_events import cache_content

    world = MPI.COMM_WORLD
    need_replicas(world.size)
    cfg = config(world=world.size)
    cfg["cache"]["events"] = {"enabled": True, "endpoint": "tcp://127.0.0.1:0",
                              "replay_endpoint": "tcp://127.0.0.1:0"}
    with Replica(cfg) as r:
        exchange_digests(r, r.hold_prompt() if r.replica == HOLDER else None)
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
            assert r.step({"p": PROMPT}, keep=True) == {"p": FULL * 4}
            assert r.cache.stats()["remote"]["blocks_landed"] == FULL
            r.d.release("p")
            world.Ibarrier().Wait()
        else:
            r.serve_until(world.Ibarrier())
        if r.cache.tp_rank == 0:
            ev = r.cache.stats()["events"]
            sub = EventSubscriber(ev["endpoint"], ev["replay_endpoint"])
            got = sub.catch_up()
            sub.close()
            assert [s for s, _ in got] == list(range(ev["submitted"])) and sub.lost == 0
            blocks = ReplicaBlocks()
            for _, batch in got:
                blocks.apply(batch)
            assert blocks.media == cache_content(r.seams)
            by_hash_alone = {h for _, b in got for e in b.events
                             if type(e).__name__ == "BlockStored" and not e.token_ids for h in e.block_hashes}
            want = set(prompt_hashes(PROMPT, r.cache.layout)[:FULL]) if r.replica == FETCHER else set()
            assert by_hash_alone == want
        world.Barrier()
