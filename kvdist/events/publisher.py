"""The events' publisher on a thread of the cache's own process: the way kvdist
published before ``kvdist.events.process``, kept so that ``bench events`` sets the two
side by side (``KVEvents(..., publisher="thread")``; the cache always uses the process).

``end_step`` only takes a step's records back from the recorder and queues them; the thread wakes every
``period_s`` (or at ``close``), hands every queued step to an
:class:`~kvdist.events.server.EventServer` (build, encode, number, send) ``_CHUNK`` at a
time with the interpreter let go in between, answers the replay requests waiting, and
sleeps again. It shares the interpreter with the step thread: ``bench events`` shows
what that costs the step."""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable

from .recorder import BlockRecorder, StepRecords
from .server import EventServer
from .wire import KVCacheEvent

__all__ = ["PERIOD_S", "ThreadPublisher"]

log = logging.getLogger("kvdist.events")

PERIOD_S = 0.02  # the thread publishes what is queued, and answers replays, this often
_CHUNK = 32  # batches published between two chances for other threads to take the interpreter


class ThreadPublisher:
    """PUB and replay sockets of one replica, fed by a thread (module docstring).
    ``close`` publishes what is queued (at most ``linger_s``) and frees both."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, buffer_steps: int,
                 data_parallel_rank: int, build: Callable[[StepRecords], list[KVCacheEvent]],
                 linger_s: float = 1.0, period_s: float = PERIOD_S):
        self._server = EventServer(endpoint, replay_endpoint, topic, buffer_steps, data_parallel_rank, build,
                                   linger_s)
        self.endpoint, self.replay_endpoint = self._server.endpoint, self._server.replay_endpoint
        self._linger_s, self._period_s = linger_s, period_s
        # Steps waiting for the thread: appended by the step's thread, taken by the
        # publisher's (a deque's append and popleft are atomic: no lock, no wake).
        self._queue: deque[StepRecords] = deque()
        self._stop = threading.Event()  # close: wake the thread now, publish what is queued, end
        self.submitted = 0
        self.recorder = BlockRecorder()  # private: its records taken back each step
        self._thread: threading.Thread | None = threading.Thread(target=self._run, name="kvdist-events",
                                                                 daemon=True)
        self._thread.start()

    def end_step(self) -> None:
        """Queue the step's records, if any, as the next batch (never blocks)."""
        step = self.recorder.take()
        if step is not None:
            self.submit(step)

    def submit(self, step: StepRecords) -> None:
        """Queue one step's records (an array of its own) as the next batch."""
        self.submitted += 1
        self._queue.append(step)

    def stats(self) -> dict:
        s = self._server
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "submitted": self.submitted, "published": s.published, "dropped": s.failed,
                "replays": s.replays,
                "publisher_seconds": s.seconds, "publisher": "thread", "pid": None}

    def close(self) -> None:
        """Publish what is queued, stop the thread, free the sockets (idempotent)."""
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join(self._linger_s + 10.0)
        alive, self._thread = self._thread.is_alive(), None
        if alive:  # its sockets stay with it (a socket is one thread's at a time)
            log.warning("kvdist events: %d batch(es) not sent by close", len(self._queue))
            return
        self._server.close()

    def _run(self) -> None:
        server, pending, stop = self._server, self._queue, self._stop
        while True:
            stopping = stop.wait(self._period_s)
            asked = server.take_replays()  # before the steps: a replay holds every step queued before it
            n = 0
            while pending:
                server.publish(pending.popleft())
                n += 1
                if n % _CHUNK == 0:
                    time.sleep(0)  # the interpreter to the step's thread, if it waits
            server.answer(asked)
            if stopping:
                return
