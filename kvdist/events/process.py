"""The events' publisher in a process of its own (``kvdist.events.child``), reading the
block log in shared memory (``kvdist.events.shared_log``): the manager's pool writes each
change there as it makes it, and the step thread's whole share of publishing is the
recorder's ``hand_over`` — a trailer and a store of the log's head: nothing copied, no
system call, no lock, no thread of this process woken, nothing built or encoded here.
The child builds the events, encodes them, numbers and sends the batches and serves
replays; its CPU is not this process's, and it never holds this process's interpreter.

The child is started with this process's interpreter (``subprocess``: fork and exec at
once; safe after MPI's start-up, unlike a bare fork) and dies with it (the child's
docstring). ``close`` ends the child after it has published everything written and
leaves no process, socket or file behind (the log has no name).

The log is bounded (``log_bytes``). A write that finds it full waits for the child;
when the child is gone, or has taken nothing for ``stall_s``, the stream ends there:
a warning, and the steps from then on are counted in ``dropped`` (subscribers stop
hearing the replica; nothing is numbered past the last step published whole)."""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Literal

from ..errors import ConfigError
from .child import FIGURES
from .recorder import BlockRecorder
from .shared_log import FIGURES_AT, HEAD, TAIL, make_log_fd

__all__ = ["IDLE_S", "PERIOD_S", "LOG_BYTES", "ProcessPublisher"]

log = logging.getLogger("kvdist.events")

LOG_BYTES = 16 << 20  # the log's data area (about 1.2 KiB a step on bench events' trace)
# The child looks at the log this often while steps come, and IDLE_S after a look that
# found none (at once, whatever the period, for a replay request or the end). On the dev
# box's two vCPUs any process's wake beside the step costs the step (bench events): a
# process sleeping 1 / 5 / 50 ms at a time cost it +10.5% / +2.9% / +0.8%. A router
# therefore hears a step at most PERIOD_S late (IDLE_S after a quiet spell).
PERIOD_S = 0.05
IDLE_S = 0.2
_START_S = 120.0  # the child's start-up (an interpreter and its imports, on a loaded node)
_PACKAGE_ROOT = str(Path(__file__).resolve().parents[2])  # the directory that holds kvdist


class ProcessPublisher:
    """PUB and replay sockets of one replica, served by a child process (module
    docstring). Binding errors raise here, as :class:`ConfigError` naming the key.
    ``build``: what the child does with the steps — publishes their events; publishes
    empty batches; or reads them and drops them (the last two for ``bench events``)."""

    def __init__(self, endpoint: str, replay_endpoint: str | None, topic: str, buffer_steps: int,
                 data_parallel_rank: int, capacity: tuple[int, int, int], block_size: int, salt: bytes,
                 build: Literal["events", "empty", "none"] = "events", linger_s: float = 1.0,
                 period_s: float = PERIOD_S, idle_s: float = IDLE_S, log_bytes: int = LOG_BYTES,
                 stall_s: float = 30.0):
        self.data_parallel_rank = data_parallel_rank
        self._linger_s, self._stall_s = linger_s, stall_s
        self._waited = 0.0  # when the step now waiting for room began to wait
        self._log_open = False  # the recorder's log is mapped (closed by _end)
        self._proc: subprocess.Popen | None = None
        self._final: dict[str, int] | None = None
        fd = make_log_fd(log_bytes)
        try:
            # The pool's block observer: its log is the shared memory the child reads.
            self.recorder = BlockRecorder(fd, log_bytes, self._wait)
            self._log_open = True
            self.end_step = self.recorder.hand_over  # the step thread's call: publish the step
            env = dict(os.environ)
            env["PYTHONPATH"] = os.pathsep.join(filter(None, (_PACKAGE_ROOT, env.get("PYTHONPATH"))))
            self._proc = subprocess.Popen([sys.executable, "-m", "kvdist.events.child"],
                                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, pass_fds=(fd,),
                                          env=env)
            settings = {"log_fd": fd, "log_bytes": log_bytes, "endpoint": endpoint,
                        "replay_endpoint": replay_endpoint, "topic": topic, "buffer_steps": buffer_steps,
                        "data_parallel_rank": data_parallel_rank, "capacity": list(capacity),
                        "block_size": block_size, "salt": salt.hex(), "build": build, "linger_s": linger_s,
                        "period_s": period_s, "idle_s": idle_s, "parent_pid": os.getpid(),
                        "die_with_parent": threading.current_thread() is threading.main_thread()}
            self._proc.stdin.write(json.dumps(settings).encode() + b"\n")
            self._proc.stdin.flush()
            reply = self._reply()
        except BaseException:
            self._end(kill=True)
            raise
        finally:
            os.close(fd)
        if "error" in reply:
            self._end(kill=False)
            key, value, problem = reply["error"]
            raise ConfigError(key, value, problem)
        self.endpoint: str = reply["endpoint"]
        self.replay_endpoint: str | None = reply["replay_endpoint"]

    @property
    def pid(self) -> int | None:
        """The child's process id (None once closed)."""
        return None if self._proc is None else self._proc.pid

    def _reply(self) -> dict:
        out = self._proc.stdout
        ready, _, _ = select.select([out], [], [], _START_S)
        line = out.readline() if ready else b""
        if not line:
            raise RuntimeError(f"kvdist events: the publisher process did not start (exit status "
                               f"{self._proc.poll()}; its error, if any, is above)")
        return json.loads(line)

    # -- the step thread ------------------------------------------------------------------------------
    @property
    def submitted(self) -> int:
        """Steps published whole (numbered 0 .. submitted-1 by the child)."""
        return self.recorder.steps

    @property
    def dropped(self) -> int:
        """Steps not published: the child was gone or stalled."""
        return self.recorder.dropped

    def _wait(self, first: bool) -> bool:
        """Waiting for the child to read the log (``first``: the first wait of this
        write): False to give up (the stream ends there)."""
        if first:
            self._waited = time.monotonic()
        gone = self._proc is None or self._proc.poll() is not None
        if gone or time.monotonic() - self._waited > self._stall_s:
            log.warning("kvdist events: the publisher process %s; no more events are published",
                        "has exited" if gone else f"took nothing for {self._stall_s:.0f} s")
            return False
        time.sleep(0.001)
        return True

    # -- figures and the end ----------------------------------------------------------------------------
    def figures(self) -> dict[str, int]:
        """The child's figures (``kvdist.events.child.FIGURES``) as it last wrote them,
        and the log's bytes it has not read yet (``unread``)."""
        if self._final is None:
            return self._read_figures()
        return dict(self._final)

    def stats(self) -> dict:
        f = self.figures()
        return {"endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint,
                "submitted": self.submitted, "published": f["published"],
                "dropped": self.dropped + f["failed"], "replays": f["replays"],
                "publisher_seconds": f["cpu_ns"] / 1e9, "publisher": "process", "pid": self.pid}

    def _read_figures(self) -> dict[str, int]:
        words = self.recorder.words
        figures = {k: words[FIGURES_AT + i] for i, k in enumerate(FIGURES)}
        return figures | {"unread": words[HEAD] - words[TAIL]}

    def close(self) -> None:
        """Let the child publish what was written, and end it (idempotent)."""
        if self._proc is None:
            return
        self._end(kill=False)

    def _end(self, kill: bool) -> None:
        proc, self._proc = self._proc, None
        if proc is not None:
            if kill:
                proc.kill()
            try:
                proc.stdin.close()  # the end of file: publish what is left and go
            except OSError:
                pass
            try:
                proc.wait(self._linger_s + 30.0)
            except subprocess.TimeoutExpired:
                log.warning("kvdist events: the publisher process did not end; killed")
                proc.kill()
                proc.wait()
            proc.stdout.close()
        if self._log_open:
            self._final = self._read_figures()
            self.recorder.close()
            self._log_open = False
