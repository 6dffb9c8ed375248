"""The ZMQ side of the events, as vLLM's ``ZmqEventPublisher`` (v0.33.0) speaks it:

* a PUB socket sends each batch as three frames ``(topic, seq, payload)``: ``seq`` an
  8-byte big-endian sequence number (0, 1, 2, ... with no gap), ``payload`` the msgpack
  :class:`~kvdist.events.wire.KVEventBatch`;
* a ROUTER socket (``replay_endpoint``) answers a request ``(seq,)`` — 8 bytes big-endian,
  behind an empty delimiter frame (a DEALER sends ``[b"", seq]``; a REQ socket adds the
  delimiter but takes only the first of the replies) — with every batch
  still kept from ``seq`` on, ``(topic, seq, payload)`` each, then ``(b"", -1, b"")``;
  a request of any other shape gets nothing;
* the last ``buffer_steps`` batches are kept for replay (a bounded buffer).

Both sockets bind (kvdist publishes; routers connect). :class:`EventServer` owns them,
numbers the batches in the order it is given them, builds each one's events, encodes,
sends and keeps it. It runs wherever the publisher puts it — the publisher's own
process (``kvdist.events.child``), or a thread of the cache's (``kvdist.events.publisher``);
one thread at a time uses it."""

from __future__ import annotations

import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from ..errors import ConfigError
from .recorder import StepRecords, step_time
from .wire import KVCacheEvent, KVEventBatch, encoder

__all__ = ["END_SEQ", "EventServer", "bind"]

log = logging.getLogger("kvdist.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_HWM = 100_000  # PUB high-water mark (vLLM's)


def bind(sock: zmq.Socket, endpoint: str, key: str) -> str:
    """Bind ``sock``; the endpoint bound (a TCP port 0 resolved). One that cannot be
    bound is a ConfigError naming ``key``."""
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise ConfigError(key, endpoint, f"cannot bind it: {e.strerror}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class EventServer:
    """PUB and replay sockets of one replica (module docstring). ``build``: a step's
    records -> its events (every batch, in order: the builder follows the blocks)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, buffer_steps: int,
                 data_parallel_rank: int, build: Callable[[StepRecords], list[KVCacheEvent]],
                 linger_s: float = 1.0):
        self.data_parallel_rank = data_parallel_rank
        self._build = build
        self._topic = topic.encode()
        self._linger_s = linger_s
        self._pack = encoder()
        self._bound: list[str] = []  # the endpoints bound so far
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self.replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, _HWM)
            self.endpoint = bind(self._pub, endpoint, "cache.events.endpoint")
            self._bound.append(self.endpoint)
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self.replay = self._ctx.socket(zmq.ROUTER)
                self.replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay fits
                self.replay_endpoint = bind(self.replay, replay_endpoint, "cache.events.replay_endpoint")
                self._bound.append(self.replay_endpoint)
        except BaseException:
            self.close()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.next_seq = 0  # the next batch's number
        self.published = 0  # batches sent
        self.failed = 0  # batches that could not be built (numbers left unused)
        self.replays = 0  # replay requests answered
        self.seconds = 0.0  # CPU time spent building, encoding and sending (this thread's)

    def publish(self, step: StepRecords) -> None:
        """Build, number, send and keep the next batch. One that fails to build or
        encode is logged and not sent: its number stays unused, so subscribers see the
        gap (and cannot replay it: a router should start that replica over)."""
        t0 = time.thread_time()
        seq = self.next_seq
        self.next_seq += 1
        try:
            payload = self._pack.encode(KVEventBatch(ts=step_time(step), events=self._build(step),
                                                     data_parallel_rank=self.data_parallel_rank))
        except Exception:
            self.failed += 1
            log.exception("kvdist events: batch %d not published", seq)
        else:
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            self._buffer.append((seq, payload))
            self.published += 1
        self.seconds += time.thread_time() - t0

    def take_replays(self) -> list[list[bytes]]:
        """The replay requests waiting now, for :meth:`answer` once the steps handed
        over before they came are published: take them, then take in the steps, then
        answer, and a replay holds every step handed over before its request came
        (answered the other way round, a step handed over and a request sent while
        the steps are taken in would be missed)."""
        requests = []
        replay = self.replay
        while replay is not None and replay.poll(0):
            requests.append(replay.recv_multipart())
        return requests

    def answer(self, requests: list[list[bytes]]) -> None:
        """Answer :meth:`take_replays`' requests: each gets what is kept from its number on."""
        for frames in requests:
            self._serve_replay(frames)

    def _serve_replay(self, frames: list[bytes]) -> None:
        replay = self.replay
        assert replay is not None, "a replay request without a replay socket"
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            log.warning("kvdist events: ignored a replay request of %d frame(s) that is not "
                        "(identity, b'', 8-byte seq)", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
        self.replays += 1

    def close(self) -> None:
        """Free both sockets, their pending messages sent for at most ``linger_s``."""
        for sock in (self._pub, self.replay):
            if sock is not None:
                sock.close(linger=int(self._linger_s * 1000))
        # zmq_ctx_term waits for the sockets' pending messages; once (in a CI run) it did
        # not return at all: bounded here, so that closing never hangs.
        term = threading.Thread(target=self._ctx.term, name="kvdist-events-term", daemon=True)
        term.start()
        term.join(self._linger_s + 2.0)
        if term.is_alive():
            log.warning("kvdist events: the ZMQ context did not terminate within %.0f s; left to the "
                        "process's exit", self._linger_s + 2.0)
        for endpoint in self._bound:
            if endpoint.startswith("ipc://") and not endpoint.startswith("ipc://@"):
                try:  # ZMQ leaves an ipc socket's file behind
                    os.unlink(endpoint[len("ipc://"):])
                except FileNotFoundError:
                    pass
