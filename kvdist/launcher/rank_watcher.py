"""The watcher of one rank: a small process that each rank of ``python -m kvdist run``
under launch/kvdist-launch starts (``process.announce_to_launcher``), in a session of
its own so that neither a SIGKILL of the rank nor mpiexec's clean-up of the rank's
process group reaches it. It tells the launcher which process runs the rank, then
waits for that process to end and tells how it ended: the one report that survives
the rank itself, on whatever node the rank runs.

    python -E -s -S kvdist/launcher/rank_watcher.py ADDRESS:PORT RANK RANK_HOST RANK_PID

with the job's token in ``$KVDIST_LAUNCH_TOKEN`` (never on the command line: every
local user reads those). The lines it sends are those of ``wire.py``. Two more duties:

- **the launcher's death**: the connection closing (without ``refused``) while the
  rank runs, or refused at the start, means the launcher is gone (SIGKILL, a crash):
  the watcher stops the rank — SIGTERM (it stops
  at its next step, closing its caches), SIGKILL after ``STOP_GRACE_S`` — so no job
  outlives its launcher;
- **leftovers**: once the rank has ended, the shared-memory files of this user that
  appeared in /dev/shm during the rank's life and that no live process maps —
  MPICH's ``mpich_shm_*`` (left when a rank is killed), the remote tier's
  ``kvdist-*`` — are removed, on every node (the last watcher of a node to see its
  rank end finds them unmapped).

Standard library only, no kvdist import: it starts in milliseconds and needs nothing
of the rank's environment. The rank's parent (hydra_pmi_proxy, prted) reaps it, so
the status comes from the pidfd (PIDFD_INFO_EXIT, Linux 6.15+) or from /proc while
the process is a zombie; where neither has it, the launcher falls back on mpiexec's
own report."""

from __future__ import annotations

import fcntl
import os
import select
import signal
import socket
import struct
import sys
import time

if __package__:
    from . import wire
else:  # run as a script: its own directory is on the path
    import wire

__all__ = ["LEFTOVER_PREFIXES", "leftovers", "main", "wait_status", "watch"]

_INFO = struct.Struct("QQ11IiII")  # struct pidfd_info up to coredump_mask (Linux 6.15)
_GET_INFO = (3 << 30) | (_INFO.size << 16) | (0xFF << 8) | 11  # PIDFD_GET_INFO
_INFO_EXIT = 1 << 3
STOP_GRACE_S = 2.5  # SIGTERM -> SIGKILL when the launcher is gone
LEFTOVER_PREFIXES = ("mpich_shm_", "kvdist-")


def _stat(pid: int) -> list[str]:
    """The fields of ``/proc/PID/stat`` after the command name (the state first)."""
    with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
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


def _started_at(pid: int) -> float:
    """When ``pid`` started (seconds since the epoch, less a second for rounding);
    infinity where /proc cannot say (then nothing counts as new)."""
    try:
        ticks = int(_stat(pid)[19])  # field 22, starttime
        with open("/proc/stat", encoding="utf-8") as f:
            boot = next(int(ln.split()[1]) for ln in f if ln.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK") - 1.0
    except (OSError, ValueError, IndexError, StopIteration):
        return float("inf")


def _mapped(shm: str, proc: str = "/proc") -> set[str]:
    """The files under ``shm`` that some live process of this user maps."""
    at, out = shm.rstrip("/") + "/", set()
    for entry in os.listdir(proc):
        if not entry.isdigit():
            continue
        try:
            with open(f"{proc}/{entry}/maps", encoding="utf-8") as f:
                out |= {ln[ln.index(at):].rstrip("\n").removesuffix(" (deleted)") for ln in f if at in ln}
        except OSError:  # gone, or not ours (then neither are its files)
            continue
    return out


def leftovers(since: float, shm: str = "/dev/shm", proc: str = "/proc") -> list[str]:
    """This user's files of ``shm`` named like MPICH's or kvdist's segments, changed
    since ``since`` (created during the rank's life) and mapped by no live process."""
    found = []
    for name in os.listdir(shm):
        if not name.startswith(LEFTOVER_PREFIXES):
            continue
        path = os.path.join(shm, name)
        try:
            st = os.stat(path)
        except OSError:
            continue
        if st.st_uid == os.geteuid() and st.st_ctime >= since:
            found.append(path)
    if not found:
        return []
    held = _mapped(shm, proc)
    return [p for p in found if p not in held]


def _remove_leftovers(since: float) -> None:
    try:
        for path in leftovers(since):
            try:
                os.unlink(path)
            except OSError:
                pass
    except OSError:
        pass


def _stop(pid: int, pidfd: int | None) -> None:
    """SIGTERM to the rank, SIGKILL if it has not ended within STOP_GRACE_S."""
    def send(sig: int) -> None:
        try:
            if pidfd is not None:
                signal.pidfd_send_signal(pidfd, sig)
            else:
                os.kill(pid, sig)
        except OSError:
            pass

    send(signal.SIGTERM)
    deadline = time.monotonic() + STOP_GRACE_S
    while time.monotonic() < deadline:
        if pidfd is not None and select.select([pidfd], [], [], 0.05)[0]:
            return
        if pidfd is None and _ended(pid):
            return
        if pidfd is None:
            time.sleep(0.05)
    send(signal.SIGKILL)
    end = time.monotonic() + 2.0
    while time.monotonic() < end and not _ended(pid):
        if pidfd is not None and select.select([pidfd], [], [], 0.05)[0]:
            return
        time.sleep(0.01)


def watch(addr: str, token: str, rank: int, host: str, pid: int) -> int:
    since = _started_at(pid)
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
        conn.sendall(wire.hello(token, rank, host, pid))
    except ConnectionRefusedError:  # the launcher's host answers, its port is closed: it is gone
        _stop(pid, pidfd)
        _remove_leftovers(since)
        return 1
    except (OSError, ValueError):  # unreachable (a firewall?): the rank runs unwatched
        return 1
    poll = select.poll()
    poll.register(conn, select.POLLIN)
    if pidfd is not None:
        poll.register(pidfd, select.POLLIN)
    while True:
        ready = {fd for fd, _ in poll.poll(None if pidfd is not None else 100)}
        if pidfd in ready or (pidfd is None and _ended(pid)):
            break
        if conn.fileno() in ready:
            try:
                said = conn.recv(len(wire.REFUSED))
            except OSError:
                said = b""
            if said == wire.REFUSED:  # the launcher does not take this watcher: the rank runs on
                return 1
            _stop(pid, pidfd)  # the launcher is gone: so is the job
            _remove_leftovers(since)
            return 0
    try:
        conn.sendall(wire.END)
        conn.sendall(wire.status(wait_status(pid, pidfd)))
        conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    _remove_leftovers(since)
    try:
        conn.settimeout(2)
        conn.recv(1)  # until the launcher has read it and closes
    except OSError:
        pass
    return 0


def main(argv: list[str]) -> int:
    token = os.environ.get(wire.TOKEN_ENV, "")
    if len(argv) != 4 or not token or not (argv[1].isascii() and argv[1].isdigit()
                                           and argv[3].isascii() and argv[3].isdigit()):
        print(f"usage: ${wire.TOKEN_ENV}=T rank_watcher.py ADDRESS:PORT RANK RANK_HOST RANK_PID",
              file=sys.stderr)
        return 2
    addr, rank, host, pid = argv
    return watch(addr, token, int(rank), host, int(pid))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
