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

Both sockets bind (kvdist publishes; routers connect). ``submit`` only queues a step's
records with their time; a background thread numbers the batches in that order,
builds the events, encodes, sends and serves replays, off the step's path. A batch
the thread reaches with ``_MAX_QUEUE`` others queued behind it (the thread has fallen
that far behind) is dropped and counted: the thread still builds it (the builder
follows every block through every record) but never sends it, and its number stays
unused: subscribers see the gap.

The thread is not woken per batch: it wakes every ``period_s`` (or at ``close``),
publishes every batch queued by then, ``_CHUNK`` batches at a time with the
interpreter let go in between, answers the replay requests waiting, and sleeps again.
A wake per batch made the step thread hand the interpreter over at every step boundary
(a lock, a futex wake and two switches of the GIL each time): with a thread that did
nothing at all, that alone cost a step that never lets go of the interpreter 5% of its
CPU on the dev box (``bench events``, "docs/design.md", "KV cache events"). A batch
therefore waits at most ``period_s`` plus the work queued before it."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq

from ..errors import ConfigError
from .recorder import Record
from .wire import KVCacheEvent, KVEventBatch, encoder

__all__ = ["END_SEQ", "EventPublisher", "offset_endpoint"]

log = logging.getLogger("kvdist.events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)
_MAX_QUEUE = 100_000  # batches waiting for the thread
_HWM = 100_000  # PUB high-water mark (vLLM's)
PERIOD_S = 0.02  # the thread publishes what is queued, and answers replays, this often
_CHUNK = 32  # batches published between two chances for other threads to take the interpreter


def offset_endpoint(endpoint: str, replica: int, key: str) -> str:
    """``endpoint`` for ``replica``: a TCP port moved up by the replica index (port 0,
    any free port, stays), an ipc/inproc name suffixed ``_dp<replica>`` (vLLM's rule)."""
    if replica == 0:
        return endpoint
    if not endpoint.startswith("tcp://"):
        return f"{endpoint}_dp{replica}"
    host, _, port = endpoint.rpartition(":")
    if int(port) == 0:
        return endpoint
    if int(port) + replica > 65535:
        raise ConfigError(key, endpoint, f"replica {replica} would publish on port {int(port) + replica}, "
                                         "past 65535: give a lower port")
    return f"{host}:{int(port) + replica}"


def _bind(sock: zmq.Socket, endpoint: str, key: str) -> str:
    """Bind ``sock``; the endpoint bound (a TCP port 0 resolved)."""
    if endpoint.startswith("tcp://["):
        sock.setsockopt(zmq.IPV6, 1)
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as e:
        raise ConfigError(key, endpoint, f"cannot bind it: {e.strerror}") from None
    return sock.getsockopt_string(zmq.LAST_ENDPOINT)


class EventPublisher:
    """PUB and replay sockets of one replica, and the thread that feeds them (module
    docstring). ``close`` sends what is queued (at most ``linger_s``) and frees both."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, buffer_steps: int,
                 data_parallel_rank: int, build: Callable[[list[Record]], list[KVCacheEvent]],
                 linger_s: float = 1.0, period_s: float = PERIOD_S):
        self.data_parallel_rank = data_parallel_rank
        self._build = build  # a step's records -> its events, on the thread (every batch, in order)
        self._topic = topic.encode()
        self._linger_s = linger_s
        self._period_s = period_s
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, _HWM)
            self.endpoint = _bind(self._pub, endpoint, "cache.events.endpoint")
            self.replay_endpoint = None
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.SNDHWM, 2 * (buffer_steps + 1))  # a whole replay fits
                self.replay_endpoint = _bind(self._replay, replay_endpoint, "cache.events.replay_endpoint")
        except BaseException:
            self._free_sockets()
            raise
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        # Batches waiting for the thread: appended by the step's thread, taken by the
        # publisher's (a deque's append and popleft are atomic: no lock, no wake).
        self._queue: deque[tuple[float, list[Record]]] = deque()
        self._stop = threading.Event()  # close: wake the thread now, publish what is queued, end
        self.submitted = 0  # batches queued (to be numbered 0 .. submitted-1)
        self.published = 0  # batches sent (the thread's count)
        self.dropped = 0  # batches reached with _MAX_QUEUE queued behind: built, never sent
        self._handled = 0  # batches the thread is done with (sent or not): the next one's number
        self.replays = 0  # replay requests answered
        self.thread_seconds = 0.0  # CPU time the thread spent publishing (building, encoding, sending)
        self._thread = threading.Thread(target=self._run, name="kvdist-events", daemon=True)
        self._thread.start()

    def submit(self, records: list[Record]) -> None:
        """Queue one step's records as the next batch (never blocks; the least the
        step's thread can do: the thread numbers it)."""
        self.submitted += 1
        self._queue.append((time.time(), records))

    def close(self) -> None:
        """Send what is queued, stop the thread, free the sockets (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(self._linger_s)
        alive, self._thread = self._thread.is_alive(), None
        if alive:  # its sockets stay with it (a socket is one thread's at a time)
            log.warning("kvdist events: %d batch(es) not sent by close", len(self._queue))
            return
        self._free_sockets()

    def _free_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=int(self._linger_s * 1000))
        # zmq_ctx_term waits for the sockets' pending messages; once (in a CI run) it did
        # not return at all: bounded here, so that closing a cache never hangs.
        term = threading.Thread(target=self._ctx.term, name="kvdist-events-term", daemon=True)
        term.start()
        term.join(self._linger_s + 2.0)
        if term.is_alive():
            log.warning("kvdist events: the ZMQ context did not terminate within %.0f s; left to the "
                        "process's exit", self._linger_s + 2.0)

    # -- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        """Every ``period_s``: publish what is queued, then answer the replay requests
        waiting (a replay holds every batch submitted before its request came); at
        ``close``, publish what is left and end."""
        pack = encoder()
        replay, pending, stop = self._replay, self._queue, self._stop
        while True:
            stopping = stop.wait(self._period_s)
            n = 0
            while pending:
                ts, records = pending.popleft()
                self._publish(pack, self._handled, ts, records, len(pending) < _MAX_QUEUE)
                n += 1
                if n % _CHUNK == 0:
                    time.sleep(0)  # the interpreter to the step's thread, if it waits
            while replay is not None and replay.poll(0):
                self._serve_replay(replay)
            if stopping:
                return

    def _publish(self, pack, seq: int, ts: float, records: list[Record], send: bool) -> None:
        t0 = time.thread_time()
        try:
            events = self._build(records)  # every batch: the builder follows the blocks
            if not send:
                self.dropped += 1
                return
            payload = pack.encode(KVEventBatch(ts=ts, events=events,
                                               data_parallel_rank=self.data_parallel_rank))
            self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload), copy=False)
            self._buffer.append((seq, payload))
            self.published += 1
        except Exception:  # the stream shows the gap; the thread carries on
            log.exception("kvdist events: batch %d not published", seq)
        finally:
            self._handled += 1
            self.thread_seconds += time.thread_time() - t0

    def _serve_replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
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
