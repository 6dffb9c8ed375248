"""The publisher's process (``kvdist.events.process``, ``kvdist.events.child``) and its
shared-memory ring: the child dies with its parent (killed, or Ctrl-C at a terminal),
``close`` leaves no process, descriptor, socket file or /dev/shm file behind, a
publisher that cannot bind leaves no process, and the ring carries any stream of
messages byte for byte, wrapping and waiting for its reader."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from array import array
from pathlib import Path

import pytest

pytest.importorskip("zmq")

import kvdist  # noqa: E402
from kvdist.events.process import ProcessPublisher  # noqa: E402
from kvdist.events.ring import RingReader, RingWriter, make_ring_fd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHILD = "kvdist.events.child"

# A parent that starts a publisher, says its child's pid, and waits to be killed.
_PARENT = """
import sys, time
from array import array
from kvdist.events.process import ProcessPublisher
pub = ProcessPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "", 100, 0, (8, 8, 0), 4, b"s" * 16,
                       build="empty")
pub.submit(array("Q", [2, 0]))
print(pub.pid, flush=True)
time.sleep(600)
"""


def _gone(pid: int) -> bool:
    """No such process, or a zombie (ended; its reaper is slow)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(encoding="utf-8")
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _wait_gone(pid: int, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if _gone(pid):
            return True
        time.sleep(0.05)
    return False


def _children() -> list[int]:
    """This process's live publisher children."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text(encoding="utf-8")
            cmd = (d / "cmdline").read_bytes()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if int(fields[1]) == os.getpid() and fields[0] != "Z" and CHILD.encode() in cmd:
            out.append(int(d.name))
    return out


def _start_parent(**kw) -> tuple[subprocess.Popen, int]:
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, **kw, encoding="utf-8")
    line = parent.stdout.readline()
    assert line.strip().isdigit(), parent.stderr.read()
    child = int(line)
    assert not _gone(child)
    return parent, child


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_killed_parent_takes_its_publisher_process_with_it():
    parent, child = _start_parent()
    try:
        parent.kill()  # kill -9: no close, no atexit
        parent.wait(30)
        assert _wait_gone(child), f"the publisher process {child} outlived its killed parent"
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)  # it holds the parent's pipes
        parent.kill()
        parent.communicate(timeout=30)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_ctrl_c_ends_the_parent_and_the_publisher_quietly():
    """SIGINT to the whole process group, as a terminal sends it: the parent dies of
    its KeyboardInterrupt; the child ignores it and ends by its pipe (one traceback, the
    parent's)."""
    parent, child = _start_parent(start_new_session=True)
    try:
        os.killpg(parent.pid, signal.SIGINT)
        assert _wait_gone(child), f"the publisher process {child} outlived its parent's Ctrl-C"
        _, err = parent.communicate(timeout=30)
        assert err.count("KeyboardInterrupt") == 1, err
    finally:
        if not _gone(child):
            os.kill(child, signal.SIGKILL)
        parent.kill()


def _fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.add(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # the listing's own descriptor
    return out


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_close_leaves_no_process_descriptor_socket_file_or_shm_file(tmp_path):
    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    fds = _fds()
    pub = ProcessPublisher(f"ipc://{tmp_path}/pub", f"ipc://{tmp_path}/replay", "", 100, 0, (8, 8, 0), 4,
                           b"s" * 16, build="empty")
    child = pub.pid
    assert sorted(p.name for p in tmp_path.iterdir()) == ["pub", "replay"]
    assert any("memfd:kvdist-events" in f for f in _fds())
    for _ in range(10):
        pub.submit(array("Q", [2, 0]))
    pub.close()
    assert pub.figures()["published"] == 10 and pub.figures()["unread"] == 0
    assert _gone(child) and child not in _children()
    assert list(tmp_path.iterdir()) == [], "the ipc socket files are left"
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) == shm
    assert _fds() == fds, f"descriptors left open: {_fds() - fds}"
    pub.close()  # idempotent


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_publisher_that_cannot_bind_says_which_key_and_leaves_no_process():
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    port = taken.getsockname()[1]
    try:
        for args in ((f"tcp://127.0.0.1:{port}", None), ("tcp://127.0.0.1:0", f"tcp://127.0.0.1:{port}")):
            with pytest.raises(kvdist.ConfigError) as ei:
                ProcessPublisher(*args, "", 100, 0, (8, 8, 0), 4, b"s" * 16)
            msg = str(ei.value)
            key = "cache.events.endpoint" if args[1] is None else "cache.events.replay_endpoint"
            assert key in msg and f":{port}" in msg and "cannot bind it" in msg and "\n" not in msg
            assert _children() == []
    finally:
        taken.close()


def test_the_ring_carries_any_stream_byte_for_byte():
    """Messages of random sizes, some larger than the ring, through a 4 KiB ring whose
    reader only reads when the writer waits for room: the bytes read are the bytes
    written, in order, however they wrap."""
    cap = 4096
    fd = make_ring_fd(cap)
    writer, reader = RingWriter(fd, cap), RingReader(fd, cap)
    os.close(fd)
    got = bytearray()
    waits = 0

    def wait() -> bool:
        nonlocal waits
        waits += 1
        got.extend(reader.read())
        return True

    rng = random.Random(5)
    sent = bytearray()
    try:
        for _ in range(300):
            head = rng.randbytes(16)
            ops = array("Q", [rng.getrandbits(64) for _ in range(rng.choice([0, 1, 7, 100, 900]))])
            toks = array("i", [rng.randrange(-2**31, 2**31) for _ in range(rng.choice([0, 3, 64, 1500]))])
            msg = head + ops.tobytes()
            assert writer.write(msg, len(msg), wait)
            assert writer.write(toks, len(toks) * 4, wait)  # a typed array's bytes as they are
            msg += toks.tobytes()
            sent += msg
        got.extend(reader.read())
        assert waits > 0, "the stream must outgrow the ring"
        assert bytes(got) == bytes(sent)
    finally:
        writer.close()
        reader.close()


def test_a_writer_gives_up_when_told_to():
    cap = 4096
    fd = make_ring_fd(cap)
    writer = RingWriter(fd, cap)
    os.close(fd)
    try:
        assert writer.write(b"x" * 4000, 4000, lambda: False)
        assert not writer.write(b"y" * 200, 200, lambda: False)
    finally:
        writer.close()
