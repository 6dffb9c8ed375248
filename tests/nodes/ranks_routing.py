"""The prefix-aware router across the two-node bed's veth pair: run under MPI by
``test_two_nodes_routing.py`` (``kvdist-launch --module pytest``), 2 nodes x 2 ranks =
2 replicas x TP 2, replica 0 (ranks 0-1, with the router on rank 0) on node a and
replica 1 (ranks 2-3) on node b; not collected on its own.

Every replica publishes its KV events on ``tcp://*:0`` (PUB and replay: every interface
of its node, ports the system picks), the explicit setting that routing across nodes
needs; the endpoints are exchanged as a run of replicas exchanges them
(:func:`kvdist.sim.experiment.route_net.exchange`, one allgather over the job).
Node b's replica is reached from node a only across the veth pair: its endpoints name
node b's host, which node a resolves to node b's end of the pair."""

from __future__ import annotations

import re
import time
from pathlib import Path

import pytest

import kvdist
from kvdist.events.wire import encoder
from kvdist.sim.engine.parallel import TensorParallel
from kvdist.sim.experiment.kv_events_index import kv_aware
from kvdist.sim.experiment.route_feed import Inbox, Router, router_endpoint
from kvdist.sim.experiment.route_net import bind_host, exchange
from kvdist.testing import Seams, create
from tests.conftest import make_cfg
from tests.nodes.ranks_two_nodes import HOSTS, SCRATCH, hosts, node_of, veth_bytes, world  # noqa: F401 (fixtures)
from tests.test_events import TPB, Chains, cache_content, churn
from tests.test_kv_router import _req, _serve

pytestmark = pytest.mark.mpi

ROOT = Path(__file__).resolve().parents[2]
ANY = "tcp://*:0"
BLOCK = 2 * 2 * TPB * 2 * 8 * 2  # layers x K/V x tokens x heads x dims x fp16


def routing_cfg(**events) -> kvdist.CacheConfig:
    """2 replicas x TP 2 with GPU, host and disk tiers (the disk on each node's scratch),
    events on every interface of each node."""
    return kvdist.load_config(make_cfg(
        cache={"gpu": {"blocks": 24}, "host": {"bytes": 16 * BLOCK},
               "disk": {"path": SCRATCH, "bytes": 24 * BLOCK}, "recompute_when_faster": False,
               "events": {"enabled": True, "endpoint": ANY, "replay_endpoint": ANY, "topic": "kv", **events}},
        distributed={"tp_size": 2, "consensus_timeout_s": 30},
        workload={"router_overlap_weight": 1.0}))


def _until(what: str, done, step, seconds: float = 20.0) -> None:
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f"{what} within {seconds:g} s"
        step()
        time.sleep(0.01)


def test_the_far_replicas_events_cross_the_veth_and_rebuild_its_tiers(world, hosts):  # noqa: F811
    """Both replicas churn blocks through GPU, host and disk; the router's index on rank 0
    (node a) receives every batch of both, node b's across the veth (its endpoints name
    node b's host; node b's end of the pair carried at least their encoded bytes), with
    no gap, nothing lost or undecodable, and rebuilds exactly what each tier of each
    replica holds."""
    tp = TensorParallel(world)
    cfg = routing_cfg()
    seams = Seams()
    cache = create(cfg, seams, world)
    inbox = policy = index = None
    try:
        inbox = Inbox(1, bind_host(cfg)) if cache.tp_rank == 0 else None
        _, pubs = exchange(tp, cfg, inbox.endpoint if inbox else None, cache.stats()["events"])
        for k, (pub, replay) in enumerate(pubs):
            for ep in (pub, replay):
                assert re.fullmatch(rf"tcp://{re.escape(hosts[k])}:\d+", ep), pubs
        if world.rank == 0:
            policy, index = kv_aware(cfg, 2, pubs)
        world.Barrier()
        before = veth_bytes()
        chains = Chains(cache.layout.hash_salt())
        churn(cache, chains, 60, seed=cache.replica)  # TP ranks of a replica: the same steps
        st = cache.stats()
        moved = st["blocks_moved"]
        assert min(moved["offload"], moved["demote"], moved["onboard"], st["dropped"]) > 0, moved
        submitted = tp.allgather(st["events"].get("submitted", 0) if cache.tp_rank == 0 else 0)
        held = tp.allgather(cache_content(seams) if cache.tp_rank == 0 else None)
        held = [h for h in held if h is not None]
        wire: list[int] = []
        if world.rank == 0:
            batches = [[], []]
            feed = index.subs

            def take() -> None:
                for k, sub in enumerate(feed):
                    batches[k] += sub.poll(0)
            _until("every batch of both replicas arrived", lambda: [len(b) for b in batches] == [
                submitted[0], submitted[2]], take)
            for k in (0, 1):
                assert [s for s, _ in batches[k]] == list(range(submitted[2 * k])), f"replica {k}: a gap"
                assert all(b.data_parallel_rank == k for _, b in batches[k])
                for _, b in batches[k]:
                    index.blocks.apply(b, k)
                assert index.blocks.replicas[k].media == held[k], f"replica {k} rebuilt wrong"
                assert all(held[k].values()), f"replica {k}: every tier holds blocks: {held[k]}"
            assert [(s.lost, s.undecodable) for s in feed] == [(0, 0), (0, 0)]
            pack = encoder()
            wire = [sum(len(pack.encode(b)) for _, b in batches[1])]
        wire = tp.bcast(wire)
        crossed = veth_bytes() - before
        if HOSTS and node_of(world.rank) == 1:  # node b's end of the pair carried replica 1's stream
            assert crossed >= wire[0] > 10_000, (crossed, wire)
    finally:
        for end in (index, inbox):
            if end is not None:
                end.close()
        cache.close()
        world.Barrier()


def test_a_request_goes_to_the_far_replica_holding_its_prefix(world, hosts):  # noqa: F811
    """Replica 1 (node b) holds 5 blocks of a chat, replica 0 (node a) 2 of them and a
    block of another prompt. The router on node a, fed by both replicas' events, sends
    the chat's next turn to replica 1 (costs exactly as Dynamo's: prefill blocks + active
    blocks) and the other prompt's to replica 0, through the replicas' inboxes: node b's
    across the veth. The turn after it is held until replica 1 reports the first one
    finished (back across the veth), then goes to replica 1 too."""
    tp = TensorParallel(world)
    cfg = routing_cfg()
    cache = kvdist.create(cfg, world)
    shared = list(range(100, 108))  # 2 blocks both replicas hold
    chat = shared + list(range(12))  # 5 blocks, replica 1's
    other = shared + [9] * TPB  # 3 blocks, replica 0's
    reqs = [_req(0, chat + [7] * TPB + [1]), _req(1, other + [5] * TPB + [1]),  # 6 and 4 full blocks
            _req(2, chat + [7] * TPB + [3] * TPB + [1], after=0)]  # the chat's turn after request 0
    host = bind_host(cfg)
    inbox = router = index = None
    try:
        _serve(cache, "s", other if cache.replica == 0 else chat)
        inbox = Inbox(len(reqs), host) if cache.tp_rank == 0 else None
        boxes, pubs = exchange(tp, cfg, inbox.endpoint if inbox else None, cache.stats()["events"])
        assert [re.fullmatch(r"tcp://([^:]+):\d+", b).group(1) for b in boxes] == hosts, boxes
        if world.rank == 0:
            policy, index = kv_aware(cfg, 2, pubs)
            keys = [policy.hashes(r) for r in reqs]
            _until("both replicas' blocks in the index", lambda: [index.longest_prefix(k, keys[0])
                                                                  for k in (0, 1)] == [2, 5], index.poll)
            assert [index.longest_prefix(k, keys[1]) for k in (0, 1)] == [3, 2]
            # 7 prompt blocks less the prefix to compute; nothing runs, so on either replica
            # the request adds its 7 blocks (the reply's last token included) to the load.
            assert reqs[0].blocks_needed(TPB) == 7
            assert policy.costs(reqs[0]) == [(5.0 + 7, 2), (2.0 + 7, 5)]
            router = Router(reqs, policy, boxes, index, host=host)
        at = router_endpoint(tp, router)
        assert re.fullmatch(rf"tcp://{re.escape(hosts[0])}:\d+", at), at
        got: list[tuple[int, float]] = []
        if inbox is not None:
            inbox.connect(at)
        world.Barrier()
        if router is not None:
            router.start(time.perf_counter())
        if inbox is not None:
            def serve() -> None:  # each request finishes as soon as it arrives
                new = inbox.take()
                got.extend(new)
                inbox.finished([rid for rid, _ in new])
            _until("every request routed", lambda: inbox.closed, serve)
        routed = tp.allgather(got if inbox is not None else None)
        assert [None if r is None else [rid for rid, _ in r] for r in routed] == [[1], None, [0, 2], None]
        assert routed[0][0][1] == routed[2][0][1] == 0.0 < routed[2][1][1], routed  # arrivals
        if router is not None:
            router.close()
            assert router.routes == [1, 0, 1] and (router.bad_frames, inbox.bad_frames) == (0, 0)
            assert router.stats() == {"held_turns": 1, "overlap_blocks": 5 + 3 + 5, "routed_away": 0,
                                     "away_blocks": 0}
    finally:
        for end in (router, inbox):
            if end is not None:
                end.close()
        cache.close()
        world.Barrier()


def _compare(events: dict, out: str, configs: tuple[str, ...]) -> dict:
    """``run --compare`` of 2 replicas x TP 2 (one per node), small, with ``events``."""
    from kvdist.sim.experiment.options import RunOptions
    from kvdist.sim.experiment.replica_compare import run_replica_compare
    from tests.mpi.test_sim_replicas import replicas_cfg

    cfg = replicas_cfg(4, requests=40, request_rate=50.0, think_steps=2, step_ms=5)
    cfg = cfg.replace(cache={"events": events})
    return run_replica_compare(cfg, RunOptions(out=out, progress=False, configs=configs))


def test_prefix_aware_replicas_on_two_nodes(world, tmp_path):  # noqa: F811
    """``run --compare`` of prefix-aware replicas, one per node, events on every interface:
    the router on node a routes every request of the trace to both replicas by their
    events (its choices held cached prefixes), every replica serves what it was sent,
    no block is wrong, the same results on every rank."""
    r = _compare({"enabled": True, "endpoint": ANY, "replay_endpoint": ANY}, str(tmp_path / "runs"),
                 ("prefix-aware",))
    one = r["runs"]["prefix-aware"]
    assert r["ok"] and (r["replicas"], r["tp_size"], r["requests_in_trace"]) == (2, 2, 40), one["ok"]
    assert one["latency"]["requests"] == one["requests"] == sum(one["routed"]) == 40
    assert min(one["routed"]) > 0 and one["router"]["overlap_blocks"] > 0, (one["routed"], one["router"])
    for row in one["replicas"]:
        assert row["tp_identical"] and row["requests"] == row["requests_routed"], row
    assert r["integrity_mismatches"] == 0 and r["integrity"]["consistency_error"] is None
    assert world.allgather(r["runs"]["prefix-aware"]["routed"]) == [one["routed"]] * 4


def test_replicas_on_two_nodes_over_loopback_are_refused(world, hosts, tmp_path):  # noqa: F811
    """Without an endpoint other nodes reach (events off, so loopback), every rank stops
    the run at the exchange with one line naming the key and node b's replica."""
    with pytest.raises(kvdist.ConfigError) as err:
        _compare({"enabled": False}, str(tmp_path / "runs"), ("prefix-aware",))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("config key 'cache.events.endpoint': a replica on "
                                              f"{hosts[1]} is reachable on its own node only"), msg
    assert f"the router runs on {hosts[0]}" in msg and "tcp://*:PORT" in msg, msg
