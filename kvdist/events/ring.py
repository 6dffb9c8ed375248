"""A byte stream from the cache's step thread to the publisher's process, through shared
memory: one writer, one reader, no system call, no lock and no wake on either side.

The memory is an anonymous file (``memfd_create``; elsewhere an unlinked temporary file)
that the child inherits as a file descriptor: it has no name, so nothing is left behind
however either side ends. It is a 4 KiB header of 64-bit words — ``HEAD``, the bytes
ever written, stored by the writer; ``TAIL``, the bytes ever read, stored by the reader;
then words the reader publishes its figures in (``kvdist.events.child``) — and a data
area of ``capacity`` bytes, used as a circular buffer: byte ``i`` of the stream lies at
``i % capacity``.

The writer copies bytes in, then stores ``HEAD``; the reader loads ``HEAD``, copies
the bytes out, then stores ``TAIL``. Each side orders its copies against its word with
:func:`fence` (a release then an acquire of a private lock) where the CPU needs it: on
x86-64 stores are seen in program order and loads are not reordered with loads, so
the order holds anyway and the step thread skips the two C calls (``ORDERED``); on
weakly ordered CPUs, as aarch64, the pair keeps the copies on their side of the word.
The words are aligned 8-byte stores and loads: never torn.

The stream is bounded: a writer that finds too little room waits for the reader
(``wait``: its caller says for how long, and whether to give up)."""

from __future__ import annotations

import mmap
import os
import platform
import tempfile
import threading
from collections.abc import Callable

__all__ = ["HEADER_BYTES", "ORDERED", "RingReader", "RingWriter", "fence", "make_ring_fd"]

HEADER_BYTES = 4096
HEAD, TAIL = 0, 1  # header words; 2.. are the reader's figures

# Total store order (x86): the writer's copies are seen before its HEAD store, and the
# reader's loads of HEAD and of the bytes stay in order, without a fence.
ORDERED = platform.machine().lower() in ("x86_64", "amd64", "i386", "i686")
_fence_lock = threading.Lock()
_fence_lock.acquire()


def fence() -> None:
    """Loads and stores before it complete before those after it (module docstring)."""
    _fence_lock.release()
    _fence_lock.acquire()


def make_ring_fd(capacity: int) -> int:
    """A new anonymous shared file of a ring of ``capacity`` data bytes (the caller
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


class _Ring:
    def __init__(self, fd: int, capacity: int, populate: bool = False):
        self.capacity = capacity
        flags = mmap.MAP_SHARED | (getattr(mmap, "MAP_POPULATE", 0) if populate else 0)
        self._mm = mmap.mmap(fd, HEADER_BYTES + capacity, flags=flags)
        self.words = memoryview(self._mm)[:HEADER_BYTES].cast("Q")

    def close(self) -> None:
        if self._mm is not None:
            self.words.release()
            self._mm.close()
            self._mm = None


class RingWriter(_Ring):
    """The writing end (the cache's step thread). Its pages are mapped at once
    (``MAP_POPULATE``): a step never takes the page fault of a first write."""

    def __init__(self, fd: int, capacity: int):
        super().__init__(fd, capacity, populate=True)
        self._head = self.words[HEAD]
        self._tail = self.words[TAIL]  # as last loaded: the room known to be free
        self._limit = self._head  # a write ending at or before it fits in one copy (_look)
        self._look()

    def _look(self) -> None:
        """Load ``TAIL``; ``_limit``: the stream position a write may end at in one copy,
        in the room known to be free and short of the data area's end."""
        self._tail = self.words[TAIL]
        fence()  # the reader's copies out are done before ours overwrite them
        cap = self.capacity
        self._limit = min(self._tail + cap, self._head - self._head % cap + cap)

    def write(self, data, n: int, wait: Callable[[], bool]) -> bool:
        """Append the bytes of ``data`` (a bytes-like object of ``n`` bytes) to the
        stream. While there is too little room, ``wait()`` is called between looks at
        the reader's progress; when it returns False the writer gives up: False (the
        stream then ends mid-message: write nothing more)."""
        head = self._head
        if head + n > self._limit:
            self._look()
            if head + n > self._limit:
                return self._write_parts(data, n, wait)
        at = HEADER_BYTES + head % self.capacity  # the common case: one copy
        self._mm[at : at + n] = data
        if not ORDERED:
            fence()  # the bytes are in place before the reader can see them
        self.words[HEAD] = self._head = head + n
        return True

    def _write_parts(self, data, n: int, wait: Callable[[], bool]) -> bool:
        """``write`` across the data area's end, or waiting for room: as much as fits
        at a time."""
        data = memoryview(data).cast("B")
        cap, off = self.capacity, 0
        while off < n:
            room = cap - (self._head - self._tail)
            if room == 0:
                if not wait():
                    return False
                self._look()
                continue
            at = self._head % cap
            k = min(n - off, room, cap - at)
            self._mm[HEADER_BYTES + at : HEADER_BYTES + at + k] = data[off : off + k]
            off += k
            self._publish(self._head + k)
        self._look()
        return True

    def _publish(self, head: int) -> None:
        fence()  # the bytes are in place before the reader can see them
        self.words[HEAD] = self._head = head


class RingReader(_Ring):
    """The reading end (the publisher's process)."""

    def read(self) -> bytes:
        """Every byte written since the last call (b"" when none)."""
        words, cap = self.words, self.capacity
        head, tail = words[HEAD], words[TAIL]
        if head == tail:
            return b""
        fence()  # HEAD is loaded before the bytes it covers
        at, n = tail % cap, head - tail
        if at + n <= cap:
            out = self._mm[HEADER_BYTES + at : HEADER_BYTES + at + n]
        else:
            mm = self._mm
            out = mm[HEADER_BYTES + at : HEADER_BYTES + cap] + mm[HEADER_BYTES : HEADER_BYTES + at + n - cap]
        fence()  # the bytes are copied out before the writer may reuse them
        words[TAIL] = head
        return out
