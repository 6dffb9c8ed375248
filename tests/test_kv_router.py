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
        # 6 prompt blocks: replica 0 computes 2, replica 1 computes 4; nothing is running,
        # so either would hold the request's 6 blocks.
        assert chat.blocks_needed(TPB) == 6
        assert policy.costs(chat) == [(2.0 + 6, 4), (4.0 + 6, 2)]
        assert policy.choose(chat) == 0
        policy.check_invariants()
        other = _req(1, shared + [9, 9, 9, 9, 5])  # replica 1's prefix (3 blocks) beats 0's (2)
        # 4 blocks: 3 full prompt blocks, the first 2 of them running on replica 0 already.
        assert policy.costs(other) == [(2.0 + 6 + 2, 2), (1.0 + 4, 3)]
        assert policy.choose(other) == 1
        policy.check_invariants()
        assert policy.active == [6, 4]
        assert policy.stats() == {"overlap_blocks": 4 + 3, "routed_away": 0, "away_blocks": 0}
        policy.finished(0)
        policy.check_invariants()
        assert policy.active == [0, 4]
    finally:
        index.close()


class _Held:
    """A prefix index that says what it is told."""

    def __init__(self, held: list[int]):
        self.held = held

    def longest_prefix(self, replica: int, hashes) -> int:
        return min(self.held[replica], len(hashes))


def _chained(req: Request) -> list[int]:
    """Block hashes that name a block and every block before it (as prefix hashes do)."""
    return [hash(tuple(req.prompt[: (i + 1) * TPB].tolist())) for i in range(len(req.prompt) // TPB)]


def _loaded(weight: float, loads: list[int]) -> tuple[KvAware, _Held]:
    """A policy over two replicas where replica k runs one request of ``loads[k]``
    blocks (routed there because only that replica held its prefix)."""
    index = _Held([0, 0])
    policy = KvAware(2, index, _chained, TPB, overlap_weight=weight)
    for k, n in enumerate(loads):
        index.held = [n if j == k else 0 for j in range(2)]
        assert policy.choose(_req(100 + k, [1000 + k] * ((n - 1) * TPB))) == k
    assert policy.active == loads
    return policy, index


def test_load_outweighs_a_short_prefix_unless_the_overlap_weighs_more():
    req = _req(0, list(range(40)))  # 10 blocks
    assert req.blocks_needed(TPB) == 11  # added to either replica's active blocks
    policy, index = _loaded(1.0, [20, 10])
    index.held = [3, 0]
    assert policy.costs(req) == [(7.0 + 20 + 11, 3), (10.0 + 10 + 11, 0)]
    assert policy.choose(req) == 1  # 3 cached blocks do not pay for 10 more active ones
    policy.check_invariants()
    assert policy.stats() == {"overlap_blocks": 19 + 9, "routed_away": 1, "away_blocks": 3}
    heavy, index = _loaded(4.0, [20, 10])
    index.held = [3, 0]
    assert heavy.costs(req) == [(28.0 + 20 + 11, 3), (40.0 + 10 + 11, 0)]
    assert heavy.choose(req) == 0
    assert heavy.stats() == {"overlap_blocks": 19 + 9 + 3, "routed_away": 0, "away_blocks": 0}
    even, index = _loaded(1.0, [5, 5])
    index.held = [0, 0]
    assert even.choose(req) == 0  # ties: the lower load, then the lower index
    assert even.choose(_req(1, list(range(100, 140)))) == 1


def test_prompt_blocks_that_running_requests_share_count_once_in_the_load():
    system = [7] * 32  # 8 blocks every request below but one starts with
    policy = KvAware(2, _Held([0, 0]), _chained, TPB, overlap_weight=1.0)
    a = _req(0, system + [1] * 4)  # 9 full blocks, 10 held (the reply's last block)
    assert policy.choose(a) == 0
    policy.check_invariants()
    b = _req(1, [2] * 20)  # 5 full blocks, 6 held
    assert policy.choose(b) == 1
    policy.check_invariants()
    assert policy.active == [10, 6]
    # c shares a's 8 system blocks: on replica 0 it adds its 9th block and its own 1,
    # on replica 1 all 10. Counting a's blocks again would make replica 0 the busier.
    c = _req(2, system + [3] * 4)
    assert policy.costs(c) == [(9.0 + 10 + 2, 0), (9.0 + 6 + 10, 0)]
    assert policy.choose(c) == 0
    policy.check_invariants()
    assert policy.active == [8 + 1 + 1 + 1 + 1, 6]  # 8 shared, a's and c's 9th, a's and c's own
    policy.finished(0)
    policy.check_invariants()
    assert policy.active == [10, 6]  # c's alone
    policy.finished(2)
    policy.finished(1)
    policy.check_invariants()
    assert policy.active == [0, 0]


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
