"""A rank's watcher (kvdist/launcher/rank_watcher.py), run as the ranks run it, against
a stand-in launcher: it says hello with the token from its environment (never its
command line), reports its rank's end and wait status, stops its rank when the
launcher's connection closes (the launcher died), leaves it running when the launcher
refuses it, and removes the shared-memory files its job left that no process maps."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from kvdist.launcher import rank_watcher, wire

SCRIPT = Path(rank_watcher.__file__)
TOKEN = "a1" * 16


def start_watcher(rank_pid: int) -> tuple[subprocess.Popen, socket.socket]:
    """The watcher of ``rank_pid``, connected: (its process, the launcher's end)."""
    listener = socket.create_server(("127.0.0.1", 0))
    watcher = subprocess.Popen([sys.executable, "-E", "-s", "-S", str(SCRIPT),
                                f"127.0.0.1:{listener.getsockname()[1]}", "3", "nodeq", str(rank_pid)],
                               env={**os.environ, wire.TOKEN_ENV: TOKEN})
    listener.settimeout(30)
    conn, _ = listener.accept()
    listener.close()
    conn.settimeout(30)
    return watcher, conn


def read_lines(conn: socket.socket, n: int) -> list[bytes]:
    got = b""
    while got.count(b"\n") < n:
        chunk = conn.recv(4096)
        assert chunk, got
        got += chunk
    return got.splitlines()


def running(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
        return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_the_watcher_reports_its_ranks_end_and_status():
    rank = subprocess.Popen(["sleep", "30"])
    watcher, conn = start_watcher(rank.pid)
    try:
        assert read_lines(conn, 1) == [wire.hello(TOKEN, 3, "nodeq", rank.pid).strip()]
        rank.send_signal(signal.SIGKILL)
        end, status = read_lines(conn, 2)
        assert end == wire.END.strip() and wire.parse_status(status) == (True, signal.SIGKILL)
        conn.close()
        assert watcher.wait(timeout=30) == 0
        assert TOKEN.encode() not in b" ".join(os.fsencode(a) for a in watcher.args)
    finally:
        rank.kill()
        rank.wait()
        watcher.kill()
        watcher.wait()


def test_the_launchers_death_stops_the_rank_and_a_refusal_does_not():
    rank = subprocess.Popen(["sleep", "60"])
    watcher, conn = start_watcher(rank.pid)
    try:
        read_lines(conn, 1)
        conn.sendall(wire.REFUSED)
        conn.close()
        assert watcher.wait(timeout=30) == 1
        assert running(rank.pid)  # refused: the watcher goes, the rank runs on
        watcher, conn = start_watcher(rank.pid)
        read_lines(conn, 1)
        t0 = time.monotonic()
        conn.close()  # as the kernel closes it when the launcher is killed
        assert rank.wait(timeout=30) == -signal.SIGTERM
        assert time.monotonic() - t0 < rank_watcher.STOP_GRACE_S
        assert watcher.wait(timeout=30) == 0
    finally:
        rank.kill()
        rank.wait()
        watcher.kill()
        watcher.wait()


def test_a_rank_that_ignores_sigterm_is_killed_after_the_grace():
    rank = subprocess.Popen([sys.executable, "-c", "import signal, time\n"
                             "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nprint(1, flush=True)\n"
                             "time.sleep(60)"], stdout=subprocess.PIPE)
    assert rank.stdout.readline() == b"1\n"
    watcher, conn = start_watcher(rank.pid)
    try:
        read_lines(conn, 1)
        t0 = time.monotonic()
        conn.close()
        assert rank.wait(timeout=30) == -signal.SIGKILL
        assert time.monotonic() - t0 >= rank_watcher.STOP_GRACE_S
    finally:
        rank.kill()
        rank.wait()
        watcher.kill()
        watcher.wait()


def test_leftovers_are_new_unmapped_files_of_mpich_and_kvdist(tmp_path):
    shm, proc = tmp_path / "shm", tmp_path / "proc"
    (proc / "77").mkdir(parents=True)
    shm.mkdir()
    old = shm / "mpich_shm_old_0"
    old.write_bytes(b"x")
    os.utime(old, (1, 1))  # mtime only; ctime is now: older files are judged by ctime
    since = time.time() - 1
    for name in ("mpich_shm_left_0", "kvdist-00ab-1.host", "kvdist-00ab-1.stamps",
                 "kvdist-00ab-0.node", "mpich_shm_live_0", "other_0"):
        (shm / name).write_bytes(b"x")
    (proc / "77" / "maps").write_text(f"7f00-7f10 rw-s 00000000 00:1a 9 {shm}/mpich_shm_live_0\n",
        encoding="utf-8")
    found = rank_watcher.leftovers(since, str(shm), str(proc))
    kvdist_files = ["kvdist-00ab-0.node", "kvdist-00ab-1.host", "kvdist-00ab-1.stamps"]
    assert sorted(Path(p).name for p in found) == [*kvdist_files, "mpich_shm_left_0", "mpich_shm_old_0"]
    assert rank_watcher.leftovers(time.time() + 60, str(shm), str(proc)) == []  # none changed since


def test_a_launcher_gone_before_the_watcher_connects_stops_the_rank():
    """The launcher killed between starting the job and a watcher's connection: the
    port refuses it, and the watcher stops its rank all the same."""
    closed = socket.create_server(("127.0.0.1", 0))
    port = closed.getsockname()[1]
    closed.close()
    rank = subprocess.Popen(["sleep", "60"])
    watcher = subprocess.Popen([sys.executable, "-E", "-s", "-S", str(SCRIPT), f"127.0.0.1:{port}", "0",
                                "nodeq", str(rank.pid)], env={**os.environ, wire.TOKEN_ENV: TOKEN})
    try:
        assert rank.wait(timeout=30) == -signal.SIGTERM
        assert watcher.wait(timeout=30) == 1
    finally:
        rank.kill()
        rank.wait()
        watcher.kill()
        watcher.wait()
