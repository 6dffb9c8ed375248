"""The watcher of one rank: a small process that each rank of ``python -m kvdist run``
under launch/kvdist-launch starts (``process.announce_to_launcher``), in a session of
its own so that neither a SIGKILL of the rank nor mpiexec's clean-up of the rank's
process group reaches it. It tells the launcher which process runs the rank, then
waits for that process to end and tells how it ended: the one report that survives
the rank itself, on whatever node the rank runs.

    python -I -S rank_watcher.py HOST:PORT TOKEN RANK RANK_HOST RANK_PID

Over one TCP connection to the launcher: ``TOKEN RANK RANK_HOST RANK_PID`` at once,
``end`` the moment the rank's process ends, then ``status S`` (its wait status, as
waitpid gives it) or ``status -`` where it cannot be had. It exits after that, or as
soon as the launcher closes the connection. Standard library only, no kvdist import:
it starts in milliseconds and needs nothing of the rank's environment.

The rank's parent (hydra_pmi_proxy, prted) reaps it, so the status comes from the
pidfd (PIDFD_INFO_EXIT, Linux 6.15+) or from /proc while the process is a zombie;
where neither has it, the launcher falls back on mpiexec's own report."""

from __future__ import annotations

import fcntl
import os
import select
import socket
import struct
import sys
import time

_INFO = struct.Struct("QQ11IiII")  # struct pidfd_info up to coredump_mask (Linux 6.15)
_GET_INFO = (3 << 30) | (_INFO.size << 16) | (0xFF << 8) | 11  # PIDFD_GET_INFO
_INFO_EXIT = 1 << 3


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (the state first)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()


def wait_status(pid: int, pidfd: int | None, within_s: float = 0.5) -> int | None:
    """The wait status of the ended process ``pid``: /proc while it is a zombie, the
    pidfd once reaped (Linux 6.15+); None if neither has it within ``within_s``."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            fields = _stat(pid)
            if fields[0] == "Z":
                return int(fields[49])  # field 52, exit_code
        except (OSError, IndexError, ValueError):
            pass
        if pidfd is not None:
            buf = bytearray(_INFO.pack(_INFO_EXIT, *([0] * 15)))
            try:
                fcntl.ioctl(pidfd, _GET_INFO, buf, True)
                info = _INFO.unpack(buf)
                if info[0] & _INFO_EXIT:
                    return info[13]
            except OSError:
                pass
        time.sleep(0.001)
    return None


def _ended(pid: int) -> bool:
    """Whether ``pid`` ended (gone, or a zombie): the check where pidfds are missing."""
    try:
        return _stat(pid)[0] in ("Z", "X")
    except (OSError, IndexError):
        return True


def watch(addr: str, token: str, rank: int, host: str, pid: int) -> int:
    try:
        pidfd: int | None = os.pidfd_open(pid)
    except AttributeError:  # Python without pidfd_open
        pidfd = None
    except OSError:  # the rank is gone already, or no pidfds here (Linux < 5.3)
        if _ended(pid):
            return 1
        pidfd = None
    where, _, port = addr.rpartition(":")
    try:
        conn = socket.create_connection((where.strip("[]"), int(port)), timeout=10)
        conn.sendall(f"{token} {rank} {host} {pid}\n".encode())
    except (OSError, ValueError):
        return 1
    poll = select.poll()
    poll.register(conn, select.POLLIN)
    if pidfd is not None:
        poll.register(pidfd, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poll.poll(None if pidfd is not None else 10)}
        if conn.fileno() in ready:  # the launcher is gone (or said something: it never does)
            return 0
        if pidfd in ready or (pidfd is None and _ended(pid)):
            break
    try:
        conn.sendall(b"end\n")
        status = wait_status(pid, pidfd)
        conn.sendall(f"status {'-' if status is None else status}\n".encode())
        conn.shutdown(socket.SHUT_WR)
        conn.settimeout(2)
        conn.recv(1)  # until the launcher has read it and closes
    except OSError:
        pass
    return 0


def main(argv: list[str]) -> int:
    if len(argv) != 5:
        print("usage: rank_watcher.py HOST:PORT TOKEN RANK RANK_HOST RANK_PID", file=sys.stderr)
        return 2
    addr, token, rank, host, pid = argv
    return watch(addr, token, int(rank), host, int(pid))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
