"""The block log's memory: a byte stream from the cache's step thread to its reader
(the publisher's process), written in place by the manager's pool — nothing is copied
into it at a step's end — with one writer, one reader, no system call, no lock and no
wake on either side.

The memory is an ``mmap``: shared, an anonymous file (``memfd_create``; elsewhere an
unlinked temporary file) that the child inherits as a file descriptor, so that nothing
is left behind however either side ends; or private, read back by the writer's own
thread (``LogWriter.read_back``). It is a 4 KiB header of 64-bit words — ``HEAD``, the
stream's bytes published, stored by the writer; ``TAIL``, those read, stored by the
reader; ``BASE``, the stream position at the data area's first byte, stored by the
writer; then words the reader publishes its figures in (``kvdist.events.child``) — and a
data area of ``capacity`` bytes.

The pool appends with the mmap's own ``write`` at its position (``LogWriter.log``: one C
call a change); a write that does not fit raises ValueError having written nothing,
and ``overflow`` writes it instead. ``publish`` stores ``HEAD``: the reader reads the
bytes ``[TAIL, HEAD)`` at ``BASE``'s offset and stores ``TAIL``. The stream is linear in
the data area and never wraps: the writer starts again at the front only when the
reader has read everything published (``TAIL == HEAD``) — at a step's end once the data
area is half full (moving the step's unpublished bytes, if any, to the front), or in
``overflow`` when it is full: what is written is published, the writer waits for the
reader (``wait``: its owner says for how long, and whether to give up), then goes on at
the front, in as many pieces as the data needs. A reader therefore sees a message cut
anywhere, and joins the pieces itself. Once the writer gives up the stream has ended
(``broken``): nothing more is published, and the pool's writes go on into memory of
the writer's own.

Each side orders its copies against its words with :func:`fence` (a release then an
acquire of a private lock) where the CPU needs it: on x86-64 stores are seen in program
order and loads are not reordered with loads, so the order holds anyway and the step
thread skips the C calls (``ORDERED``); on weakly ordered CPUs, as aarch64, the pair
keeps the copies on their side of the words. The words are aligned 8-byte stores and
loads (``U64`` items, the block log's type): never torn."""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import threading
from collections.abc import Callable

from ..block_observers import U64

__all__ = ["BASE", "FIGURES_AT", "HEAD", "HEADER_BYTES", "ORDERED", "TAIL", "LogReader", "LogWriter", "fence",
           "make_log_fd"]

HEADER_BYTES = 4096
HEAD, TAIL, BASE = 0, 1, 2  # header words
FIGURES_AT = 3  # the reader's figures from this word on

# Total store order (x86): the writer's copies are seen before its HEAD store, and the
# reader's loads of HEAD, BASE and the bytes stay in order, without a fence.
ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()
_fence_lock.acquire()


def fence() -> None:
    """Loads and stores before it complete before those after it (module docstring)."""
    _fence_lock.release()
    _fence_lock.acquire()


def make_log_fd(capacity: int) -> int:
    """A new anonymous shared file of a log of ``capacity`` data bytes (the caller
    closes the descriptor; the memory goes with the last descriptor and mapping)."""
    if hasattr(os, "memfd_create"):
        fd = os.memfd_create("kvdist-events", os.MFD_CLOEXEC)
    else:  # pragma: no cover - not Linux
        with tempfile.TemporaryFile() as f:
            fd = os.dup(f.fileno())
    try:
        os.ftruncate(fd, HEADER_BYTES + capacity)
    except BaseException:
        os.close(fd)
        raise
    return fd


class _Log:
    def __init__(self, fd: int | None, capacity: int, populate: bool = False):
        self.capacity = capacity
        if fd is None:
            self.mm = mmap.mmap(-1, HEADER_BYTES + capacity, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        else:
            flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
            self.mm = mmap.mmap(fd, HEADER_BYTES + capacity, flags=flags)
        self.words = memoryview(self.mm)[:HEADER_BYTES].cast(U64)

    def _bytes(self, base: int, start: int, end: int) -> bytes:
        """The stream's bytes ``[start, end)``, the data area's first byte ``base``."""
        return self.mm[HEADER_BYTES + start - base : HEADER_BYTES + end - base]

    def close(self) -> None:
        if not self.mm.closed:
            self.words.release()
            self.mm.close()


class LogWriter(_Log):
    """The writing end (module docstring): the pool writes into ``log`` (the mmap; its
    position is the stream's end), the step's end ``publish``-es. ``fd`` None: private
    memory, read back by ``read_back`` (``wait`` is then not called: ``overflow`` keeps
    what is published aside for it). Shared pages are mapped at once (``MAP_POPULATE``): a step never
    takes the page fault of a first write. ``wait(first)`` is called while the writer
    waits for the reader (``first``: the first call of this wait); when it returns False
    the writer gives up for good."""

    def __init__(self, fd: int | None, capacity: int, wait: Callable[[bool], bool] | None = None):
        super().__init__(fd, capacity, populate=True)
        assert (fd is None) == (wait is None), "a shared log needs its wait, a private one has none"
        self._wait = wait
        self._private = fd is None
        self._kept = bytearray()  # private: bytes published and read off by overflow, for take
        self._base = self.words[BASE]
        self._head = self.words[HEAD]  # as last published
        self.published = HEADER_BYTES  # the offset of the first byte not published (the writer's)
        self.restart_from = HEADER_BYTES + capacity // 2  # past it, a step's end may start again at the front
        self.broken = False  # gave up waiting: nothing more is published
        self.slow = not ORDERED  # a step's end needs the whole of publish (a fence; or the writer gave up)
        self.steps = 0  # steps published whole
        self.dropped = 0  # steps not: the one the writer gave up in, and each later one
        self.log = self.mm  # where writes go: the memory the reader reads, until the writer gives up
        self.log.seek(HEADER_BYTES)

    def publish(self) -> int:
        """Publish every byte written, at a step's end (the reader may read them from
        now on); the stream's bytes published so far. Once the data area is half full
        and the reader has read everything published before, start again at the front."""
        pos = self.log.tell()
        if pos > self.restart_from and self.published != HEADER_BYTES and self.words[TAIL] == self._head:
            self._restart(pos)
        self._publish_part()
        self.steps += 1
        return self._head

    def _publish_part(self) -> None:
        """Publish every byte written, ``publish`` without its step (also in the middle
        of a step: ``overflow``)."""
        if not ORDERED:
            fence()  # the bytes are in place before the reader can see them
        pos = self.log.tell()
        self.words[HEAD] = self._head = self._base + pos - HEADER_BYTES
        self.published = pos

    def _restart(self, pos: int) -> None:
        """Go on at the front: the reader has read everything published; the bytes not
        published yet (from ``published`` to ``pos``) move there."""
        fence()  # the reader's copies out are done before ours overwrite them
        n = pos - self.published
        if n:
            self.log.move(HEADER_BYTES, self.published, n)
        self._base = self._head
        self.words[BASE] = self._base
        self.published = HEADER_BYTES
        self.log.seek(HEADER_BYTES + n)

    def overflow(self, data) -> None:
        """Write ``data`` (a bytes-like object), which did not fit at the end of the data
        area: fill it, publish, and go on at the front once the reader has read it all,
        as many times as ``data`` needs. A writer that gave up (now or before) writes
        into memory of its own that nobody reads, from its front each step."""
        view = memoryview(data).cast("B")
        off = 0
        while True:
            log = self.log
            k = min(len(view) - off, len(log) - log.tell())
            log.write(view[off : off + k])
            off += k
            if off == len(view):
                return
            if self.broken:
                log.seek(HEADER_BYTES)  # nobody reads it
                continue
            self._publish_part()
            if self._drained():
                self._restart(log.tell())
            else:
                self._give_up()

    def _give_up(self) -> None:
        """The wait gave up: nothing more is published; the writes go on into memory of
        the writer's own, and each step handed over from this one on is dropped."""
        self.broken = self.slow = True
        self.log = mmap.mmap(-1, len(self.mm), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        self.log.seek(HEADER_BYTES)
        self.published = HEADER_BYTES
        self.publish = self._publish_nothing  # type: ignore[method-assign]

    def _publish_nothing(self) -> int:
        """``publish`` once the writer gave up: the step is dropped."""
        self.log.seek(HEADER_BYTES)
        self.dropped += 1
        return self._head

    def _drained(self) -> bool:
        """Wait until the reader has read everything published: False when the wait
        gives up."""
        if self._private:  # the reader is read_back, on this thread: keep the bytes for it
            self._kept += self._bytes(self._base, self.words[TAIL], self._head)
            self.words[TAIL] = self._head
            return True
        first = True
        while self.words[TAIL] != self._head:
            if not self._wait(first):
                return False
            first = False
        fence()  # the reader's copies out are done before ours overwrite them
        return True

    def read_back(self) -> bytes:
        """Private: every byte published since the last call."""
        assert self._private, "read_back reads a private log; a shared one is read by its reader"
        out = bytes(self._kept) + self._bytes(self._base, self.words[TAIL], self._head)
        self._kept.clear()
        self.words[TAIL] = self._head
        return out

    def discard(self) -> None:
        """Private: drop every byte published (nobody reads them)."""
        self._kept.clear()
        self.words[TAIL] = self._head

    def close(self) -> None:
        super().close()
        if not self.log.closed:  # the writer's own memory, once it gave up
            self.log.close()


class LogReader(_Log):
    """The reading end (the publisher's process)."""

    def read(self) -> bytes:
        """Every byte published since the last call (b"" when none)."""
        words = self.words
        head, tail = words[HEAD], words[TAIL]
        if head == tail:
            return b""
        fence()  # HEAD is loaded before BASE and the bytes it covers
        out = self._bytes(words[BASE], tail, head)
        fence()  # the bytes are copied out before the writer may reuse them
        words[TAIL] = head
        return out
