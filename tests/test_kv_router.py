"""The prefix-aware router (kvdist.sim.experiment.kv_router, kv_events_index, route_feed):
fed by the KV events real caches publish, it sends a request to the replica holding
its longest prefix; Dynamo's cost trades that against load; routing at arrival holds
a chat's next turn for its previous one and tells every inbox when all were routed."""

import time

import numpy as np
import pytest

import kvdist
from kvdist.sim.engine.request import Request
from kvdist.sim.engine.scheduler import Scheduler
from kvdist.sim.experiment.kv_events_index import kv_aware
from kvdist.sim.experiment.kv_router import KvAware, RoundRobin
from kvdist.sim.experiment.route_feed import Inbox, Router
from kvdist.sim.experiment.workload import Trace
from tests.conftest import make_cfg

pytest.importorskip("zmq")

TPB = 4
ANY = "tcp://127.0.0.1:0"


def _cfg(weight: float = 1.0):
    return kvdist.load_config(make_cfg(
        cache={"gpu": {"blocks": 64}, "events": {"enabled": True, "endpoint": ANY, "replay_endpoint": ANY}},
        workload={"router_overlap_weight": weight}))


def _req(rid: int, prompt: list[int], output: int = 2, after: int = -1, at: float = 0.0) -> Request:
    return Request(rid, 0, 0, 0, np.asarray(prompt, dtype=np.int32), np.arange(output, dtype=np.int32), after,
                   arrival_s=at)


def _serve(cache, seq: str, tokens: list[int]) -> None:
    """One step that fills ``tokens``' blocks (published at its end_step)."""
    cache.begin_step()
    cache.add_sequence(seq, tokens)
    cache.block_table([seq])
    cache.end_step()
    cache.release(seq)


def _wait_for(index, replica: int, hashes, blocks: int) -> None:
    deadline = time.monotonic() + 10
    while index.longest_prefix(replica, hashes) < blocks:
        assert time.monotonic() < deadline, f"replica {replica}'s events never showed {blocks} blocks"
        index.poll()
        time.sleep(0.01)


@pytest.fixture
def two_replicas():
    cfg = _cfg()
    caches = [kvdist.create(cfg), kvdist.create(cfg)]
    try:
        yield cfg, caches
    finally:
        for c in caches:
            c.close()


def test_a_request_goes_to_the_replica_holding_its_longest_prefix(two_replicas):
    cfg, (a, b) = two_replicas
    shared = list(range(100, 108))  # two blocks both replicas hold
    _serve(a, "a", shared + list(range(8)))  # replica 0: 4 blocks of the chat
    _serve(b, "b", shared + [9, 9, 9, 9])  # replica 1: 3 blocks, only 2 of them the chat's
    eps = [(c.stats()["events"]["endpoint"], c.stats()["events"]["replay_endpoint"]) for c in (a, b)]
    policy, index = kv_aware(cfg, 2, eps)
    try:
        chat = _req(0, shared + list(range(8)) + [7, 7, 7, 7, 1])  # the chat's next turn: 5 full blocks
        keys = policy.hashes(chat)
        _wait_for(index, 0, keys, 4)
        _wait_for(index, 1, keys, 2)
        assert [index.longest_prefix(k, keys) for k in (0, 1)] == [4, 2]
        # 6 prompt blocks: replica 0 computes 2, replica 1 computes 4; nothing is running.
        assert policy.costs(chat) == [(2.0, 4), (4.0, 2)]
        assert policy.choose(chat) == 0
        other = _req(1, shared + [9, 9, 9, 9, 5])  # replica 1's prefix (3 blocks) beats 0's (2)
        assert policy.costs(other) == [(2.0 + chat.blocks_needed(TPB), 2), (1.0, 3)]
        assert policy.choose(other) == 1
        assert policy.active == [chat.blocks_needed(TPB), other.blocks_needed(TPB)]
        assert policy.stats() == {"overlap_blocks": 4 + 3, "routed_away": 0, "away_blocks": 0}
        policy.finished(0)
        assert policy.active == [0, other.blocks_needed(TPB)]
    finally:
        index.close()


class _Held:
    """A prefix index that says what it is told."""

    def __init__(self, held: list[int]):
        self.held = held

    def longest_prefix(self, replica: int, hashes) -> int:
        return min(self.held[replica], len(hashes))


def test_load_outweighs_a_short_prefix_unless_the_overlap_weighs_more():
    req = _req(0, list(range(40)))  # 10 blocks
    hashes = lambda r: list(range(len(r.prompt) // TPB))  # noqa: E731
    policy = KvAware(2, _Held([3, 0]), hashes, TPB, overlap_weight=1.0)
    policy.active = [20, 10]
    assert policy.costs(req) == [(27.0, 3), (20.0, 0)]
    assert policy.choose(req) == 1  # 3 cached blocks do not pay for 10 more active ones
    assert policy.stats() == {"overlap_blocks": 0, "routed_away": 1, "away_blocks": 3}
    heavy = KvAware(2, _Held([3, 0]), hashes, TPB, overlap_weight=4.0)
    heavy.active = [20, 10]
    assert heavy.costs(req) == [(48.0, 3), (50.0, 0)]
    assert heavy.choose(req) == 0
    assert heavy.stats() == {"overlap_blocks": 3, "routed_away": 0, "away_blocks": 0}
    even = KvAware(2, _Held([0, 0]), hashes, TPB)
    even.active = [5, 5]
    assert even.choose(req) == 0 and even.choose(_req(1, list(range(40)))) == 1  # ties: lower load, index


def test_the_router_holds_a_turn_for_its_previous_one_and_closes_every_inbox():
    reqs = [_req(0, [1] * 8), _req(1, [2] * 8), _req(2, [1] * 12, after=0, at=0.0)]
    inboxes = [Inbox(len(reqs)), Inbox(len(reqs))]
    router = Router(reqs, RoundRobin(2), [i.endpoint for i in inboxes], think_s=0.05)
    try:
        for i in inboxes:
            i.connect(router.endpoint)
        router.start(time.perf_counter())
        got: list[list] = [[], []]
        deadline = time.monotonic() + 5
        while len(got[0]) + len(got[1]) < 2:
            assert time.monotonic() < deadline
            for k, i in enumerate(inboxes):
                got[k] += i.take()
        time.sleep(0.2)  # turn 2 waits for request 0 to finish, however long
        assert [rid for rid, _ in got[0] + inboxes[0].take()] == [0]
        assert [rid for rid, _ in got[1] + inboxes[1].take()] == [1]
        assert not any(i.closed for i in inboxes)
        finished_at = time.perf_counter() - router.origin
        inboxes[0].finished([0])
        third: list = []
        while not third:
            assert time.monotonic() < deadline
            third = inboxes[0].take()  # round-robin: the third request routed goes to replica 0
            inboxes[1].take()
        (rid, at), = third
        assert rid == 2 and at >= finished_at + 0.05  # arrives once the user has thought
        while not all(i.closed for i in inboxes):
            assert time.monotonic() < deadline
            for i in inboxes:
                assert i.take() == []
        assert router.routes == [0, 1, 0] and router.held_turns == 1
    finally:
        router.close()
        for i in inboxes:
            i.close()


def test_an_open_scheduler_takes_routed_requests_and_is_done_only_once_closed():
    sched = Scheduler(Trace([], []), max_batch=4, max_prefill_tokens=100, gpu_blocks=16, tokens_per_block=TPB,
                      open_ended=True)
    assert not sched.done() and sched.next_step(0.0) is None
    sched.add([_req(0, [1] * 5, output=1)])
    plan = sched.next_step(0.0)
    assert [r.req.rid for r in plan.prefills] == [0]
    assert [r.req.rid for r in sched.complete(plan)] == [0]
    assert sched.finished == sched.total == 1 and not sched.done()  # more may come
    sched.close()
    assert sched.done()
    with pytest.raises(kvdist.ConfigError, match="cache.gpu"):
        Scheduler(Trace([], []), max_batch=4, max_prefill_tokens=100, gpu_blocks=1, tokens_per_block=TPB,
                  open_ended=True).add([_req(1, [1] * 9)])


class _Broken(RoundRobin):
    def choose(self, req: Request) -> int:
        raise RuntimeError(f"no replica for request {req.rid}")


def test_a_failing_router_still_ends_every_replicas_run_and_names_its_error():
    inboxes = [Inbox(1), Inbox(1)]
    router = Router([_req(0, [1] * 8)], _Broken(2), [i.endpoint for i in inboxes])
    try:
        for i in inboxes:
            i.connect(router.endpoint)
        router.start(time.perf_counter())
        deadline = time.monotonic() + 5
        while not all(i.closed for i in inboxes):
            assert time.monotonic() < deadline, "a replica would wait for requests forever"
            for i in inboxes:
                assert i.take() == []
                i.wait(0.01)
        with pytest.raises(RuntimeError, match="no replica for request 0"):
            router.close()
    finally:
        router.close()
        for i in inboxes:
            i.close()
