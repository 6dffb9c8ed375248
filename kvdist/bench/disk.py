"""``python -m kvdist bench disk``: demote/promote through the disk tier against a
sequential write/read of the same bytes on the same disk, side by side.

Fair to both sides: both files are preallocated the same way; a write is timed up
to ``fdatasync`` (the bytes are on the device, not in the page cache); before a
read the file's cached pages are dropped (``posix_fadvise(DONTNEED)`` after the
sync) or bypassed (``O_DIRECT``). Blocks are demoted to and promoted from shuffled
slots in batches, as the cache's executors submit them; every byte is checked."""

from __future__ import annotations

import argparse
import os
import tempfile
import time

import numpy as np
from tabulate import tabulate
from tqdm import tqdm

from ..layout import KVLayout
from ..paths import free_bytes
from ..storage.disk import DiskPool
from ..storage.host import HostMemory
from ..units import gib, parse_size

SEQ_CHUNK = 8 << 20
SEQ = "sequential write/read, 1 thread, 8 MiB calls"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvdist bench disk", description=__doc__.splitlines()[0])
    p.add_argument("--dir", default=tempfile.gettempdir(), help="directory on the disk to measure")
    p.add_argument("--size", default="512MiB", help="bytes moved each way")
    p.add_argument("--block", default="256KiB", help="bytes per KV block")
    p.add_argument("--batch", type=int, default=64, help="blocks per demote/promote call")
    p.add_argument("--threads", type=int, default=4, help="disk I/O threads (cache.disk.io_threads)")
    p.add_argument("--direct", choices=("auto", "on", "off"), default="auto",
                   help="also measure the pool with O_DIRECT (auto: where the filesystem accepts it)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; best and median shown")
    p.add_argument("--seed", type=int, default=0)
    return p


def _fill(buf: np.ndarray, seed: int) -> None:
    words = buf.view(np.uint64)
    words[:] = np.arange(len(words), dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15) + np.uint64(seed)


def _sequential(directory: str, src: np.ndarray, dst: np.ndarray) -> tuple[float, float]:
    """One thread, 8 MiB ``pwrite``/``pread`` calls in file order: the disk's easy case."""
    fd, path = tempfile.mkstemp(prefix="kvdist-seq-", dir=directory)
    try:
        n = len(src)
        os.posix_fallocate(fd, 0, n)
        t0 = time.perf_counter()
        for off in range(0, n, SEQ_CHUNK):
            os.pwrite(fd, src[off:off + SEQ_CHUNK], off)
        os.fdatasync(fd)
        w = time.perf_counter() - t0
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        t0 = time.perf_counter()
        for off in range(0, n, SEQ_CHUNK):
            os.preadv(fd, [dst[off:off + SEQ_CHUNK]], off)
        r = time.perf_counter() - t0
    finally:
        os.close(fd)
        os.unlink(path)
    assert np.array_equal(src, dst), "sequential read-back differs"
    return w, r


def _pool(directory: str, src: np.ndarray, dst: np.ndarray, block: int, args,
          o_direct: bool) -> tuple[float, float, str] | None:
    n_blocks = len(src) // block
    # One layer, one head, uint8: a block of exactly ``block`` bytes.
    layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=block // 2, dtype="uint8", tokens_per_block=1)
    disk = DiskPool(layout, n_blocks, directory, rank=0, io_threads=args.threads, o_direct=o_direct)
    try:
        if o_direct and not disk.direct:
            print(f"O_DIRECT: {disk.direct_refused}")
            return None
        rng = np.random.default_rng(args.seed)
        slots = rng.permutation(n_blocks)
        rows_src, rows_dst = src.reshape(n_blocks, block), dst.reshape(n_blocks, block)
        label = "demote/promote" + (" O_DIRECT" if o_direct else "")
        b = args.batch
        with tqdm(total=2 * n_blocks, desc=label, unit="blk", leave=False) as bar:
            t0 = time.perf_counter()
            for i in range(0, n_blocks, b):  # demote: host block i -> disk slot slots[i]
                disk.write_blocks(slots[i:i + b].tolist(), list(rows_src[i:i + b]))
                bar.update(min(b, n_blocks - i))
            disk.sync()
            w = time.perf_counter() - t0
            if not disk.direct:
                disk.drop_page_cache()
            order = rng.permutation(n_blocks)  # promote in another order than demoted
            t0 = time.perf_counter()
            for i in range(0, n_blocks, b):
                idx = order[i:i + b]
                disk.read_blocks(slots[idx].tolist(), [rows_dst[j] for j in idx])  # views, not a copy
                bar.update(len(idx))
            r = time.perf_counter() - t0
    finally:
        disk.close()
    assert np.array_equal(src, dst), f"{label}: promoted bytes differ from the demoted ones"
    return w, r, label


def _cell(times: list[float], size: int) -> str:
    """Best of the rounds in GB/s, with the median in brackets."""
    best, med = min(times), float(np.median(times))
    return f"{size / best / 1e9:.2f} ({size / med / 1e9:.2f})"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    size, block = parse_size(args.size), parse_size(args.block)
    assert block % 8 == 0 and block >= 8, "--block must be a multiple of 8 bytes"
    size = size // block * block
    free = free_bytes(args.dir)
    if 2 * size > free:
        print(f"{args.dir} has {free} bytes free; the benchmark needs {2 * size}")
        return 1
    print(f"disk bench in {args.dir}: {gib(size)} each way, blocks of {block} B, "
          f"batches of {args.batch}, {args.threads} I/O threads, {args.rounds} interleaved rounds; "
          f"writes timed through fdatasync, reads after posix_fadvise(DONTNEED) (buffered) or with O_DIRECT")
    modes = {"auto": (False, True), "on": (False, True), "off": (False,)}[args.direct]
    times: dict[str, tuple[list[float], list[float]]] = {}
    src = HostMemory(size, progress=False)
    dst = HostMemory(size, progress=False)
    try:
        s, d = src.flat.numpy(), dst.flat.numpy()
        _fill(s, args.seed)
        for _ in tqdm(range(args.rounds), desc="rounds", leave=False):
            # Interleaved, so a noisy (shared) disk hurts every method alike.
            d[:] = 0
            w, r = _sequential(args.dir, s, d)
            ws, rs = times.setdefault(SEQ, ([], []))
            ws.append(w)
            rs.append(r)
            for o_direct in modes:
                d[:] = 0
                res = _pool(args.dir, s, d, block, args, o_direct)
                if res is None:
                    continue
                w, r, label = res
                ws, rs = times.setdefault(f"DiskPool {label}, shuffled slots", ([], []))
                ws.append(w)
                rs.append(r)
    finally:
        s = d = None  # drop the views before unmapping
        src.close()
        dst.close()
    seq_w, seq_r = (min(x) for x in times[SEQ])
    rows = [[name, _cell(w, size), _cell(r, size), f"{seq_w / min(w):.0%}", f"{seq_r / min(r):.0%}"]
            for name, (w, r) in times.items()]
    print(tabulate(rows, headers=["method", "write GB/s best (median)", "read GB/s best (median)",
                                  "write vs seq (best)", "read vs seq (best)"]))
    print("goal: demote/promote >= 80% of the sequential figures")
    return 0
