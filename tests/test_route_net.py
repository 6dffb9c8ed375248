"""Where the routing of a job of replicas binds and what it tells other nodes
(kvdist.sim.experiment.route_net), and what its sockets accept (route_feed's frames):
loopback unless cache.events.endpoint says otherwise; a wildcard bind announced by the
host name; frames that are not routed ids are dropped and counted, never unpickled.
Across real nodes: tests/nodes/test_two_nodes_routing.py."""

import pickle
import socket
import time

import pytest

import kvdist
from kvdist.sim.engine.parallel import TensorParallel
from kvdist.sim.experiment.kv_router import RoundRobin
from kvdist.sim.experiment.route_feed import Inbox, Router, decode_ids, decode_routed, encode_routed
from kvdist.sim.experiment.route_net import bind_host, connectable, exchange, is_loopback
from tests.conftest import make_cfg
from tests.test_kv_router import _req

zmq = pytest.importorskip("zmq")


def _cfg(**events):
    return kvdist.load_config(make_cfg(cache={"gpu": {"blocks": 8}, "events": events}))


def test_the_routing_binds_loopback_unless_the_events_endpoint_says_otherwise():
    assert bind_host(_cfg()) == "127.0.0.1"  # events off
    assert bind_host(_cfg(enabled=True)) == "127.0.0.1"  # the default endpoint
    assert bind_host(_cfg(enabled=False, endpoint="tcp://*:5557")) == "127.0.0.1"  # not on: not bound
    assert bind_host(_cfg(enabled=True, endpoint="tcp://*:5557")) == "*"
    assert bind_host(_cfg(enabled=True, endpoint="tcp://eth1:0")) == "eth1"
    assert bind_host(_cfg(enabled=True, endpoint="tcp://[::]:0")) == "[::]"
    assert bind_host(_cfg(enabled=True, endpoint="ipc:///tmp/kv")) == "127.0.0.1"


def test_a_wildcard_bind_is_announced_by_the_host_name():
    host = socket.gethostname()
    assert connectable("tcp://0.0.0.0:43795") == f"tcp://{host}:43795"
    assert connectable("tcp://[::]:5557") == f"tcp://{host}:5557"
    for same in ("tcp://10.0.0.5:5557", "tcp://127.0.0.1:9", "ipc:///tmp/kv", "inproc://kv"):
        assert connectable(same) == same
    assert [is_loopback(e) for e in ("tcp://127.0.0.1:1", "tcp://localhost:1", "tcp://[::1]:1", "ipc:///x",
                                     "tcp://10.0.0.5:1", f"tcp://{host}:1")] == [True] * 4 + [False] * 2


def test_an_inbox_bound_on_every_interface_is_reached_by_its_announced_endpoint():
    inbox = Inbox(4, "*")
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    try:
        host, _, port = inbox.endpoint.removeprefix("tcp://").rpartition(":")
        assert host == socket.gethostname() and int(port) > 0, inbox.endpoint
        push.connect(inbox.endpoint)
        push.send(encode_routed([(3, 1.5), (0, 2.25)]))
        got: list = []
        deadline = time.monotonic() + 5
        while not got:
            assert time.monotonic() < deadline
            inbox.wait(0.05)
            got = inbox.take()
        assert got == [(3, 1.5), (0, 2.25)] and inbox.bad_frames == 0
    finally:
        push.close(linger=0)
        ctx.term()
        inbox.close()


def test_the_exchange_announces_wildcard_binds_and_refuses_a_name_that_does_not_resolve(monkeypatch):
    """One rank (the router's node holds every replica): the exchange returns the inbox
    and the events as another node would reach them; with a host name that does not
    resolve (ZMQ would retry connecting to it forever), one line naming it."""
    cfg = _cfg(enabled=True, endpoint="tcp://*:0", replay_endpoint="tcp://*:0")
    world = TensorParallel()
    for name in (socket.gethostname(), "kvdist-no-such-host.invalid"):
        monkeypatch.setattr(socket, "gethostname", lambda name=name: name)
        inbox = Inbox(1, bind_host(cfg))
        try:
            port = inbox.endpoint.rpartition(":")[2]
            assert inbox.endpoint == f"tcp://{name}:{port}"
            events = {"endpoint": "tcp://0.0.0.0:5557", "replay_endpoint": "tcp://0.0.0.0:5558"}
            if name.endswith(".invalid"):
                with pytest.raises(kvdist.ConfigError) as err:
                    exchange(world, cfg, inbox.endpoint, events)
                assert str(err.value) == (
                    f"config key 'cache.events.endpoint': rank 0 (on {name}) cannot resolve the host name "
                    f"'{name}', announced for a wildcard bind: make host names resolve between the nodes, "
                    "or bind one interface, tcp://INTERFACE:PORT (announced by its address) (got 'tcp://*:0')")
            else:
                assert exchange(world, cfg, inbox.endpoint, events) == (
                    [inbox.endpoint], [(f"tcp://{name}:5557", f"tcp://{name}:5558")])
        finally:
            inbox.close()
    world.free()


def test_frames_round_trip_and_anything_else_is_not_a_frame():
    items = [(0, 0.0), (7, 1.25), (-1, 0.0)]
    assert decode_routed(encode_routed(items)) == items
    assert decode_routed(encode_routed([])) == []
    assert decode_ids(bytes(range(16))) == [int.from_bytes(bytes(range(8)), "little"),
                                            int.from_bytes(bytes(range(8, 16)), "little")]
    assert decode_routed(b"x" * 17) is None and decode_ids(b"abc") is None


def _drain(inbox: Inbox, until) -> list:
    got: list = []
    deadline = time.monotonic() + 5
    while not until(got):
        assert time.monotonic() < deadline, (got, inbox.bad_frames)
        inbox.wait(0.01)
        got += inbox.take()
    return got


def test_garbage_on_the_routing_sockets_is_dropped_counted_and_breaks_nothing():
    """A pickle, a frame of the wrong size, ids of no request (to an inbox), or ids never
    routed, routed twice in one frame or already finished (to the router): each dropped
    and counted; the routing carries on and every inbox still closes."""
    reqs = [_req(0, [1] * 8), _req(1, [2] * 8, after=0)]
    inbox = Inbox(len(reqs))
    router = Router(reqs, RoundRobin(1), [inbox.endpoint])
    ctx = zmq.Context()
    stranger = [ctx.socket(zmq.PUSH), ctx.socket(zmq.PUSH)]
    try:
        inbox.connect(router.endpoint)
        stranger[0].connect(inbox.endpoint)
        stranger[1].connect(router.endpoint)
        garbage = (pickle.dumps([(0, 0.0)]), b"abc", encode_routed([(2, 0.0)]), encode_routed([(-2, 0.0)]))
        for frame in garbage:
            stranger[0].send(frame)
        _drain(inbox, lambda got: inbox.bad_frames == 4)
        router.start(time.perf_counter())
        assert _drain(inbox, lambda got: got) == [(0, 0.0)]
        for frame in (pickle.dumps([0]), b"abcde", encode_routed([]) + b"\0" * 8 + (1).to_bytes(8, "little"),
                      (0).to_bytes(8, "little") * 2):
            stranger[1].send(frame)  # the third: request 1, held, not routed yet; the fourth: 0 twice
        deadline = time.monotonic() + 5
        while router.bad_frames < 4:
            assert time.monotonic() < deadline, router.bad_frames
            time.sleep(0.01)
        assert router.routes == [0, -1] and router.held_turns == 1
        inbox.finished([0])
        got = _drain(inbox, lambda got: inbox.closed)
        assert [rid for rid, _ in got] == [1] and router.routes == [0, 0]
        stranger[1].send((0).to_bytes(8, "little"))  # finished already: the router's loop has ended
        router.close()
        assert (inbox.bad_frames, router.bad_frames) == (4, 4)
    finally:
        for s in stranger:
            s.close(linger=0)
        ctx.term()
        router.close()
        inbox.close()
