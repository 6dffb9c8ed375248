"""Where the ranks' watchers report (``RankWatch``): which rank of the job ended first,
on any node, and how. Each rank of ``python -m kvdist run`` starts a watcher
(``rank_watcher.py``) that connects here, says which process runs the rank, and reports
the moment that process ends and its wait status (the lines of ``wire.py``). When one
rank dies, mpiexec kills the rest right after, so the first report is the one that died
(the one mpiexec's banner may get wrong: under Open MPI a survivor that aborts on the
lost peer can be reported instead); the banner is the status of last resort.

The port is a door into the launcher, so it is kept small:
- it listens on loopback when every rank is local (no hostfile), else on the address
  the launching host's name resolves to — never on every interface;
- a connection has ``HELLO_TIMEOUT_S`` to say a valid hello (the job's token, a rank
  below NP, not yet reported) or is refused (``wire.REFUSED``, then closed); at most NP +
  ``MAX_PENDING`` wait for theirs (the oldest goes for a new one: every watcher of the
  job may connect at once), and out of descriptors it refuses the oldest waiting one or
  stops accepting for a moment — it never spins;
- a line it cannot read is counted (``bad_lines``) and ignored; it never raises on input."""

from __future__ import annotations

import os
import selectors
import signal
import socket
import time
from dataclasses import dataclass

from . import wire
from .banner import Banner

__all__ = ["HELLO_TIMEOUT_S", "MAX_PENDING", "RankWatch", "listen_address"]

HELLO_TIMEOUT_S = 5.0
MAX_PENDING = 32
PAUSE_S = 0.25  # no accepting for this long when out of descriptors


def listen_address(local: bool) -> tuple[int, str]:
    """(address family, address) to listen on: loopback for a one-node job, else the
    address this host's name resolves to (what the other nodes reach it by)."""
    if local:
        return socket.AF_INET, "127.0.0.1"
    infos = socket.getaddrinfo(socket.gethostname(), 0, type=socket.SOCK_STREAM)
    infos.sort(key=lambda i: i[0] != socket.AF_INET)  # IPv4 first
    family, _, _, _, addr = infos[0]
    return family, addr[0]


@dataclass(slots=True)
class _Conn:
    since: float
    buffer: bytes = b""
    rank: int | None = None  # set by a valid hello
    done: bool = False  # its status came


class RankWatch:
    """The watchers' server of one job of ``np`` ranks (see the module's docstring)."""

    def __init__(self, np: int, local: bool, token: str):
        self.np = np
        self.token = token
        family, address = listen_address(local)
        self.listener = socket.create_server((address, 0), family=family, backlog=min(max(np, 16), 1024))
        self.listener.setblocking(False)
        self.address = f"[{address}]" if family == socket.AF_INET6 else address
        self.ranks: dict[int, tuple[str, int]] = {}  # rank -> (host, pid)
        self.ended: list[int] = []  # ranks, in the order their ends were reported
        self.status: dict[int, int | None] = {}  # rank -> wait status (None: not known)
        self.bad_lines = 0
        self.banner = Banner()
        self.sel = selectors.DefaultSelector()  # epoll: reports in the order events happen
        self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        self.conns: dict[socket.socket, _Conn] = {}
        self.paused_until = 0.0

    def env(self) -> dict[str, str]:
        """What the ranks need to report here (the token in the environment only)."""
        return {wire.ADDR_ENV: f"{self.address}:{self.listener.getsockname()[1]}", wire.TOKEN_ENV: self.token}

    def poll(self, timeout: float, on_output) -> None:
        """One round: accept, read watchers' lines, and hand any other registered
        file's readiness to ``on_output(key)``."""
        now = time.monotonic()
        if self.paused_until and now >= self.paused_until:
            self.paused_until = 0.0
            self.sel.register(self.listener, selectors.EVENT_READ, "listen")
        for conn, state in list(self.conns.items()):
            if state.rank is None and now - state.since > HELLO_TIMEOUT_S:
                self._refuse(conn)
        for key, _ in self.sel.select(timeout):
            if key.data == "listen":
                self._accept()
            elif key.data == "conn":
                if key.fileobj in self.conns:
                    self._read(key.fileobj)
            else:
                on_output(key)

    def release(self) -> None:
        """Close every connection: each watcher whose rank still runs stops it."""
        for conn in list(self.conns):
            self._close(conn)

    def close(self) -> None:
        self.release()
        if not self.paused_until:
            self.sel.unregister(self.listener)
        self.listener.close()
        self.sel.close()

    def settled(self) -> bool:
        """Whether the first rank that ended has its status (or never reported one)."""
        return not self.ended or self.ended[0] in self.status

    def _pending(self) -> list[socket.socket]:
        return [c for c, s in self.conns.items() if s.rank is None]

    def _accept(self) -> None:
        for _ in range(64):  # then the others' turn
            try:
                conn, _ = self.listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError:  # out of descriptors: make room, or wait a moment
                pending = self._pending()
                if pending:
                    self._refuse(pending[0])
                    continue
                self.sel.unregister(self.listener)
                self.paused_until = time.monotonic() + PAUSE_S
                return
            pending = self._pending()
            if len(pending) >= self.np + MAX_PENDING:
                self._refuse(pending[0])
            conn.setblocking(False)
            self.conns[conn] = _Conn(time.monotonic())
            self.sel.register(conn, selectors.EVENT_READ, "conn")

    def _read(self, conn: socket.socket) -> None:
        state = self.conns[conn]
        try:
            data = conn.recv(4096)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""
        if not data:
            self._close(conn)
            return
        state.buffer += data
        while b"\n" in state.buffer:
            line, state.buffer = state.buffer.split(b"\n", 1)
            if not self._line(conn, state, line):
                return
        if len(state.buffer) > wire.MAX_LINE:  # a line without end
            self.bad_lines += 1
            self._refuse(conn)

    def _line(self, conn: socket.socket, state: _Conn, line: bytes) -> bool:
        """Act on one line; False once ``conn`` is closed."""
        if state.rank is None:
            hello = wire.parse_hello(line, self.token, self.np)
            if hello is None or hello.rank in self.ranks:
                self.bad_lines += 1
                self._refuse(conn)
                return False
            state.rank = hello.rank
            self.ranks[hello.rank] = (hello.host, hello.pid)
            return True
        if line == wire.END.rstrip(b"\n"):
            if state.rank not in self.ended:
                self.ended.append(state.rank)
            return True
        is_status, value = wire.parse_status(line)
        if not is_status or state.rank not in self.ended or state.done:
            self.bad_lines += 1
            return True
        state.done = True
        self.status[state.rank] = value
        self._close(conn)
        return False

    def _refuse(self, conn: socket.socket) -> None:
        """Close a connection this server does not take, saying so (best effort)."""
        try:
            conn.send(wire.REFUSED)
        except OSError:
            pass
        self._close(conn)

    def _close(self, conn: socket.socket) -> None:
        rank = self.conns.pop(conn).rank
        if rank in self.ended:  # a watcher gone before it told the status: not known
            self.status.setdefault(rank, None)
        self.sel.unregister(conn)
        conn.close()

    def verdict(self) -> str | None:
        """The line for the rank that ended first, if a signal ended it: its watcher's
        report, else mpiexec's banner when that names the same process; without reports
        (no watchers), the banner alone when it says which rank."""
        found = self.banner.found
        if self.ended:
            rank = self.ended[0]
            host, pid = self.ranks[rank]
            status = self.status.get(rank)
            if status is None and found is not None:
                b_rank, b_pid, b_host, b_status = found
                if b_rank == rank or (b_rank is None and (b_pid, b_host) == (pid, host)):
                    status = b_status
        elif found is not None:
            rank, pid, host, status = found
            if rank is None:
                rank = next((r for r, hp in self.ranks.items() if hp == (host, pid)), None)
            if rank is None:
                return None
        else:
            return None
        if status is None or not os.WIFSIGNALED(status):
            return None
        try:
            how = signal.Signals(os.WTERMSIG(status)).name
        except ValueError:
            how = f"signal {os.WTERMSIG(status)}"
        return f"rank {rank} (pid {pid} on {host}) was killed by {how}"
