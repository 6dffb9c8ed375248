"""Requests routed at arrival, in wall-clock time: a router thread on rank 0 and, on
every replica's TP rank 0, an inbox; the replica's ranks agree what arrived through
their clock (:class:`RoutedTime`).

- :class:`Router` (rank 0, one thread): requests arrive at ``Request.arrival_s``
  seconds after the job's common start; each is decided by the :class:`~kvdist.sim.
  experiment.kv_router.Policy` then, sent ``(request id, arrival)`` to the chosen
  replica's inbox (ZMQ PUSH/PULL). A chat's next turn is held until
  its previous turn was reported finished and the user has thought ``think_s`` (a
  user sends it after reading the reply): its arrival is then
  ``max(arrival_s, finish + think_s)``. Before every decision the router
  takes in the replicas' KV events (``events``, a :class:`EventFeed`). When every
  request was routed (or the router failed: rank 0 then raises its error at the
  run's end), every inbox gets ``closed``.
- :class:`Inbox` (each replica's TP rank 0): takes what was routed there, reports
  finished requests back to the router (their load leaves the router's count).
- :class:`RoutedTime`: the replica's real-time clock (:class:`~kvdist.sim.experiment.
  clock.RealTime`, started at a barrier of the whole job). Before every step TP rank 0
  takes its inbox, and one broadcast in the TP group — the one that agrees the
  clock's reading — carries the routed requests and ``closed``: every rank of a
  replica adds the same requests to its scheduler at the same step, whatever the
  timing of the messages.

The sockets bind on :func:`~kvdist.sim.experiment.route_net.bind_host`'s host
(loopback unless ``cache.events.endpoint`` says otherwise) on ports the system picks;
their endpoints are exchanged over the job's communicator
(:func:`~kvdist.sim.experiment.route_net.exchange`). The messages are fixed binary
frames, never pickles (a socket bound for the network takes them from whoever
connects): routed requests are ``n`` little-endian int64 request ids then their ``n``
float64 arrivals, finished ones ``n`` int64 ids; a frame of another size, or an id
that names no request routed, is dropped and counted (``bad_frames``)."""

from __future__ import annotations

import heapq
import threading
import time
from collections import deque
from dataclasses import replace
from typing import Protocol

import numpy as np
import torch

from ..engine.parallel import TensorParallel
from ..engine.request import Request
from ..engine.scheduler import Scheduler
from .clock import RealTime
from .kv_router import Policy
from .route_net import LOOPBACK, connectable

__all__ = ["EventFeed", "Inbox", "RoutedTime", "Router", "decode_ids", "decode_routed", "encode_routed",
           "router_endpoint"]

_CLOSED = -1  # a routed "request id" that says every request was routed
_POLL_S = 0.005  # an idle leader waits at most this long for its inbox at a time


def _zmq():
    import zmq  # the `events` extra

    return zmq


def _bind_any_port(sock, host: str) -> str:
    """Bind ``sock`` on ``host`` at a port the system picks; the endpoint others connect
    to (:func:`~kvdist.sim.experiment.route_net.connectable`)."""
    zmq = _zmq()
    if host.startswith("["):
        sock.setsockopt(zmq.IPV6, 1)
    sock.bind(f"tcp://{host}:0")
    return connectable(sock.getsockopt_string(zmq.LAST_ENDPOINT))


def encode_routed(items: list[tuple[int, float]]) -> bytes:
    """``(request id, arrival)`` pairs as a frame: the ids (int64), then the arrivals (float64)."""
    rids = np.fromiter((rid for rid, _ in items), dtype="<i8", count=len(items))
    arrivals = np.fromiter((at for _, at in items), dtype="<f8", count=len(items))
    return rids.tobytes() + arrivals.tobytes()


def decode_routed(frame: bytes) -> list[tuple[int, float]] | None:
    """:func:`encode_routed`'s pairs, or None for a frame that is not one."""
    if len(frame) % 16:
        return None
    n = len(frame) // 16
    rids = np.frombuffer(frame, dtype="<i8", count=n)
    arrivals = np.frombuffer(frame, dtype="<f8", count=n, offset=8 * n)
    return list(zip(rids.tolist(), arrivals.tolist()))


def decode_ids(frame: bytes) -> list[int] | None:
    """Finished request ids (int64 each), or None for a frame that is not a whole number of them."""
    return None if len(frame) % 8 else np.frombuffer(frame, dtype="<i8").tolist()


class EventFeed(Protocol):
    """The replicas' KV events as the router takes them in."""

    def sockets(self) -> list:
        """ZMQ sockets whose readiness means events to take (the router polls them)."""
        ...

    def poll(self) -> None:
        """Apply every event received so far to the router's prefix index."""
        ...

    def close(self) -> None: ...


class Inbox:
    """A replica leader's end: PULL for what is routed here (bound on ``host``), PUSH
    of finishes. ``requests``: how many requests the trace has (ids 0 .. n-1)."""

    def __init__(self, requests: int, host: str = LOOPBACK):
        zmq = _zmq()
        self.requests = requests
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        try:
            self.endpoint: str = _bind_any_port(self._pull, host)
        except BaseException:
            self._pull.close(linger=0)
            self._ctx.term()
            raise
        self._push = None
        self.closed = False
        self.bad_frames = 0  # frames dropped: not routed pairs, or ids of no request

    def connect(self, router_endpoint: str) -> None:
        zmq = _zmq()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.setsockopt(zmq.LINGER, 1000)
        self._push.connect(router_endpoint)

    def take(self) -> list[tuple[int, float]]:
        """``(request id, arrival)`` routed here since the last call."""
        zmq = _zmq()
        out: list[tuple[int, float]] = []
        while True:
            try:
                msg = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return out
            items = decode_routed(msg)
            if items is None or not all(rid == _CLOSED or 0 <= rid < self.requests for rid, _ in items):
                self.bad_frames += 1
                continue
            for rid, arrival in items:
                if rid == _CLOSED:
                    self.closed = True
                else:
                    out.append((rid, arrival))

    def wait(self, seconds: float) -> None:
        """Return when something was routed here, or after ``seconds``."""
        self._pull.poll(max(1, int(seconds * 1e3)))

    def finished(self, rids: list[int]) -> None:
        if rids:
            self._push.send(np.asarray(rids, dtype="<i8").tobytes())

    def close(self) -> None:
        if self._ctx.closed:
            return
        for s in (self._pull, self._push):
            if s is not None:
                s.close(linger=0)  # nothing left to deliver: term must not wait
        self._ctx.term()


class Router:
    """Rank 0's router thread (module docstring). ``inboxes[k]``: replica k's endpoint;
    ``host``: where the router's own socket (finishes, from the replicas) binds."""

    def __init__(self, requests: list[Request], policy: Policy, inboxes: list[str],
                 events: EventFeed | None = None, think_s: float = 0.0, host: str = LOOPBACK):
        zmq = _zmq()
        self.requests, self.policy, self.events, self.think_s = requests, policy, events, think_s
        self._ctx = zmq.Context()
        self._done = self._ctx.socket(zmq.PULL)
        self._done.setsockopt(zmq.LINGER, 0)
        try:
            self.endpoint: str = _bind_any_port(self._done, host)
        except BaseException:
            self._done.close(linger=0)
            self._ctx.term()
            raise
        self._out = []
        for ep in inboxes:
            s = self._ctx.socket(zmq.PUSH)
            s.setsockopt(zmq.LINGER, 1000)
            s.connect(ep)
            self._out.append(s)
        self.routes = [-1] * len(requests)  # replica of every request id (ids are 0..n-1)
        self.held_turns = 0  # follow-ups held until their previous turn finished
        self.bad_frames = 0  # finish frames dropped: not ids, or ids not routed and unfinished
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.origin = 0.0

    def start(self, origin: float) -> None:
        """Route from now on; ``origin``: ``time.perf_counter()`` at the job's start."""
        self.origin = origin
        self._thread = threading.Thread(target=self._run, args=(origin,), name="kvdist-router", daemon=True)
        self._thread.start()

    def _route(self, req: Request, arrival: float, batch: dict[int, list]) -> None:
        k = self.policy.choose(req)
        assert 0 <= k < len(self._out), f"policy chose replica {k} of {len(self._out)}"
        self.routes[req.rid] = k
        batch.setdefault(k, []).append((req.rid, arrival))

    def _run(self, origin: float) -> None:
        try:
            self._loop(origin)
        except BaseException as e:  # reported by close(), on the main thread
            self.error = e
        finally:  # every replica's run ends, even when the router failed
            for s in self._out:
                s.send(encode_routed([(_CLOSED, 0.0)]))

    def _loop(self, origin: float) -> None:
        zmq = _zmq()
        poller = zmq.Poller()
        poller.register(self._done, zmq.POLLIN)
        for s in self.events.sockets() if self.events is not None else []:
            poller.register(s, zmq.POLLIN)
        pending = deque(sorted(self.requests, key=lambda r: r.arrival_s))
        finished: set[int] = set()
        held: dict[int, list[Request]] = {}  # previous turn's id -> the turn waiting for it
        thinking: list[tuple[float, int, Request]] = []  # (arrival, id, turn): its user reads the reply
        while (pending or held or thinking) and not self._stop.is_set():
            now = time.perf_counter() - origin
            if self.events is not None:
                self.events.poll()
            batch: dict[int, list] = {}
            while True:  # finishes first: they release load and held turns
                try:
                    rids = decode_ids(self._done.recv(zmq.NOBLOCK))
                except zmq.Again:
                    break
                if rids is None or len(set(rids)) < len(rids) or not all(
                        0 <= rid < len(self.routes) and self.routes[rid] >= 0 and rid not in finished
                        for rid in rids):
                    self.bad_frames += 1
                    continue
                for rid in rids:
                    finished.add(rid)
                    self.policy.finished(rid)
                    for req in held.pop(rid, []):
                        heapq.heappush(thinking, (max(req.arrival_s, now + self.think_s), req.rid, req))
            while pending and pending[0].arrival_s <= now:
                req = pending.popleft()
                if req.after >= 0 and req.after not in finished:
                    held.setdefault(req.after, []).append(req)
                    self.held_turns += 1
                else:
                    self._route(req, req.arrival_s, batch)
            while thinking and thinking[0][0] <= now:
                at, _, req = heapq.heappop(thinking)
                self._route(req, at, batch)
            for k, items in batch.items():
                self._out[k].send(encode_routed(items))
            due = ([pending[0].arrival_s] if pending else []) + ([thinking[0][0]] if thinking else [])
            nxt = min(due, default=now + 0.05)
            wait = nxt - (time.perf_counter() - origin)
            if wait > 0:
                poller.poll(max(1, int(1e3 * min(wait, 0.05))))


    def stats(self) -> dict[str, int]:
        """``held_turns`` and the policy's figures."""
        return {"held_turns": self.held_turns, **self.policy.stats()}

    def close(self) -> None:
        """Stop the thread (if it still runs) and free the sockets; raises what the
        thread raised."""
        if self._thread is None and self._ctx.closed:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None
        if not self._ctx.closed:
            for s in (self._done, *self._out):
                s.close(linger=0)  # nothing left to deliver: term must not wait
            self._ctx.term()
            if self.events is not None:
                self.events.close()
        error, self.error = self.error, None
        if error is not None:
            raise error


def router_endpoint(world: TensorParallel, router: Router | None) -> str:
    """The router's endpoint, from rank 0 (collective over the job)."""
    return world.bcast(router.endpoint if router is not None else None, "the router's endpoint")


class RoutedTime(RealTime):
    """A replica's real time, with the requests routed to it (module docstring).
    ``inbox`` on TP rank 0 only; ``requests``: the trace by request id."""

    def __init__(self, device: torch.device, tp: TensorParallel, world: TensorParallel, inbox: Inbox | None,
                 requests: list[Request], router: Router | None = None):
        super().__init__(device, tp)
        self.world, self.inbox, self.requests, self.router = world, inbox, requests, router
        self.origin = 0.0
        self._sched: Scheduler | None = None
        self._closed = False

    def start(self) -> None:
        """The job's common start: a barrier of every replica, then the router runs."""
        self.sync()
        self.world.barrier("the timed run's start")
        super().start()
        self.origin = self._origin
        if self.router is not None:
            self.router.start(self._origin)

    def before_step(self, sched: Scheduler) -> float | None:
        routed = self.inbox.take() if self.inbox is not None else []
        closed = self.inbox is not None and self.inbox.closed
        t = self.local()
        if self.tp.size > 1:
            t, routed, closed = self.tp.bcast((t, routed, closed), "the routed requests")
        if routed:
            sched.add([replace(self.requests[rid], arrival_s=at) for rid, at in routed])
        self._sched, self._closed = sched, closed
        if closed and sched.finished < sched.total:
            sched.close()  # it still has work: done once that finishes
        return t

    def sleep_until(self, t: float | None) -> None:
        """The step found nothing to run: once every request was routed, the
        scheduler is closed now (done: the run ends; closing it earlier would end it
        between its clock and its plan); else wait for the next arrival, or for the
        router, a few milliseconds at a time (the next step takes in what came)."""
        if self._closed:
            self._sched.close()
            return
        wait = _POLL_S if t is None else min(_POLL_S, t - self.local())
        if wait <= 0:
            return
        if self.inbox is not None:
            self.inbox.wait(wait)
        else:
            time.sleep(wait)
