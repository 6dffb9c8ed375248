"""The disk tier: one preallocated file per rank, blocks read and written with
positional I/O from worker threads (``pread``/``pwrite`` drop the GIL), reads and
writes on pools of their own so a read a step waits for never queues behind writes.

A batch (``write_blocks`` / ``read_blocks``) is sorted by slot, runs of neighbouring
slots become one vectored call, and the runs are spread over the threads so the
disk sees several requests at once. ``O_DIRECT`` (optional) bypasses the page cache:
unaligned buffers go through an aligned per-thread bounce buffer, and a filesystem
that refuses it falls back to buffered I/O with a warning. The file has no name
(``O_TMPFILE``, else unlinked as soon as it is made): it is private to the process
that made it, and its space returns when the process closes it or dies, whatever
kills it — a crash never leaves a file behind."""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np
import torch

from .. import paths
from ..errors import KVDistError
from ..layout import KVLayout

log = logging.getLogger("kvdist.disk")

DIRECT_ALIGN = 4096  # covers the logical block size of every common device
MAX_RUN_BYTES = 16 << 20  # one vectored call moves at most this much
IOV_MAX = 1024
_FULL = {errno.ENOSPC, errno.EFBIG, errno.EDQUOT}


def as_bytes(buf) -> np.ndarray:
    """A 1-D uint8 numpy view of a block buffer (tensor, ndarray or bytes-like)."""
    if isinstance(buf, torch.Tensor):
        assert buf.device.type == "cpu" and buf.is_contiguous(), "disk I/O needs contiguous CPU memory"
        return buf.view(torch.uint8).reshape(-1).numpy()
    a = np.frombuffer(buf, dtype=np.uint8) if not isinstance(buf, np.ndarray) else buf
    assert a.flags.c_contiguous, "disk I/O needs contiguous memory"
    return a.reshape(-1).view(np.uint8)


class DiskPool:
    """``num_blocks`` blocks in an unnamed file under ``directory``, ``block_bytes``
    each. ``directory`` is created if missing; ``auto`` is the private per-user
    directory of :func:`kvdist.paths.default_disk_dir`."""

    def __init__(self, layout: KVLayout, num_blocks: int, directory: str, rank: int, *,
                 io_threads: int = 4, o_direct: bool = False, max_read_bytes_per_s: int = 0):
        assert io_threads > 0, f"io_threads must be > 0, got {io_threads}"
        assert num_blocks > 0, f"a disk tier needs at least one block, got {num_blocks}"
        self.layout = layout
        self.num_blocks = num_blocks
        self.block_bytes = layout.bytes_per_block
        self.io_threads = io_threads
        self.fd: int | None = None
        self._direct_fd: int | None = None
        self.directory: str | None = None
        self.path: str | None = None  # a description: the file itself has no name
        self.direct_refused: str | None = None
        self.bytes_written = self.bytes_read = 0
        # A throttle for drills (cache.disk.max_read_bytes_per_s): reads share one
        # timeline on which each run reserves nbytes / rate seconds, and ends no earlier.
        self.max_read_bytes_per_s = max_read_bytes_per_s
        self._read_free_at = 0.0
        self._throttle_lock = threading.Lock()
        self._local = threading.local()
        # O_DIRECT offsets and lengths must be aligned: pad each slot to the alignment.
        self.stride = (-(-self.block_bytes // DIRECT_ALIGN) * DIRECT_ALIGN if o_direct
                       else self.block_bytes)
        self._pool: ThreadPoolExecutor | None = None  # writes
        self._readers: ThreadPoolExecutor | None = None  # reads: never queued behind writes
        try:
            self._create(directory, rank)
            if o_direct:
                self._open_direct()
        except BaseException:
            self.close()
            raise
        self._pool = ThreadPoolExecutor(io_threads, thread_name_prefix="kvdist-disk",
                                        initializer=self.run_inline_here)
        self._readers = ThreadPoolExecutor(io_threads, thread_name_prefix="kvdist-disk-read",
                                           initializer=self.run_inline_here)

    # -- start -------------------------------------------------------------------------------
    def _create(self, directory: str, rank: int) -> None:
        want = self.num_blocks * self.stride
        directory = paths.resolve_disk_dir(directory)
        try:
            paths.prepare_disk_dir(directory)
            free = paths.free_bytes(directory)
        except OSError as e:
            raise KVDistError(f"disk tier: cannot use {directory}: {e.strerror or e}") from e
        problem = paths.files_problem(directory)
        if problem is not None:
            raise KVDistError(f"disk tier: {problem} ({want} bytes asked, {free} bytes free)")
        if want > free:
            raise KVDistError(f"disk tier: {directory} is too full: {want} bytes asked, {free} bytes free")
        try:
            self.fd = paths.open_unnamed(directory)
        except OSError as e:
            raise KVDistError(f"disk tier: {directory} is not writable: {e.strerror} "
                              f"({want} bytes asked, {free} bytes free)") from e
        self.directory = directory
        self.path = f"{directory}/<rank {rank}'s unnamed file, fd {self.fd}>"
        try:
            os.posix_fallocate(self.fd, 0, want)
        except OSError as e:
            what = "is full" if e.errno in _FULL else "cannot preallocate the file"
            raise KVDistError(f"disk tier: {directory} {what}: {e.strerror} ({want} bytes asked, "
                              f"{paths.free_bytes(directory)} bytes free)") from e
        paths.reserve(self.fd, want)

    def _open_direct(self) -> None:
        if not hasattr(os, "O_DIRECT"):
            self.direct_refused = "this platform has no O_DIRECT"
        else:
            try:  # a second open file description of the unnamed file, with O_DIRECT
                fd = os.open(f"/proc/self/fd/{self.fd}", os.O_RDWR | os.O_DIRECT | os.O_CLOEXEC)
            except OSError as e:
                self.direct_refused = f"the filesystem refuses O_DIRECT ({e.strerror})"
            else:
                # Some filesystems accept the flag and refuse the I/O: probe one read.
                try:
                    os.preadv(fd, [self._bounce(DIRECT_ALIGN)[:DIRECT_ALIGN]], 0)
                    self._direct_fd = fd
                except OSError as e:
                    os.close(fd)
                    self.direct_refused = f"the filesystem refuses O_DIRECT I/O ({e.strerror})"
        if self.direct_refused:
            log.warning("disk tier %s: %s; using buffered I/O", self.path, self.direct_refused)

    @property
    def direct(self) -> bool:
        return self._direct_fd is not None

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.block_bytes

    def run_inline_here(self) -> None:
        """Batch calls made from the calling thread run in that thread, one run of slots
        after the other, not split over the pool's workers: for threads that are disk
        workers themselves (the pool's own, the CUDA executor's). Each hop to another thread costs the
        process's other threads GIL hand-offs, the step's host thread among them."""
        self._local.worker = True

    # -- one run of neighbouring slots ---------------------------------------------------------
    def _bounce(self, nbytes: int) -> np.ndarray:
        """This thread's page-aligned scratch buffer of at least ``nbytes``."""
        buf = getattr(self._local, "bounce", None)
        if buf is None or len(buf) < nbytes:
            buf = np.frombuffer(mmap.mmap(-1, max(nbytes, MAX_RUN_BYTES)), dtype=np.uint8)
            self._local.bounce = buf
        return buf

    def _aligned(self, arrays: list[np.ndarray]) -> bool:
        return self.stride == self.block_bytes and all(
            a.ctypes.data % DIRECT_ALIGN == 0 for a in arrays)

    def _io(self, writing: bool, slot: int, arrays: list[np.ndarray]) -> None:
        """Move the blocks of ``arrays`` to/from the consecutive slots from ``slot``."""
        off = slot * self.stride
        if self._direct_fd is None:
            self._vectored(writing, self.fd, arrays, off)
        elif self._aligned(arrays):
            self._vectored(writing, self._direct_fd, arrays, off)
        else:
            n, s = len(arrays), self.stride
            view = self._bounce(n * s)[:n * s]
            rows = view.reshape(n, s)[:, :self.block_bytes]
            if writing:
                for a, row in zip(arrays, rows):
                    np.copyto(row, a)
            self._vectored(writing, self._direct_fd, [view], off)
            if not writing:
                for a, row in zip(arrays, rows):
                    np.copyto(a, row)

    def _vectored(self, writing: bool, fd: int, arrays: list[np.ndarray], off: int) -> None:
        call = os.pwritev if writing else os.preadv
        want = sum(len(a) for a in arrays)
        pos = 0
        while True:
            n = call(fd, arrays, off + pos)
            pos += n
            if pos == want:
                return
            if n <= 0:
                what = "write to" if writing else "read from"
                raise KVDistError(f"disk tier {self.path}: short {what} offset {off}: {pos} of {want} bytes")
            # A short transfer (rare on regular files): continue where it stopped.
            while n >= len(arrays[0]):
                n -= len(arrays[0])
                arrays = arrays[1:]
            arrays = [arrays[0][n:], *arrays[1:]]

    # -- batches ---------------------------------------------------------------------------------
    def _plan(self, slots: Sequence[int], buffers: Sequence) -> list[list[tuple[int, list[np.ndarray]]]]:
        """Runs of neighbouring slots, grouped into at most ``io_threads`` groups of
        about equal bytes."""
        assert len(slots) == len(buffers), f"{len(slots)} slots but {len(buffers)} buffers"
        arrays = [as_bytes(b) for b in buffers]
        for a in arrays:
            assert len(a) == self.block_bytes, f"a block buffer has {len(a)} bytes, not {self.block_bytes}"
        order = np.argsort(np.asarray(slots, dtype=np.int64), kind="stable")
        total = len(order) * self.stride
        per_run = min(MAX_RUN_BYTES, -(-total // self.io_threads)) // self.stride
        per_run = max(1, min(IOV_MAX, per_run))
        runs: list[tuple[int, list[np.ndarray]]] = []
        prev = None
        for i in order.tolist():
            s = int(slots[i])
            assert 0 <= s < self.num_blocks, f"disk slot {s} outside 0..{self.num_blocks - 1}"
            if prev is not None and s == prev + 1 and len(runs[-1][1]) < per_run:
                runs[-1][1].append(arrays[i])
            else:
                runs.append((s, [arrays[i]]))
            prev = s
        share = -(-len(runs) // self.io_threads)
        return [runs[i:i + share] for i in range(0, len(runs), share)]

    def _run_group(self, writing: bool, group: list[tuple[int, list[np.ndarray]]]) -> None:
        for slot, arrays in group:
            self._io(writing, slot, arrays)
            if not writing and self.max_read_bytes_per_s:
                self._throttle(len(arrays) * self.block_bytes)

    def _throttle(self, nbytes: int) -> None:
        with self._throttle_lock:
            now = time.monotonic()
            self._read_free_at = max(now, self._read_free_at) + nbytes / self.max_read_bytes_per_s
            delay = self._read_free_at - now
        time.sleep(delay)

    @staticmethod
    def _last_writes(slots: Sequence[int], buffers: Sequence) -> tuple[Sequence[int], Sequence]:
        """A batch that writes a slot twice means what it would one by one, in order:
        the last write wins (threads must not race on the slot)."""
        if len(set(slots)) == len(slots):
            return slots, buffers
        last = {int(s): i for i, s in enumerate(slots)}
        keep = sorted(last.values())
        return [slots[i] for i in keep], [buffers[i] for i in keep]

    def _start(self, writing: bool, slots: Sequence[int], buffers: Sequence) -> Future:
        if writing:
            slots, buffers = self._last_writes(slots, buffers)
        groups = self._plan(slots, buffers)
        nbytes = len(slots) * self.block_bytes
        done: Future = Future()
        if not groups:
            done.set_result(None)
            return done
        left = [len(groups)]
        lock = threading.Lock()
        errors: list[BaseException] = []

        def finished(f: Future) -> None:
            with lock:
                if f.exception() is not None:
                    errors.append(f.exception())
                left[0] -= 1
                last = left[0] == 0
            if last:
                if errors:
                    done.set_exception(errors[0])
                else:
                    self._count(writing, nbytes)
                    done.set_result(None)

        pool = self._pool if writing else self._readers  # a read the step needs never waits for writes
        for g in groups:
            pool.submit(self._run_group, writing, g).add_done_callback(finished)
        return done

    def _count(self, writing: bool, nbytes: int) -> None:
        if writing:
            self.bytes_written += nbytes
        else:
            self.bytes_read += nbytes

    def _inline(self, writing: bool, slots: Sequence[int], buffers: Sequence) -> None:
        for g in self._plan(slots, buffers):
            self._run_group(writing, g)
        self._count(writing, len(slots) * self.block_bytes)

    def start_writes(self, slots: Sequence[int], buffers: Sequence) -> Future:
        """Write ``buffers[i]`` into disk slot ``slots[i]`` on the worker threads; the
        future completes when all are written. Buffers must stay alive until then."""
        return self._start(True, slots, buffers)

    def start_reads(self, slots: Sequence[int], buffers: Sequence) -> Future:
        """Read disk slot ``slots[i]`` into ``buffers[i]`` on the worker threads."""
        return self._start(False, slots, buffers)

    def write_blocks(self, slots: Sequence[int], buffers: Sequence) -> None:
        """Write a batch and return when it is written (page cache, not necessarily
        the device: see ``sync``)."""
        if getattr(self._local, "worker", False) or len(slots) <= 1:
            return self._inline(True, *self._last_writes(slots, buffers))
        self.start_writes(slots, buffers).result()

    def read_blocks(self, slots: Sequence[int], buffers: Sequence) -> None:
        """Read a batch and return when every buffer is filled."""
        if getattr(self._local, "worker", False) or len(slots) <= 1:
            return self._inline(False, slots, buffers)
        self.start_reads(slots, buffers).result()

    def submit(self, fn: Callable, *args, **kwargs) -> Future:
        """Run ``fn`` on the disk worker threads (batch calls made from there run inline)."""
        return self._pool.submit(fn, *args, **kwargs)

    # -- a single block (tests) ---------------------------------------------------------------
    def read(self, slot: int, buf) -> None:
        """Read the block in ``slot`` into a writable bytes-like of ``block_bytes``."""
        self._inline(False, [slot], [buf])

    def check_invariants(self) -> None:
        if self.path is None:
            assert self.fd is None and self._direct_fd is None and self._pool is self._readers is None, \
                "a closed pool still holds files or threads"
            return
        assert os.fstat(self.fd).st_size >= self.num_blocks * self.stride, "the file lost its preallocation"
        assert self.stride >= self.block_bytes, "slots overlap"
        assert self._direct_fd is None or self.stride % DIRECT_ALIGN == 0, "O_DIRECT slots must be aligned"

    # -- durability and teardown ---------------------------------------------------------------
    def sync(self) -> None:
        """Push written blocks to the device (fdatasync)."""
        os.fdatasync(self.fd)

    def drop_page_cache(self) -> None:
        """Ask the kernel to forget the file's cached pages (after ``sync``), so the next
        reads come from the device; benchmarks use it to measure the disk, not RAM."""
        os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)

    def close(self) -> None:
        """Stop the workers and close the file, which frees its space (idempotent)."""
        for pool in (self._pool, self._readers):
            if pool is not None:
                pool.shutdown(wait=True)
        self._pool = self._readers = None
        for name in ("_direct_fd", "fd"):
            fd = getattr(self, name)
            if fd is not None:
                paths.release(fd)
                os.close(fd)
                setattr(self, name, None)
        self.path = None
