"""The remote tier under mpiexec (rules R1–R4 of docs/design.md, "Remote tier").

Replica 0 computes a prompt and pushes it to its host tier; replica 1 reuses it from
there. Each rule's test also runs with that rule removed and shows what it prevents:
wrong bytes (R2), TP ranks that diverge (R1, R4). See ``replica_harness`` for the
world sizes these run at."""

from __future__ import annotations

import os
import signal
import time
import warnings

import pytest

import kvdist
from kvdist.distributed.remote_rules import REMOTE_RULES
from tests.mpi.replica_harness import (
    BLOCK,
    DEVICE,
    FETCHER,
    FULL,
    HOLDER,
    PROMPT,
    Replica,
    config,
    exchange_digests,
    need_replicas,
    tp_size,
    within,
)

pytestmark = pytest.mark.mpi


@pytest.fixture
def world():
    from mpi4py import MPI

    need_replicas(MPI.COMM_WORLD.size)
    return MPI.COMM_WORLD


ALL = REMOTE_RULES  # every rule on: the default of a cache
_CUDA_STEPS = 5  # steps a prefetch on CUDA may take to be agreed landed (1-2 seen on the H200)


def _open(world, rules: frozenset[str] = ALL, near: bool = True, **kw) -> Replica:
    """``near`` False: prefetches land blocks of node peers in the host tier through the
    shared transport (by default add_sequence fetches them itself, ``RemoteTier.near``)."""
    r = Replica(config(world=world.size, **kw), rules)
    if not near:
        r.remote.near = frozenset()
    return r


@pytest.mark.parametrize("transport", ["auto", "messages"])
def test_replica_reuses_a_prefix_only_another_replica_computed(world, transport):
    with _open(world, transport=transport) as r:
        kinds = r.cache.stats()["remote"]["transports"]
        assert "remote" in r.cache.tiers
        assert kinds == {"shared" if transport == "auto" else "messages": r.cache.num_replicas - 1}
        digests = r.hold_prompt() if r.replica == HOLDER else None
        want = exchange_digests(r, digests)
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
            reused = r.step({"p": PROMPT}, keep=True)
            assert reused == {"p": FULL * 4}
            assert r.block_digests("p", FULL) == want  # every block, every layer, this shard
            assert r.d.mismatched_tokens == 0 and r.d.checked_tokens == FULL * 4
            s = r.cache.stats()
            assert s["hit_tokens"]["remote"] == FULL * 4 and s["bytes_fetched_remote"] == FULL * 512
            assert s["remote_misses"] == 0
            r.d.release("p")
            world.Ibarrier().Wait()
        else:
            r.serve_until(world.Ibarrier())  # messages: the holder answers between its steps
        r.cache.check_consistency()
        # One node: the replicas list their blocks in the node directory, send no
        # directory messages and never probe for fetch requests; with messages, both.
        s = r.cache.stats()["remote"]
        heard = s["directory_messages_sent"] if r.replica == HOLDER else s["directory_messages_received"]
        assert (heard > 0, r.remote.serve) == ((False, False) if transport == "auto" else (True, True))
        assert (s["node_directory_bytes"] > 0) == (transport == "auto")


def test_node_peers_share_the_node_directory_and_the_others_get_messages(world, monkeypatch):
    """TP 1, two ranks a (faked) node: replica 0 and replica 1 are node peers, the other
    replicas are on other nodes. Every other replica reuses replica 0's prompt: replica
    1 finds it in the node directory, the others in the records replica 0 sent them;
    replica 0 sends records to the replicas of other nodes only."""
    if world.size < 4 or world.size % 2:
        pytest.skip("needs two faked nodes of two ranks")
    monkeypatch.setenv("KVDIST_FAKE_RANKS_PER_NODE", "2")
    cfg = config(world=world.size)
    cfg["distributed"]["tp_size"] = 1
    with Replica(cfg, ALL) as r:
        me, n = r.replica, r.cache.num_replicas
        mate = me ^ 1  # the other replica of this rank's node
        assert r.remote.channel.peers == tuple(p for p in range(n) if p not in (me, mate))
        assert r.cache.stats()["remote"]["transports"] == {"shared": 1, "messages": n - 2}
        r.hold_prompt() if me == HOLDER else None
        world.Barrier()
        if me != HOLDER:
            r.wait_for_directory()
            assert r.step({"p": PROMPT}) == {"p": FULL * 4} and r.d.mismatched_tokens == 0
            world.Ibarrier().Wait()
        else:
            r.serve_until(world.Ibarrier())
        s = r.cache.stats()["remote"]
        if me == HOLDER:
            assert s["directory_messages_sent"] > 0 and s["directory_messages_sent"] % (n - 2) == 0
        r.cache.check_consistency()


def test_one_tp_rank_reads_the_node_directorys_epochs_for_its_group(world, monkeypatch):
    """Shared memory, TP groups: the agreement's MIN takes the node peers' published
    epochs from TP rank 0 alone (the others put the largest count); the fetcher's
    ranks still apply the same epochs and reuse the holder's prompt, and R4 keeps them
    consistent."""
    if tp_size(world.size) < 2:
        pytest.skip("needs TP ranks")
    from kvdist.distributed.node_directory import NodeDirectory

    reads = []
    observe = NodeDirectory.observe
    monkeypatch.setattr(NodeDirectory, "observe",
                        lambda self, counts: (reads.append(1), observe(self, counts)))
    with _open(world) as r:
        r.hold_prompt() if r.replica == HOLDER else None
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
            assert r.step({"p": PROMPT}) == {"p": FULL * 4} and r.d.mismatched_tokens == 0
            world.Ibarrier().Wait()
        else:
            r.serve_until(world.Ibarrier())
        r.cache.check_consistency()
        read_any = world.allgather(bool(reads))
    T = tp_size(world.size)
    assert read_any == [rank % T == 0 for rank in range(world.size)]


@pytest.mark.parametrize("ride", [True, False], ids=["agreed-at-end_step", "agreed-at-begin_step"])
@pytest.mark.parametrize("inside_a_step", [True, False], ids=["in-step", "between-steps"])
def test_prefetch_lands_before_admission(world, inside_a_step, ride):
    """A prefetch starts the blocks at once inside a step, else right after the next
    begin_step. The next agreement says they landed: that step's end_step when the
    agreement rides on the recompute policy's per-step MIN-reduce (``ride``), else the next
    begin_step. On CUDA the copies run on the GPU's streams and an agreement counts them
    landed only once their events completed (a serving loop asks ``prefetch_ready`` each
    step; on the H200 they were agreed one or two steps later, never lost): the test
    steps, synchronizing, until they are, a few steps at most. (On one node the
    prefetch is of blocks of a node peer, which add_sequence would fetch itself: the
    test asks for the prefetch's landing in the host tier.)"""
    with _open(world, policy=ride, near=False) as r:
        r.hold_prompt() if r.replica == HOLDER else None
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
            if inside_a_step:
                r.d.begin()
            assert r.cache.prefetch("p", PROMPT) == FULL
            assert not r.cache.prefetch_ready("p")
            if inside_a_step:
                r.d.end()
            else:
                r.step()  # its begin_step starts the fetch
            if DEVICE == "cpu":  # the copies ran at once
                assert r.cache.prefetch_ready("p") == ride
                if not r.cache.prefetch_ready("p"):
                    r.step()  # its begin_step agrees the blocks landed
            else:  # the copies run on the GPU's streams: an agreement sees them once they are done
                for _ in range(_CUDA_STEPS):
                    if r.cache.prefetch_ready("p"):
                        break
                    r.cache.synchronize()
                    r.step()
            assert r.cache.prefetch_ready("p")
            assert r.step({"p": PROMPT}) == {"p": FULL * 4}
            s = r.cache.stats()
            assert s["hit_tokens"]["remote"] == FULL * 4 and r.d.mismatched_tokens == 0
            assert s["remote"]["prefetches"] == 1 and s["remote"]["blocks_landed"] == FULL
        world.Barrier()
        r.cache.check_consistency()


@pytest.mark.parametrize("transport", ["auto", "messages"])
def test_a_node_peers_blocks_are_fetched_at_admission_not_prefetched(world, transport):
    """A replica's scheduler (``Scheduler`` behind ``PrefetchGate``) over a request whose
    blocks only the other replica holds. From a replica on this node (shared memory)
    nothing is prefetched: the gate admits the request in the step it became runnable,
    and add_sequence lands the blocks straight in its GPU slots (one DMA on CUDA, as
    fast as onboarding host hits), the holder's bytes. By messages (another node) the
    prefetch starts them into the host tier and the request waits a step or more."""
    import numpy as np

    from kvdist.sim.engine.scheduler import Scheduler
    from kvdist.sim.experiment.admission import PrefetchGate
    from kvdist.sim.experiment.workload import Request, Trace

    with _open(world, transport=transport) as r:
        digests = r.hold_prompt() if r.replica == HOLDER else None
        want = exchange_digests(r, digests)
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
            gate = PrefetchGate(r.cache)
            rq = Request(0, 0, 0, 0, np.asarray(PROMPT, np.int32), np.asarray([1, 2], np.int32), -1)
            sched = Scheduler(Trace([rq], []), max_batch=4, max_prefill_tokens=4096, gpu_blocks=16,
                              tokens_per_block=4, gate=gate)
            hashes = r.prompt_hashes()
            admitted_at = None
            for step in range(_CUDA_STEPS * 40):  # messages: the holder answers between its steps
                r.d.begin()
                plan = sched.next_step()
                if plan.prefills:
                    admitted_at = step
                    assert [r.remote.slots.tier_of(h) for h in hashes] == (
                        [None] * FULL if transport == "auto" else [1] * FULL)  # landed in host
                    assert r.d.add(0, PROMPT) == FULL * 4
                    assert [r.remote.slots.tier_of(h) for h in hashes] == [0] * FULL  # on the GPU
                    r.tables["p"] = r.d.compute()[0].clone()
                r.d.end()
                sched.complete(plan)
                if admitted_at is not None:
                    break
                time.sleep(0.002)
            s = r.cache.stats()
            if transport == "auto":
                assert (admitted_at, gate.prefetched, gate.held) == (0, 0, 0)
                assert r.remote.counters.hit_blocks == [FULL, 0, 0]  # reused where they landed: GPU
                assert s["remote"]["prefetches"] == 0
            else:
                assert admitted_at is not None and admitted_at >= 1 and (gate.prefetched, gate.held) == (1, 1)
                assert r.remote.counters.hit_blocks == [0, FULL, 0]  # onboarded from the host tier
                assert s["remote"]["prefetches"] == 1
            assert s["remote"]["blocks_landed"] == FULL and s["bytes_fetched_remote"] == FULL * 512
            assert r.block_digests("p", FULL) == want and r.d.mismatched_tokens == 0
            r.d.release(0)
            world.Ibarrier().Wait()
        else:
            r.serve_until(world.Ibarrier())
        r.cache.check_consistency()


def test_a_mixed_requests_near_blocks_are_fetched_at_admission_and_the_far_ones_prefetched(
        world, monkeypatch):
    """A request whose first 4 blocks a replica on this node holds and whose last 4 only
    a replica on another (faked) node holds: the prefetch starts the far 4 alone, by
    messages into the host tier; admission fetches the near 4 straight into the GPU
    slots (one DMA from the peer's mapping) and onboards the far 4 from the host tier.
    Nodes of two replicas each (TP 1 at 4 ranks; TP 2 from 6): every TP rank of the
    fetcher decides the same blocks (R1: ``near`` comes from the start-up table)."""
    T = 2 if world.size >= 6 and world.size % 2 == 0 else 1
    if world.size < 3:
        pytest.skip("needs three replicas")
    monkeypatch.setenv("KVDIST_FAKE_RANKS_PER_NODE", str(2 * T))
    near, fetcher, far = 0, 1, 2  # replicas 0 and 1 share a node; 2 is on the next one
    head = PROMPT[:4 * 4 + 1]  # the near holder's prompt: the first 4 blocks of PROMPT
    cfg = config(world=world.size)
    cfg["distributed"]["tp_size"] = T
    with Replica(cfg, ALL) as r:
        me, n = r.replica, r.cache.num_replicas
        digests = None
        if me in (near, far):
            prompt = head if me == near else PROMPT
            blocks = len(r.prompt_hashes(prompt))
            r.step({"p": prompt}, keep=True)
            digests = r.block_digests("p", blocks)
            r.d.release("p")
            for k in range(3):
                r.step({f"f{k}": list(range(5000 + 100 * k, 5040 + 100 * k))})
            assert [r.remote.slots.tier_of(h) for h in r.prompt_hashes(prompt)] == [1] * blocks
        everyone = world.allgather(digests)
        world.Barrier()
        if me == fetcher:
            tp_rank = r.cache.tp_rank
            want = everyone[near * T + tp_rank][:4] + everyone[far * T + tp_rank][4:]
            assert r.cache.stats()["remote"]["transports"] == {"shared": 1, "messages": n - 2}
            hashes = r.prompt_hashes()
            directory = r.remote.directory
            for _ in range(400):  # the node directory lists the head, the far replica's records the rest
                if [directory.holder(g)[0] for g in directory.match(hashes)] == [near] * 4 + [far] * 4:
                    break
                time.sleep(0.002)
                r.step()
            else:
                raise AssertionError("the directory never listed the prompt at both holders")
            r.d.begin()
            started = r.cache.prefetch("p", PROMPT)
            r.d.end()
            for _ in range(400):  # the far holder answers between its steps
                if r.cache.prefetch_ready("p"):
                    break
                time.sleep(0.002)
                r.step()
            before = [r.remote.slots.tier_of(h) for h in hashes]
            reused = r.step({"p": PROMPT}, keep=True)
            after = [r.remote.slots.tier_of(h) for h in hashes]
            s = r.cache.stats()
            mine = (started, before, reused, after, list(r.remote.counters.hit_blocks),
                    s["remote"]["batches"], s["remote"]["blocks_landed"])
            assert r.tp.allgather(mine, "test: decisions") == [mine] * T  # R1
            assert started == 4  # the far blocks alone
            assert before == [None] * 4 + [1] * 4  # the far ones landed in the host tier, the near not yet
            assert reused == {"p": FULL * 4} and after == [0] * FULL
            assert r.remote.counters.hit_blocks == [4, 4, 0]  # 4 fetched into the GPU, 4 onboarded from host
            remote = s["remote"]
            assert (remote["prefetches"], remote["batches"], remote["blocks_landed"]) == (1, 2, FULL)
            assert s["hit_tokens"]["remote"] == FULL * 4 and s["bytes_fetched_remote"] == FULL * BLOCK
            assert s["remote_misses"] == 0
            assert r.block_digests("p", FULL) == want and r.d.mismatched_tokens == 0  # the holders' bytes
            r.d.release("p")
            world.Ibarrier().Wait()
        else:
            r.serve_until(world.Ibarrier())
        r.cache.check_consistency()


@pytest.mark.parametrize("rule_on", [True, False], ids=["R2", "R2-off"])
@pytest.mark.parametrize("transport", ["auto", "messages"])
def test_r2_holder_overwrote_the_slots_after_lookup(world, transport, rule_on):
    """The fetcher's directory is frozen (its messages delayed) while the holder reuses
    the prompt's host slots for other blocks: the fetch finds other blocks there. The
    stamps (checked by the fetcher on shared memory, by the holder for messages) make
    them misses; without the check the other blocks' bytes land as the prompt's."""
    with _open(world, ALL if rule_on else ALL - {"R2"}, transport=transport) as r:
        r.hold_prompt() if r.replica == HOLDER else None
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
            r.remote.channel.hold(True)  # later directory messages: not yet here
        world.Barrier()
        if r.replica == HOLDER:
            r.overwrite()
        world.Barrier()
        if r.replica == FETCHER:
            reused = r.step({"p": PROMPT})
            s = r.cache.stats()
            if rule_on:
                assert reused == {"p": 0} and r.d.mismatched_tokens == 0
                assert s["remote_misses"] == FULL and s["remote"]["blocks_landed"] == 0
                given_up = s["remote"]["given_up_here"]
                assert given_up["stale"] == FULL, given_up
            else:
                assert reused == {"p": FULL * 4} and r.d.mismatched_tokens > 0
            world.Ibarrier().Wait()
        else:
            r.serve_until(world.Ibarrier())


@pytest.mark.parametrize("rule_on", [True, False], ids=["R2", "R2-off"])
def test_r2_holder_overwrote_the_slot_while_it_was_copied(world, rule_on):
    """Shared memory, simulated streams: the fetcher checked the stamps and queued the
    copy on its "remote" stream, held; the holder then reuses the slots; the copy runs
    after. The second stamp reading catches it; without it the wrong bytes land."""
    if DEVICE != "cpu":
        pytest.skip("simulated streams are a CPU cache's")
    with _open(world, ALL if rule_on else ALL - {"R2"}, simulate=True, timeout_ms=60_000, near=False) as r:
        executor = r.seams.executor
        r.hold_prompt() if r.replica == HOLDER else None
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
            executor.hold("remote")
            r.step(prefetch={"p": PROMPT})
            assert not r.cache.prefetch_ready("p")
        world.Barrier()
        if r.replica == HOLDER:
            r.overwrite()
        world.Barrier()
        if r.replica == FETCHER:
            executor.release("remote")
            r.step()  # the copies run, are checked, and the replica agrees
            assert r.cache.prefetch_ready("p")
            reused = r.step({"p": PROMPT})
            s = r.cache.stats()
            if rule_on:
                assert reused == {"p": 0} and r.d.mismatched_tokens == 0
                assert s["remote_misses"] == FULL and s["remote"]["given_up_here"]["stale"] == FULL
            else:
                assert reused == {"p": FULL * 4} and r.d.mismatched_tokens > 0
        world.Barrier()


@pytest.mark.parametrize("rule_on", [True, False], ids=["R1", "R1-off"])
def test_r1_one_tp_rank_fails_its_fetch(world, monkeypatch, rule_on):
    """Fault drill remote_fetch on the fetcher's last TP rank: with R1 no rank of the
    replica reuses the blocks; without the agreement the others do, and diverge."""
    T = tp_size(world.size)
    if T < 2:
        pytest.skip("needs TP ranks")
    monkeypatch.setenv("KVDIST_FAULTS", f"remote_fetch@{FETCHER * T + T - 1}")
    with _open(world, ALL if rule_on else ALL - {"R1"}) as r:
        r.hold_prompt() if r.replica == HOLDER else None
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
            reused = r.step({"p": PROMPT})["p"]
            everyone = r.tp.allgather(reused, "test: reused")
            if rule_on:
                assert everyone == [0] * T and r.cache.stats()["remote_misses"] == FULL
                r.cache.check_consistency()
            else:
                assert everyone == [FULL * 4] * (T - 1) + [0]
                with pytest.raises(kvdist.ConsistencyError):
                    r.cache.check_consistency()
            assert r.d.mismatched_tokens == 0
        world.Barrier()


@pytest.mark.parametrize("every,ride", [(1, True), (8, True), (8, False)],
                         ids=["every-step", "every-8-steps", "every-8-steps-at-begin_step"])
@pytest.mark.parametrize("rule_on", [True, False], ids=["R4", "R4-off"])
def test_r4_directory_messages_reach_tp_ranks_at_different_times(world, rule_on, every, ride):
    """The fetcher's last TP rank gets the holder's directory messages steps later than
    the others. With R4 the replica applies only what all have: its ranks' directories
    (and so their decisions) stay equal at every step; without it they differ. Also
    with messages every 8 steps (the default), the agreement riding on the step's own
    MIN-reduce at end_step (the default) or made at begin_step."""
    T = tp_size(world.size)
    if T < 2:
        pytest.skip("needs TP ranks")
    with _open(world, ALL if rule_on else ALL - {"R4"}, every=every, policy=ride) as r:
        if r.replica == FETCHER and r.cache.tp_rank == T - 1:
            r.remote.channel.hold(True)
        world.Barrier()
        if r.replica == HOLDER:
            r.hold_prompt()
            while r.remote.steps % every:  # idle steps up to the one that sends the message
                r.step()
        world.Barrier()
        if r.replica == FETCHER:
            time.sleep(0.05)  # the messages are here, on every rank
            diverged = 0
            for _ in range(3):
                r.step()
                try:
                    r.cache.check_consistency()
                except kvdist.ConsistencyError:
                    diverged += 1
            assert diverged == (0 if rule_on else 3)
            if rule_on:
                assert len(r.remote.directory) == 0  # nobody applied what one lacks
                if r.cache.tp_rank == T - 1:
                    r.remote.channel.hold(False)
                r.wait_for_directory()
                assert r.step({"p": PROMPT}) == {"p": FULL * 4} and r.d.mismatched_tokens == 0
                r.cache.check_consistency()
            world.Ibarrier().Wait()
        else:
            r.serve_until(world.Ibarrier())


@pytest.mark.parametrize("transport", ["auto", "messages"])
def test_r3_a_stopped_replica_never_stalls_another(world, transport):
    """The holder replica's processes are stopped (SIGSTOP) while the fetcher runs
    steps that look its blocks up. Shared memory needs nothing from the holder: the
    blocks land. Messages: every fetch is a miss after fetch_timeout_ms, and each step
    takes about that long, not longer; a fetch that never gives up fails the test
    within seconds (and the harness ends the job) instead of hanging the suite."""
    timeout_ms = 300
    with _open(world, transport=transport, timeout_ms=timeout_ms) as r:
        pids = world.allgather(os.getpid())
        T = r.cache.tp_size
        holders = pids[HOLDER * T:(HOLDER + 1) * T]
        r.hold_prompt() if r.replica == HOLDER else None
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
        world.Barrier()
        if r.replica == FETCHER:
            if r.cache.tp_rank == 0:
                for pid in holders:
                    os.kill(pid, signal.SIGSTOP)
            r.tp.barrier("test: holder stopped")
            try:
                times, reused = [], {}
                # A fetch that never gave up would hang here: the test fails instead.
                with within(timeout_ms / 1000 + 10.0, "steps fetching from a stopped holder"):
                    for k in range(3):  # the prompt, then steps that need nothing remote
                        t0 = time.monotonic()
                        reused.update(r.step({"p": PROMPT} if k == 0 else {f"q{k}": [k] * 9}))
                        times.append(time.monotonic() - t0)
                s = r.cache.stats()
                if transport == "auto":
                    assert reused["p"] == FULL * 4 and s["remote"]["blocks_landed"] == FULL
                else:
                    assert reused["p"] == 0 and s["remote_misses"] == FULL
                    assert s["remote"]["given_up_here"]["timed_out"] == FULL
                    assert times[0] >= timeout_ms / 1000
                assert max(times) < timeout_ms / 1000 + 5.0, times  # bounded: no hang
                assert r.d.mismatched_tokens == 0
            finally:
                r.tp.barrier("test: fetcher done")
                if r.cache.tp_rank == 0:
                    for pid in holders:
                        os.kill(pid, signal.SIGCONT)
        world.Barrier()
        r.cache.check_consistency()


def test_shm_too_small_falls_back_to_messages_with_one_warning(world, monkeypatch):
    """The holder's ranks cannot put their host tier in shared memory: they keep it
    private, the fetcher reaches them by messages, rank 0 warns once."""
    if world.rank < tp_size(world.size):  # the holder replica's ranks
        monkeypatch.setenv("KVDIST_SHM_DIR", "/nonexistent/kvdist-shm")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = _open(world)
    with r:
        mine = [str(w.message) for w in caught if "remote" in str(w.message) or "shm" in str(w.message)]
        if world.rank == 0:
            assert len(mine) == 1 and "/dev/shm could not hold the host tier" in mine[0], mine
        else:
            assert mine == []
        kinds = r.cache.stats()["remote"]["transports"]
        if r.replica == FETCHER:
            assert kinds == {"messages": 1, **({"shared": r.cache.num_replicas - 2}
                                               if r.cache.num_replicas > 2 else {})}


def test_directory_message_of_an_earlier_cache_is_dropped(world):
    """Two channels on one communicator, as when MPI gives a new cache the context of a
    closed one whose last message was never received: the new channel drops the old
    one's message (another job token) and counts and applies only its own peer's."""
    import numpy as np
    from mpi4py import MPI

    from kvdist.distributed.directory import encode
    from kvdist.distributed.directory_channel import DirectoryChannel

    pair = world.Split(0 if world.rank < 2 else MPI.UNDEFINED, world.rank)
    if pair == MPI.COMM_NULL:
        return
    me, peer = pair.rank, 1 - pair.rank
    old, new = DirectoryChannel(pair, me, 2, token=11), DirectoryChannel(pair, me, 2, token=22)
    try:
        one = lambda slot, h: encode(np.array([slot]), np.array([1]), np.array([h], dtype=np.uint64),  # noqa: E731
                                     np.array([h], dtype=np.uint64))
        old.send(one(3, 1000 + me))  # the earlier cache's, never received by it
        new.send(one(5, 2000 + me))
        for _ in range(2000):
            new.poll()
            if new.counts()[peer] == 1:
                break
            time.sleep(0.001)
        assert new.counts().tolist() == [1 if p == peer else 0 for p in range(2)]
        (records,) = new.take(peer, 1)
        assert records.tolist() == one(5, 2000 + peer).tolist() and new.stale_dropped == 1
    finally:
        old.close()
        new.close()
        pair.Free()


def test_directory_message_of_an_earlier_cache_with_more_replicas_is_dropped(world):
    """An earlier cache of three replicas on the same communicator left a message from
    replica 2 to replica 0; the new cache has two replicas: the message's sender is no
    peer of it, and the new channel drops it instead of failing, counting only its
    peer's message."""
    import numpy as np
    from mpi4py import MPI

    from kvdist.distributed.directory import encode
    from kvdist.distributed.directory_channel import DirectoryChannel

    if world.size < 3:
        pytest.skip("needs three ranks")
    trio = world.Split(0 if world.rank < 3 else MPI.UNDEFINED, world.rank)
    if trio == MPI.COMM_NULL:
        return
    me = trio.rank
    one = lambda slot: encode(np.array([slot]), np.array([1]), np.array([7], dtype=np.uint64),  # noqa: E731
                              np.array([8], dtype=np.uint64))
    old = DirectoryChannel(trio, me, 3, token=11, peers=(0,) if me == 2 else ())
    new = DirectoryChannel(trio, me, 2, token=22) if me < 2 else None
    try:
        old.send(one(3))  # replica 2's, never received by the earlier cache
        trio.Barrier()
        if new is not None:
            new.send(one(5))
            for _ in range(2000):
                new.poll()
                if new.counts()[1 - me] == 1 and (me == 1 or new.stale_dropped == 1):
                    break
                time.sleep(0.001)
            assert new.counts().tolist() == [1 if p == 1 - me else 0 for p in range(2)]
            assert new.stale_dropped == (1 if me == 0 else 0)
            (records,) = new.take(1 - me, 1)
            assert records.tolist() == one(5).tolist()
        trio.Barrier()
    finally:
        old.close()
        if new is not None:
            new.close()
        trio.Free()


def test_a_given_up_blocks_slot_is_freed_once_every_tp_rank_is_done(world, monkeypatch):
    """The fetcher's last TP rank fails its fetch at once (fault drill: given up, its
    landing slots DONE) while its first TP rank's copies wait on a held simulated
    stream. The replica gives the blocks up, but frees their landing slots only once
    the held copies ran, on every TP rank at the same boundary: a rank freeing on its
    own DONE would reuse slots another rank's copy still writes, and diverge."""
    T = tp_size(world.size)
    if T < 2 or DEVICE != "cpu":
        pytest.skip("needs TP ranks and simulated streams")
    monkeypatch.setenv("KVDIST_FAULTS", f"remote_fetch@{FETCHER * T + T - 1}")
    with _open(world, simulate=True, timeout_ms=60_000, near=False) as r:
        r.hold_prompt() if r.replica == HOLDER else None
        world.Barrier()
        if r.replica == FETCHER:
            r.wait_for_directory()
            held = r.cache.tp_rank == 0
            if held:
                r.seams.executor.hold("remote")
            r.step(prefetch={"p": PROMPT})
            s = r.cache.stats()
            assert s["remote_misses"] == FULL and s["remote"]["blocks_landed"] == 0
            landing = r.remote.slots.landing_slots()
            assert len(landing) == FULL, "a landing slot freed while a copy may still write it"
            r.cache.check_consistency()
            if held:
                r.seams.executor.release("remote")
            r.step()  # the held copies run; every rank has the blocks DONE
            assert len(r.remote.slots.landing_slots()) == 0
            r.cache.check_consistency()
        world.Barrier()


def test_end_step_returns_the_figures_the_tp_group_agreed(world):
    """``end_step`` carries a caller's per-step figures (the recompute policy's) on its
    agreement: every TP rank gets the group's MIN, never its own figures."""
    T = tp_size(world.size)
    if T < 2:
        pytest.skip("needs TP ranks")
    with _open(world) as r:  # directory messages every step: end_step agrees at each
        t = r.cache.tp_rank
        agreed = r.remote.end_step([100 + t, 50 - t])
        assert agreed == [100, 50 - (T - 1)]
        r.step()
        world.Barrier()


def test_a_rank_that_cannot_build_its_part_turns_the_remote_tier_off_on_every_rank(world, monkeypatch):
    """Start-up commits the remote tier on every rank or on none
    (``remote_setup.commit_or_undo``): rank 1's build fails, every rank comes up without
    it, rank 0 alone warns naming rank 1's reason, and no rank leaves a file of its host
    tier or stamps in /dev/shm."""
    import kvdist.distributed.remote_setup as setup

    real = setup._build

    def build(comm, *args):
        if world.rank == 1:
            raise OSError("no room for the landing area")
        return real(comm, *args)

    monkeypatch.setattr(setup, "_build", build)
    before = set(os.listdir("/dev/shm"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        cache = kvdist.create(config(world=world.size))
    try:
        said = [str(w.message) for w in seen if issubclass(w.category, setup.RemoteTierWarning)]
        assert "remote" not in cache.tiers and "host" in cache.tiers
        if world.rank == 0:
            assert said == [f"kvdist: the remote tier is off on all {world.size} ranks: "
                            "rank 1: OSError: no room for the landing area"], said
        else:
            assert said == []
        world.Barrier()
        left = {n for n in set(os.listdir("/dev/shm")) - before if n.startswith("kvdist-")}
        assert left == set(), left
    finally:
        cache.close()

