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
from kvdist.block_observers import U64  # noqa: E402
from kvdist.events.process import ProcessPublisher  # noqa: E402
from kvdist.events.recorder import CLEARED, STEP_END, BlockRecorder  # noqa: E402
from kvdist.events.shared_log import BASE, HEAD, HEADER_BYTES, LogReader, LogWriter, make_log_fd  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
CHILD = "kvdist.events.child"

# A parent that starts a publisher, says its child's pid, and waits to be killed.
_PARENT = """
import sys, time
from array import array
from kvdist.events.process import ProcessPublisher
pub = ProcessPublisher("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "", 100, 0, (8, 8, 0), 4, b"s" * 16,
                       build="empty")
pub.recorder.cleared()
pub.end_step()
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
        pub.recorder.cleared()
        assert pub.end_step()
    pub.close()
    assert pub.figures()["published"] == 10 and pub.figures()["unread"] == 0
    assert _gone(child) and child not in _children()
    assert list(tmp_path.iterdir()) == [], "the ipc socket files are left"
    assert (set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()) == shm
    assert _fds() == fds, f"descriptors left open: {_fds() - fds}"
    pub.close()  # idempotent


def _cleared_words(pub: ProcessPublisher, n: int) -> None:
    """``n`` CLEARED words into the publisher's log, as the pool writes its words."""
    words = array(U64, [CLEARED] * n)
    try:
        pub.recorder.log.write(words)
    except ValueError:
        pub.recorder.overflow(words)


def test_steps_are_dropped_from_the_one_that_finds_the_child_gone_on(caplog):
    """The child killed: steps are published while the log has room; the first that
    finds none publishes what fits, waits, sees the child gone and gives up (one
    warning); that step and every one after it is dropped, and nothing more is
    published."""
    pub = ProcessPublisher("tcp://127.0.0.1:0", None, "", 100, 0, (8, 8, 0), 4, b"s" * 16, build="none",
                           log_bytes=4096, stall_s=60.0)
    try:
        os.kill(pub.pid, signal.SIGKILL)
        assert _wait_gone(pub.pid)
        with caplog.at_level("WARNING", logger="kvdist.events"):
            t0 = time.monotonic()
            for _ in range(3):  # 1 KiB steps: 127 words and the trailer's two
                _cleared_words(pub, 127)
                assert pub.end_step()
            assert (pub.submitted, pub.dropped) == (3, 0)
            _cleared_words(pub, 127)
            assert time.monotonic() - t0 < 30, "it waited for a child that is gone"
            head = pub.recorder.words[HEAD]
            assert head == 4096, "what fits is published before the writer waits"
            pub.end_step()
            for n in (127, 1000, 1):
                _cleared_words(pub, n)
                assert pub.end_step()
            assert pub.recorder.words[HEAD] == head, "published after the writer gave up"
        assert [r.getMessage() for r in caplog.records] == [
            "kvdist events: the publisher process has exited; no more events are published"]
        assert (pub.submitted, pub.dropped) == (3, 4)
    finally:
        pub.close()
    assert pub.stats()["dropped"] == 4 and pub.stats()["submitted"] == 3


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


def test_the_log_carries_any_stream_byte_for_byte():
    """Writes of random sizes, some larger than the log, into a 4 KiB log as the pool
    writes (``write``, and ``overflow`` when it does not fit), published at random
    points; the reader reads only when the writer waits for it: the bytes read are the
    bytes written, in order, however they are cut."""
    cap = 4096
    fd = make_log_fd(cap)
    got = bytearray()
    waits = 0

    def wait(first: bool) -> bool:
        nonlocal waits
        waits += 1
        got.extend(reader.read())
        return True

    writer, reader = LogWriter(fd, cap, wait), LogReader(fd, cap)
    os.close(fd)
    rng = random.Random(5)
    sent = bytearray()
    try:
        for _ in range(300):
            ops = array("Q", [rng.getrandbits(64) for _ in range(rng.choice([0, 1, 7, 100, 900]))])
            toks = array("i", [rng.randrange(-2**31, 2**31) for _ in range(rng.choice([0, 3, 64, 1500]))])
            for data in (rng.randbytes(16), ops, toks):  # a typed array's bytes as they are
                try:
                    writer.log.write(data)
                except ValueError:
                    writer.overflow(data)
                sent += bytes(data)
            if rng.random() < 0.5:
                assert writer.publish() == len(sent)
            if rng.random() < 0.1:
                got.extend(reader.read())
        writer.publish()
        got.extend(reader.read())
        assert waits > 0, "the stream must outgrow the log"
        assert bytes(got) == bytes(sent)
    finally:
        writer.close()
        reader.close()


def test_a_writer_starts_again_at_the_front_once_half_full_and_read():
    """Past half of the data area, a step's end moves its unpublished bytes to the front
    only when the reader has read everything published before: no wait, no wrap."""
    cap = 4096
    fd = make_log_fd(cap)
    writer, reader = LogWriter(fd, cap, lambda first: False), LogReader(fd, cap)
    os.close(fd)
    try:
        writer.log.write(b"a" * 2100)
        writer.publish()
        assert writer.log.tell() == HEADER_BYTES + 2100  # past half: not read yet, so not moved
        writer.log.write(b"b" * 100)
        writer.publish()
        assert reader.read() == b"a" * 2100 + b"b" * 100
        writer.log.write(b"c" * 50)
        assert writer.publish() == 2250
        assert writer.log.tell() == HEADER_BYTES + 50 and writer.words[BASE] == 2200
        assert reader.read() == b"c" * 50 and not writer.broken
    finally:
        writer.close()
        reader.close()


def test_a_writer_gives_up_when_told_to_and_publishes_nothing_more():
    cap = 4096
    fd = make_log_fd(cap)
    calls: list[bool] = []
    writer = LogWriter(fd, cap, lambda first: calls.append(first) or len(calls) < 3)
    reader = LogReader(fd, cap)
    os.close(fd)
    try:
        writer.log.write(b"x" * 4000)
        try:
            writer.log.write(b"y" * 200)
        except ValueError:
            writer.overflow(b"y" * 200)  # 96 bytes fit: published, then three waits
        assert calls == [True, False, False] and writer.broken
        assert reader.read() == b"x" * 4000 + b"y" * 96
        writer.log.write(b"z" * 8)
        writer.publish()
        assert reader.read() == b"" and calls == [True, False, False]
        assert writer.dropped == 1
    finally:
        writer.close()
        reader.close()


def test_a_private_recorder_hands_back_each_step_whole_as_its_log_restarts_and_overflows():
    """A 4 KiB private log, steps of random sizes (some larger than the log): each
    ``take`` returns exactly the step's words and its trailer, whether the step's end
    started the log again at the front, or the step's writes filled it (and were kept
    aside for ``take``)."""
    rec = BlockRecorder(capacity=4096)
    rng = random.Random(7)
    restarts = overflows = 0
    try:
        for _ in range(200):
            words = array(U64, [CLEARED] * rng.choice([1, 5, 100, 300, 700]))
            base = rec.words[BASE]
            try:
                rec.log.write(words)
            except ValueError:
                rec.overflow(words)
                overflows += 1
            step = rec.take()
            restarts += rec.words[BASE] != base
            assert step is not None and step[:-2] == words and step[-2] == STEP_END
            assert rec.take() is None, "a step with no change is not handed over"
        assert restarts > 10 and overflows > 10
    finally:
        rec.close()


def test_a_replay_holds_every_step_published_before_its_request_came():
    """The race: while the child reads the log, the cache publishes a step and a router
    sends a replay request. The request must not be answered before that step is in:
    ``serve_once`` takes the requests waiting before it reads, so this one is answered
    on the next look, with the step. (Answering whatever waits after the read, as the
    loop once did, answers it at once without the step.)"""
    import zmq

    from kvdist.events.child import serve_once
    from kvdist.events.recorder import Steps
    from kvdist.events.server import EventServer

    server = EventServer("tcp://127.0.0.1:0", "tcp://127.0.0.1:0", "kv", 16, 0, lambda step: [])
    ctx = zmq.Context()
    router = ctx.socket(zmq.DEALER)
    router.setsockopt(zmq.LINGER, 0)
    published: list[bytes] = []  # the log: what the cache published, not read yet
    try:
        router.connect(server.replay_endpoint)
        steps = Steps(4)

        def read_while_the_cache_and_a_router_act() -> bytes:
            published.append(array(U64, (STEP_END, 7)).tobytes())  # step 0 published
            router.send_multipart([b"", (0).to_bytes(8, "big")])  # then the request sent
            assert server.replay.poll(5000), "the request never reached the replay socket"
            return b""  # the read had begun before either

        assert serve_once(server, read_while_the_cache_and_a_router_act, steps, True) == b""
        assert not router.poll(200), "answered before the step published before the request was in"
        assert serve_once(server, lambda: published.pop(), steps, True) != b""
        seqs = []
        while True:
            assert router.poll(5000), "the replay did not end"
            frames = router.recv_multipart()
            seqs.append(int.from_bytes(frames[2], "big", signed=True))
            if seqs[-1] == -1:
                break
        assert seqs == [0, -1] and server.replays == 1 and server.published == 1
    finally:
        router.close()
        ctx.term()
        server.close()
