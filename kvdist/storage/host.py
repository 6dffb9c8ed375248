"""The host tier: ``num_blocks`` blocks of host memory, pinned when CUDA exists.

Allocated the fast way (docs/design.md, "Tiers, slots and blocks"): one anonymous ``mmap``; pages populated by
parallel threads (``MADV_POPULATE_WRITE``, touching one byte a page where the kernel
lacks it); then ``cudaHostRegister`` in bounded chunks, each chunk registered as soon
as its pages are in, so faulting and registering overlap and no single driver call
holds the driver's locks for long. A failure on the way undoes every registration
and unmaps before the error leaves. Running out of memory, the memlock limit and a
registration error become :class:`HostTierUnavailable` (USE_NO_HOST in consensus).

With ``shared_path`` the memory is a file in a shared-memory file system (/dev/shm),
mapped shared, so other processes of the node can map the same pages (the remote
tier's one-node path). Its pages are reserved with ``posix_fallocate`` first: a
/dev/shm too small (containers cap it) shows as :class:`SharedMemoryUnavailable` at
start, never as SIGBUS later; a host pool then falls back to private memory."""

from __future__ import annotations

import ctypes
import errno
import logging
import math
import mmap
import os
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import torch
from tqdm import tqdm

from ..errors import HostTierUnavailable
from ..layout import KVLayout
from ..units import GiB, gib
from .host_sizing import HostLimits, read_limits
from .pinning import CudaRegistrar, Registrar, RegistrationError

log = logging.getLogger("kvdist.host")

PAGE = mmap.PAGESIZE
HUGE_PAGE = 2 << 20
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)  # Linux 5.14+
MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", 14)
MADV_DONTFORK = getattr(mmap, "MADV_DONTFORK", 10)
# madvise errors that mean "the node could not give the pages".
_OUT_OF_MEMORY = {errno.ENOMEM, errno.EAGAIN, errno.EFAULT, 133}  # 133: EHWPOISON
PROGRESS_MIN_BYTES = GiB

_libc = ctypes.CDLL(None, use_errno=True)
_libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
_libc.madvise.restype = ctypes.c_int


def _madvise(addr: int, nbytes: int, advice: int) -> int:
    """0 or the errno; through ctypes, which drops the GIL, so threads run in parallel
    (Python's ``mmap.madvise`` holds it)."""
    while True:
        if _libc.madvise(addr, nbytes, advice) == 0:
            return 0
        err = ctypes.get_errno()
        if err != errno.EINTR:
            return err


def default_threads() -> int:
    return max(1, min(16, len(os.sched_getaffinity(0))))


def _gib(n: int) -> str:
    return f"{gib(n)} ({n} bytes)"


@dataclass(slots=True)
class PinTimings:
    """Where the start-up time went (seconds); ``longest_call_s`` is the longest single
    registration call, the time one call can hold the driver."""

    method: str = ""
    map_s: float = 0.0
    prefault_s: float = 0.0
    register_s: float = 0.0
    longest_call_s: float = 0.0
    total_s: float = 0.0
    chunks: int = 0


class SharedMemoryUnavailable(OSError):
    """The shared-memory file could not be created at full size (/dev/shm too small)."""


class HostMemory:
    """``nbytes`` of page-aligned host memory as a 1-D uint8 tensor ``flat``.

    ``registrar`` None means plain (prefaulted) memory. ``align`` is the unit chunk
    boundaries fall on (a block, so no block straddles two registrations).
    ``shared_path``: back the memory by that file, mapped shared — created (it must not
    exist; removed again at close unless ``unlink`` ran first) or, with ``attach``,
    another process's file opened as it is (no prefault: its pages exist)."""

    def __init__(self, nbytes: int, *, registrar: Registrar | None = None, chunk_bytes: int = GiB,
                 align: int = 1, threads: int = 0, limits: HostLimits | None = None,
                 check_memlock: bool = True, huge_pages: bool = True, progress: bool | None = None,
                 prefault: str = "auto", shared_path: str | None = None, attach: bool = False):
        assert nbytes > 0, f"nbytes must be > 0, got {nbytes}"
        assert prefault in ("auto", "madvise", "touch"), f"unknown prefault method {prefault!r}"
        self.nbytes = nbytes
        self.registrar = registrar
        self.threads = threads or default_threads()
        self.timings = PinTimings()
        self.chunks = self._chunks(nbytes, chunk_bytes, math.lcm(align, PAGE))
        self.registered: list[int] = []  # offsets of registered chunks, in order
        self._mm: mmap.mmap | None = None
        self.flat: torch.Tensor | None = None
        self.addr = 0
        self.shared_path = shared_path
        self._owns_file = False  # this process created shared_path and has not unlinked it
        if not attach:
            self._check_limits(limits or read_limits(), check_memlock)
        t0 = time.perf_counter()
        try:
            self._map(huge_pages, attach)
            self.timings.map_s = time.perf_counter() - t0
            self._populate_and_register(prefault, progress, populate=not attach)
        except BaseException:
            self.close()
            raise
        self.timings.total_s = time.perf_counter() - t0

    @staticmethod
    def _chunks(nbytes: int, chunk_bytes: int, unit: int) -> list[tuple[int, int]]:
        step = max(unit, chunk_bytes // unit * unit)
        return [(off, min(step, nbytes - off)) for off in range(0, nbytes, step)]

    def _check_limits(self, limits: HostLimits, check_memlock: bool) -> None:
        what = "pinned " if self.registrar is not None else ""
        if self.nbytes > limits.available:
            raise HostTierUnavailable(
                f"a {what}host tier of {_gib(self.nbytes)} was asked but the node has "
                f"{_gib(limits.available)} available (MemAvailable): limit hit: available memory")
        if self.registrar is not None and check_memlock and limits.memlock is not None \
                and self.nbytes > limits.memlock:
            raise HostTierUnavailable(
                f"a pinned host tier of {_gib(self.nbytes)} was asked but RLIMIT_MEMLOCK allows "
                f"{_gib(limits.memlock)}: limit hit: memlock (raise `ulimit -l`, e.g. docker "
                f"--ulimit memlock=-1, or set cache.host.check_memlock: false where the CUDA "
                f"driver does not charge pinned memory to it)")

    def _open_shared(self, attach: bool) -> int:
        """The file descriptor of the shared file, created at full size unless ``attach``."""
        path = self.shared_path
        if attach:
            fd = os.open(path, os.O_RDWR)
            if os.fstat(fd).st_size < self.nbytes:
                os.close(fd)
                raise OSError(errno.EINVAL, f"{path} is smaller than {self.nbytes} bytes")
            return fd
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as e:
            raise SharedMemoryUnavailable(e.errno, f"cannot create {path}: {e.strerror}") from None
        self._owns_file = True
        try:
            os.posix_fallocate(fd, 0, self.nbytes)
        except OSError as e:
            os.close(fd)
            self.unlink()
            free = os.statvfs(os.path.dirname(path) or ".")
            raise SharedMemoryUnavailable(
                e.errno, f"cannot reserve {_gib(self.nbytes)} in {path} ({e.strerror}; "
                f"{_gib(free.f_bavail * free.f_frsize)} free there)") from None
        return fd

    def unlink(self) -> None:
        """Remove the shared file's name (the mapping stays valid in every process that
        has it mapped); idempotent."""
        if self._owns_file:
            self._owns_file = False
            try:
                os.unlink(self.shared_path)
            except FileNotFoundError:
                pass

    def _map(self, huge_pages: bool, attach: bool = False) -> None:
        try:
            if self.shared_path is None:
                self._mm = mmap.mmap(-1, self.nbytes, flags=mmap.MAP_PRIVATE,
                                     prot=mmap.PROT_READ | mmap.PROT_WRITE)
            else:
                fd = self._open_shared(attach)
                try:
                    self._mm = mmap.mmap(fd, self.nbytes, flags=mmap.MAP_SHARED,
                                         prot=mmap.PROT_READ | mmap.PROT_WRITE)
                finally:
                    os.close(fd)
        except OSError as e:
            if e.errno != errno.ENOMEM or isinstance(e, SharedMemoryUnavailable):
                raise
            raise HostTierUnavailable(
                f"cannot map a host tier of {_gib(self.nbytes)}: {e.strerror} (available "
                f"{_gib(read_limits().available)}): limit hit: mmap (virtual memory / overcommit)") from e
        self.flat = torch.frombuffer(self._mm, dtype=torch.uint8)
        self.addr = self.flat.data_ptr()
        # Advice only: a kernel without THP or DONTFORK still gives correct memory.
        if huge_pages:
            _madvise(self.addr, self.nbytes, MADV_HUGEPAGE)
        if self.registrar is not None:
            _madvise(self.addr, self.nbytes, MADV_DONTFORK)  # a fork must not COW pinned pages

    def _pieces(self, off: int, size: int) -> list[tuple[int, int]]:
        n = max(1, min(self.threads, size // HUGE_PAGE))
        step = -(-size // n // HUGE_PAGE) * HUGE_PAGE if size >= HUGE_PAGE else size
        return [(o, min(step, off + size - o)) for o in range(off, off + size, step)]

    def _prefault_piece(self, off: int, size: int, method: str) -> None:
        if method == "touch":
            self.flat[off:off + size:PAGE].fill_(0)
            return
        err = _madvise(self.addr + off, size, MADV_POPULATE_WRITE)
        if err in _OUT_OF_MEMORY:
            raise HostTierUnavailable(
                f"prefaulting a host tier of {_gib(self.nbytes)} failed at offset {off}: "
                f"{os.strerror(err)} (available {_gib(read_limits().available)}): "
                f"limit hit: memory (the node ran out of pages)")
        if err:
            raise OSError(err, f"madvise(MADV_POPULATE_WRITE) at offset {off}: {os.strerror(err)}")

    def _method(self, prefault: str) -> str:
        if prefault != "auto":
            return prefault
        # One page tells whether the kernel knows MADV_POPULATE_WRITE (EINVAL: older than 5.14).
        err = _madvise(self.addr, PAGE, MADV_POPULATE_WRITE)
        return "touch" if err == errno.EINVAL else "madvise"

    def _populate_and_register(self, prefault: str, progress: bool | None,
                               populate: bool = True) -> None:
        t = self.timings
        t.method = self._method(prefault) if populate else "none"
        t.chunks = len(self.chunks)
        show = progress if progress is not None else (
            self.nbytes > PROGRESS_MIN_BYTES and sys.stderr.isatty())
        desc = "pinning host tier" if self.registrar is not None else "prefaulting host tier"
        t0 = time.perf_counter()
        pool = ThreadPoolExecutor(self.threads, thread_name_prefix="kvdist-prefault")
        try:
            # Submitted in chunk order: the threads fault chunk k+1 while chunk k registers.
            futures: list[list[Future]] = [
                [pool.submit(self._prefault_piece, o, s, t.method) for o, s in self._pieces(off, size)]
                if populate else [] for off, size in self.chunks]
            with tqdm(total=self.nbytes, desc=desc, unit="B", unit_scale=True, unit_divisor=1024,
                      disable=not show, leave=False) as bar:
                for (off, size), pending in zip(self.chunks, futures):
                    for f in pending:
                        f.result()
                    t.prefault_s = time.perf_counter() - t0
                    if self.registrar is not None:
                        self._register(off, size)
                    bar.update(size)
        finally:
            pool.shutdown(wait=True, cancel_futures=True)

    def _register(self, off: int, size: int) -> None:
        t = self.timings
        c0 = time.perf_counter()
        try:
            self.registrar.register(self.addr + off, size)
        except RegistrationError as e:
            raise HostTierUnavailable(
                f"registering a pinned host tier of {_gib(self.nbytes)} with CUDA failed at chunk "
                f"{len(self.registered)} of {len(self.chunks)} (offset {off}, {_gib(size)}; "
                f"{len(self.registered)} chunks were registered and are undone; available "
                f"{_gib(read_limits().available)}): {e}: limit hit: CUDA host registration") from e
        dt = time.perf_counter() - c0
        self.registered.append(off)
        t.register_s += dt
        t.longest_call_s = max(t.longest_call_s, dt)

    @property
    def pinned(self) -> bool:
        return bool(self.registered) and len(self.registered) == len(self.chunks)

    def check_invariants(self) -> None:
        assert sum(s for _, s in self.chunks) == self.nbytes, "chunks must cover the memory exactly"
        if self._mm is None:
            assert not self.registered, "registered chunks outlived the mapping"
        elif self.registrar is not None:
            assert self.registered == [o for o, _ in self.chunks], "every chunk must be registered in order"
        else:
            assert not self.registered, "plain memory must not be registered"

    def close(self) -> None:
        """Unregister every registered chunk, then unmap (idempotent; safe after a
        failed start). The first unregistration error is raised after all are tried."""
        failed: Exception | None = None
        while self.registered:
            off = self.registered.pop()
            try:
                self.registrar.unregister(self.addr + off)
            except Exception as e:  # keep undoing the others
                failed = failed or e
        self.flat = None
        if self._mm is not None:
            # Never mm.close(): tensors from torch.frombuffer do not pin the mapping, and
            # a view that outlived close() would read unmapped memory. The tensors' storage
            # holds the mmap object; it unmaps when the last view is gone (here, or once an
            # executor's or the caller's views go: nothing is wrong, so nothing is said).
            if sys.getrefcount(self._mm) > 2:
                log.debug("host tier memory is still referenced at close: unmapped when the "
                          "last view of it is released")
            self._mm = None
        self.unlink()
        if failed is not None:
            raise failed


class HostPool:
    """``raw[block, bytes]`` uint8 host memory. Pinned when ``pin`` (CUDA registration
    on ``device``, or through ``registrar`` when one is injected) so that copies to and
    from the GPU are asynchronous DMA.

    Registration is per chunk of ``chunk_blocks`` blocks, and the CUDA driver refuses
    (cudaErrorInvalidValue) a copy whose host range spans two registrations: a copy
    that merges neighbouring blocks must break at multiples of ``chunk_blocks``.

    ``shared_path``: keep the blocks in that shared-memory file (see the module
    docstring) so peers on the node can map them; when it cannot be had at full size
    the pool uses private memory and says why in ``shared_error`` (``shared_path`` is
    then None). ``attach``: map another process's pool file instead (a peer's view)."""

    def __init__(self, layout: KVLayout, num_blocks: int, pin: bool, *, device: torch.device | None = None,
                 chunk_bytes: int = GiB, prefault_threads: int = 0, check_memlock: bool = True,
                 huge_pages: bool = True, registrar: Registrar | None = None,
                 limits: HostLimits | None = None, progress: bool | None = None, rank: int = 0,
                 shared_path: str | None = None, attach: bool = False):
        self.layout = layout
        self.num_blocks = num_blocks
        bpb = layout.bytes_per_block
        if pin and registrar is None:
            registrar = CudaRegistrar(device if device is not None else torch.device("cuda"))
        if progress is None and rank == 0 and num_blocks * bpb > PROGRESS_MIN_BYTES:
            progress = True
        self.shared_error: str | None = None
        args = dict(registrar=registrar if pin else None, chunk_bytes=chunk_bytes, align=bpb,
                    threads=prefault_threads, limits=limits, check_memlock=check_memlock,
                    huge_pages=huge_pages, progress=progress and not attach)
        try:
            self.memory = HostMemory(num_blocks * bpb, shared_path=shared_path, attach=attach, **args)
        except SharedMemoryUnavailable as e:
            assert not attach, "attaching never reserves"
            self.shared_error = str(e)
            self.memory = HostMemory(num_blocks * bpb, **args)
        self.raw = self.memory.flat.view(num_blocks, bpb)
        self.chunk_blocks = self.memory.chunks[0][1] // bpb
        if self.memory.registrar is not None:
            log.info("host tier: %s pinned in %.2f s (%d chunks via %s, longest call %.3f s)",
                     _gib(self.nbytes), self.memory.timings.total_s, len(self.memory.chunks),
                     self.memory.registrar.name, self.memory.timings.longest_call_s)

    @property
    def nbytes(self) -> int:
        return self.num_blocks * self.layout.bytes_per_block

    @property
    def pinned(self) -> bool:
        return self.memory.pinned

    @property
    def shared_path(self) -> str | None:
        """The shared-memory file holding the blocks (None: private memory)."""
        return self.memory.shared_path

    def check_invariants(self) -> None:
        self.memory.check_invariants()

    def close(self) -> None:
        self.raw = None
        self.memory.close()
