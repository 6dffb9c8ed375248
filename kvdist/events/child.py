"""``python -m kvdist.events.child``: the publisher's process (``kvdist.events.process``
starts it, with the interpreter of the cache's process; never by fork).

Its standard input is the control pipe: the first line is its settings (JSON); then
nothing comes but the end of file, when the parent closes it or dies. It answers one
line (JSON) on standard output once its sockets are bound: their endpoints, or the
ConfigError that binding raised. Then, every ``period_s`` while steps come (every
``idle_s`` after a look at the log that found nothing) and whenever a replay
request or the end of file comes, it reads what the cache published in the shared
block log (``kvdist.events.shared_log``: each step's records as
``kvdist.events.recorder`` hands them over), publishes each step as the next batch
(``kvdist.events.server``), answers replays — a replay therefore holds every batch
published before its request came — and writes its figures in the log's header.
At the end of file it publishes what is left, lets the sockets send (``linger_s``)
and exits.

It dies with its parent: the end of file of the control pipe (the kernel closes the
parent's end however the parent ends), and on Linux ``PR_SET_PDEATHSIG`` (SIGKILL when
the thread that started it ends: asked for only when that is the main thread). Ctrl-C
at a terminal reaches the whole process group: this process ignores SIGINT and ends by
the pipe, after its parent."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by main once the settings are read
    from .recorder import Steps
    from .server import EventServer

__all__ = ["FIGURES", "main", "serve_once"]

# Header words of the log (from shared_log.FIGURES_AT on) this process keeps current, in order.
FIGURES = ("published", "replays", "failed", "cpu_ns", "alive")  # cpu_ns: since its sockets were bound
_PR_SET_PDEATHSIG = 1


def _die_with_parent(parent: int) -> None:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    except (OSError, AttributeError):  # not Linux: the pipe alone
        return
    if os.getppid() != parent:  # the parent died before the call above
        raise SystemExit(0)


def main() -> int:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    settings = json.loads(sys.stdin.buffer.readline() or b"null")
    if settings is None:
        return 0  # the parent went before saying anything
    if settings["die_with_parent"]:
        _die_with_parent(settings["parent_pid"])

    import zmq

    from ..blocks import SlotSpace
    from ..errors import ConfigError
    from .batcher import EventBuilder
    from .recorder import Steps
    from .server import EventServer
    from .shared_log import FIGURES_AT, LogReader

    log = LogReader(settings["log_fd"], settings["log_bytes"])
    os.close(settings["log_fd"])
    if settings["build"] == "events":
        build = EventBuilder(SlotSpace(tuple(settings["capacity"])), settings["block_size"],
                             bytes.fromhex(settings["salt"])).events
    else:  # bench events: empty batches ("empty"), or nothing read but the log's bytes ("none")
        def build(step):
            return []
    out = sys.stdout
    try:
        server = EventServer(settings["endpoint"], settings["replay_endpoint"], settings["topic"],
                             settings["buffer_steps"], settings["data_parallel_rank"], build,
                             linger_s=settings["linger_s"])
    except ConfigError as e:
        out.write(json.dumps({"error": [e.key, e.value, e.problem]}) + "\n")
        out.flush()
        log.close()
        return 2
    out.write(json.dumps({"endpoint": server.endpoint, "replay_endpoint": server.replay_endpoint}) + "\n")
    out.flush()

    steps, words, first = Steps(settings["block_size"]), log.words, FIGURES_AT
    poller = zmq.Poller()
    poller.register(0, zmq.POLLIN)
    if server.replay is not None:
        poller.register(server.replay, zmq.POLLIN)
    period_ms = max(1, int(settings["period_s"] * 1000))
    idle_ms = max(period_ms, int(settings["idle_s"] * 1000))
    wait_ms = period_ms
    ending = False
    words[first + FIGURES.index("alive")] = 1
    cpu0 = time.process_time_ns()  # the figure: CPU spent publishing, not starting
    publish = settings["build"] != "none"
    while not ending:
        ready = dict(poller.poll(wait_ms))
        if ready.get(0):
            ending = os.read(0, 4096) == b""  # nothing else ever comes
        data = serve_once(server, log.read, steps, publish)
        wait_ms = period_ms if data else idle_ms
        for i, v in enumerate((server.published, server.replays, server.failed,
                               time.process_time_ns() - cpu0, 1)):
            words[first + i] = v
    words[first + FIGURES.index("alive")] = 0
    server.close()
    log.close()
    return 0


def serve_once(server: EventServer, read: Callable[[], bytes], steps: Steps, publish: bool) -> bytes:
    """One look at the log: take the replay requests waiting, ``read`` what the cache
    published since the last look (returned), publish its whole steps (unless
    ``publish`` is off: ``bench events``' "none"), then answer the requests taken, so
    that each holds every step published before it came (``EventServer.take_replays``)."""
    asked = server.take_replays()
    data = read()
    if publish:
        for step in steps.feed(data):
            server.publish(step)
    server.answer(asked)
    return data


if __name__ == "__main__":
    sys.exit(main())
