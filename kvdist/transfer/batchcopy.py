"""Batched block copies between pinned host memory and CUDA memory: every block of a
batch goes out in one submission, on the copy engines (DMA), not in a copy kernel
that would take SMs from attention.

Paths, fastest first (``BatchCopier.path`` names the one a batch takes):

* ``memcpy-batch``: ``cudaMemcpyBatchAsync`` (CUDA runtime >= 12.8). Called through
  ctypes on the runtime library this process already loaded (torch's), the pointer
  arrays go to the driver straight from numpy: no Python work per block. The C
  signature changed: 12.8/12.9 take ``size_t *failIdx`` before the stream, 13.x
  dropped it; the runtime's own version decides. Without a loadable runtime library
  the same call goes through cuda-bindings (``cuda.bindings.runtime``), whose Python
  signature is the same in 12.9 and 13 (``failIdx`` is returned in 12.x, absent in 13).
* ``runs``: one ``cudaMemcpyAsync`` per run of copies whose source and destination
  slots are both consecutive.
* ``per-block``: one copy per block; the naive design, kept as the last resort and
  as the benchmark's baseline.

Every path first coalesces runs of adjacent slots (numpy, vectorized). Copies inside
one batch have no order: the transfer engine never puts two copies that touch the
same slot into one batch (rule S2)."""

from __future__ import annotations

import ctypes
import importlib.metadata
import logging
from collections import Counter

import numpy as np
import torch

from .. import cudart

__all__ = ["PATHS", "BatchCopier", "bindings_version", "coalesce"]

log = logging.getLogger("kvdist.transfer")

PATHS = ("memcpy-batch", "runs", "per-block")

# cudaMemcpySrcAccessOrderStream, cudaMemcpyFlagPreferOverlapWithCompute, cudaMemcpyDefault
_SRC_ACCESS_ORDER_STREAM = 1
_FLAG_PREFER_OVERLAP_WITH_COMPUTE = 1
_MEMCPY_DEFAULT = 4


class _MemLocation(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _MemcpyAttributes(ctypes.Structure):
    """``struct cudaMemcpyAttributes`` (driver_types.h, CUDA 12.8 and 13.x)."""

    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _MemLocation),
                ("dstLocHint", _MemLocation), ("flags", ctypes.c_uint)]


def coalesce(src: np.ndarray, dst: np.ndarray, src_chunk: int = 0,
             dst_chunk: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Runs of copies whose source and destination slots are both consecutive:
    ``(first source slot, first destination slot, blocks)`` per run, by source slot.
    A run never crosses a multiple of ``src_chunk`` / ``dst_chunk`` (when nonzero): a
    host tier registered with CUDA in chunks refuses a DMA copy spanning two of them."""
    if len(src) <= 1:
        return src, dst, np.ones(len(src), dtype=np.int64)
    order = np.argsort(src, kind="stable")
    s, d = src[order], dst[order]
    cut = (s[1:] != s[:-1] + 1) | (d[1:] != d[:-1] + 1)
    if src_chunk:
        cut |= s[1:] % src_chunk == 0
    if dst_chunk:
        cut |= d[1:] % dst_chunk == 0
    breaks = np.flatnonzero(cut) + 1
    starts = np.concatenate(([0], breaks))
    lengths = np.diff(np.append(starts, len(s)))
    return s[starts], d[starts], lengths


def bindings_version() -> str | None:
    try:
        return importlib.metadata.version("cuda-bindings")
    except importlib.metadata.PackageNotFoundError:
        return None


class BatchCopier:
    """Runs a batch of whole-block copies ``dst_rows[d] <- src_rows[s]`` on a stream.
    ``prefer`` forces a path (tests, benchmarks); otherwise the fastest available."""

    def __init__(self, device: torch.device, prefer: str | None = None):
        assert prefer is None or prefer in PATHS, f"unknown copy path {prefer!r}"
        torch.cuda.init()
        self.device = device
        self.lib, self.lib_path = cudart.load()
        self.runtime_version = self._runtime_version()
        self.batch_api: str | None = None  # "ctypes" | "cuda-bindings"
        self._batch = self._find_batch()
        self._memcpy = self._find_memcpy()
        best = "memcpy-batch" if self._batch is not None else "runs"
        if prefer == "memcpy-batch" and self._batch is None:
            log.warning("cudaMemcpyBatchAsync is not available (runtime %s); using runs",
                        self.runtime_version)
            prefer = None
        self.path = prefer or best
        self.batches: Counter[str] = Counter()  # batches per path
        self.api_calls: Counter[str] = Counter()  # CUDA copy calls per path
        self.blocks = 0
        self.entries = 0  # copies handed to the driver (a run or a layer group's slice each)

    # -- discovery ---------------------------------------------------------------------------
    def _runtime_version(self) -> int:
        if self.lib is not None:
            v = ctypes.c_int(0)
            if self.lib.cudaRuntimeGetVersion(ctypes.byref(v)) == 0:
                return v.value
        return 0

    def _find_batch(self):
        attrs = _MemcpyAttributes()
        attrs.srcAccessOrder = _SRC_ACCESS_ORDER_STREAM
        attrs.flags = _FLAG_PREFER_OVERLAP_WITH_COMPUTE
        idx = (ctypes.c_size_t * 1)(0)
        fn = getattr(self.lib, "cudaMemcpyBatchAsync", None) if self.lib is not None else None
        if fn is not None and self.runtime_version >= 12080:
            vp, sz = ctypes.c_void_p, ctypes.c_size_t
            fn.restype = ctypes.c_int
            if self.runtime_version >= 13000:
                fn.argtypes = [vp, vp, vp, sz, vp, vp, sz, vp]

                def call(dsts, srcs, sizes, n, stream):
                    return fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n,
                              ctypes.addressof(attrs), ctypes.addressof(idx), 1, stream)
            else:
                fn.argtypes = [vp, vp, vp, sz, vp, vp, sz, vp, vp]
                fail = ctypes.c_size_t(0)

                def call(dsts, srcs, sizes, n, stream):
                    return fn(dsts.ctypes.data, srcs.ctypes.data, sizes.ctypes.data, n,
                              ctypes.addressof(attrs), ctypes.addressof(idx), 1,
                              ctypes.addressof(fail), stream)
            self.batch_api = "ctypes"
            return call
        return self._find_bindings_batch()

    def _find_bindings_batch(self):
        try:
            from cuda.bindings import runtime as rt
        except ImportError:
            return None
        if not hasattr(rt, "cudaMemcpyBatchAsync"):
            return None
        attr = rt.cudaMemcpyAttributes()
        attr.srcAccessOrder = rt.cudaMemcpySrcAccessOrder.cudaMemcpySrcAccessOrderStream
        attr.flags = _FLAG_PREFER_OVERLAP_WITH_COMPUTE

        def call(dsts, srcs, sizes, n, stream):
            # 12.9 returns (err, failIdx), 13.x returns (err,).
            result = rt.cudaMemcpyBatchAsync(dsts.tolist(), srcs.tolist(), sizes.tolist(), n,
                                             [attr], [0], 1, stream)
            return int(result[0])
        self.batch_api = "cuda-bindings"
        return call

    def _find_memcpy(self):
        fn = getattr(self.lib, "cudaMemcpyAsync", None) if self.lib is not None else None
        if fn is None:
            return None
        vp = ctypes.c_void_p
        fn.restype = ctypes.c_int
        fn.argtypes = [vp, vp, ctypes.c_size_t, ctypes.c_int, vp]
        return fn

    def describe(self) -> dict:
        """What this process can use (printed by the GPU probe and the benchmark)."""
        return {"path": self.path, "batch_api": self.batch_api, "runtime_version": self.runtime_version,
                "libcudart": self.lib_path, "cuda_bindings": bindings_version()}

    # -- copying -----------------------------------------------------------------------------
    def copy(self, stream: torch.cuda.Stream, src_rows: torch.Tensor, dst_rows: torch.Tensor,
             src: np.ndarray, dst: np.ndarray, *, src_chunk: int = 0,
             dst_chunk: int = 0) -> str:
        """Queue ``dst_rows[dst[i]] <- src_rows[src[i]]`` on ``stream`` (rows of a 2-D
        uint8 tensor: whole blocks, or the same byte range of every block, a strided
        view, whose rows are never merged); returns the path taken. ``*_chunk``: rows
        per CUDA registration of that side (0: one allocation), see ``coalesce``."""
        path = self.path
        n = len(src)
        if n == 0:
            return path
        self.blocks += n
        if path == "per-block":
            with torch.cuda.stream(stream):
                for s, d in zip(src.tolist(), dst.tolist()):
                    dst_rows[d].copy_(src_rows[s], non_blocking=True)
            self.entries += n
            self._count(path, n)
            return path
        size = src_rows.shape[1]
        assert dst_rows.shape[1] == size and src_rows.stride(1) == dst_rows.stride(1) == 1, "rows differ"
        ps, pd = src_rows.stride(0), dst_rows.stride(0)  # row pitches: size, or a block's for a slice
        if ps == pd == size:
            s0, d0, length = coalesce(src, dst, src_chunk, dst_chunk)
        else:
            s0, d0, length = src, dst, np.ones(len(src), dtype=np.int64)
        if path == "memcpy-batch" and self._batch is not None:
            srcs = (src_rows.data_ptr() + s0 * ps).astype(np.uint64)
            dsts = (dst_rows.data_ptr() + d0 * pd).astype(np.uint64)
            sizes = (length * size).astype(np.uint64)
            err = self._batch(dsts, srcs, sizes, len(sizes), stream.cuda_stream)
            if err == 0:
                self.entries += len(sizes)
                self._count(path, 1)
                return path
            # Not supported here after all (e.g. an older driver): never try it again.
            log.warning("cudaMemcpyBatchAsync failed with CUDA error %d; using runs from now on", err)
            self._batch = None
            self.path = "runs"
        self._runs(stream, src_rows, dst_rows, s0, d0, length)
        self.entries += len(length)
        self._count("runs", len(length))
        return "runs"

    def copy_pointers(self, stream: torch.cuda.Stream, dsts: np.ndarray, srcs: np.ndarray,
                      sizes: np.ndarray) -> str:
        """Queue ``sizes[i]`` bytes from address ``srcs[i]`` to ``dsts[i]`` for all i on
        ``stream`` (pieces of blocks in an engine's tensors: ``kvdist.external``), in one
        ``cudaMemcpyBatchAsync`` where it exists, else one ``cudaMemcpyAsync`` each."""
        n = len(sizes)
        if n == 0:
            return self.path
        dsts, srcs, sizes = (np.ascontiguousarray(a, dtype=np.uint64) for a in (dsts, srcs, sizes))
        self.entries += n
        if self.path == "memcpy-batch" and self._batch is not None:
            err = self._batch(dsts, srcs, sizes, n, stream.cuda_stream)
            if err == 0:
                self._count("memcpy-batch", 1)
                return "memcpy-batch"
            log.warning("cudaMemcpyBatchAsync failed with CUDA error %d; using runs from now on", err)
            self._batch = None
            self.path = "runs"
        assert self._memcpy is not None, "no CUDA runtime library to copy by address"
        h = stream.cuda_stream
        for d, s, k in zip(dsts.tolist(), srcs.tolist(), sizes.tolist()):
            err = self._memcpy(d, s, k, _MEMCPY_DEFAULT, h)
            assert err == 0, f"cudaMemcpyAsync failed with CUDA error {err}"
        self._count("runs", n)
        return "runs"

    def _runs(self, stream, src_rows, dst_rows, s0, d0, length) -> None:
        if self._memcpy is not None:
            size, ps, pd = src_rows.shape[1], src_rows.stride(0), dst_rows.stride(0)
            sb, db, h = src_rows.data_ptr(), dst_rows.data_ptr(), stream.cuda_stream
            for s, d, k in zip(s0.tolist(), d0.tolist(), length.tolist()):
                err = self._memcpy(db + d * pd, sb + s * ps, k * size, _MEMCPY_DEFAULT, h)
                assert err == 0, f"cudaMemcpyAsync failed with CUDA error {err}"
            return
        with torch.cuda.stream(stream):
            for s, d, k in zip(s0.tolist(), d0.tolist(), length.tolist()):
                dst_rows[d:d + k].copy_(src_rows[s:s + k], non_blocking=True)

    def _count(self, path: str, calls: int) -> None:
        self.batches[path] += 1
        self.api_calls[path] += calls
