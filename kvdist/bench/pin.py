"""``python -m kvdist bench pin``: how fast a host tier is ready for DMA.

kvdist's host tier (mmap, parallel prefault, chunked cudaHostRegister overlapped with
the faulting) against ``torch.empty(pin_memory=True)``, end to end, side by side:
seconds, GB/s, the ratio, the longest single driver call, and an H2D copy from each
buffer to show both are really pinned. Without CUDA nothing is registered: the
kvdist side is prefaulted plain memory against ``torch.zeros`` (allocate + fault)."""

from __future__ import annotations

import argparse
import json
import mmap
import platform
import time

import torch
from tabulate import tabulate

from ..errors import HostTierUnavailable
from ..storage.host import HUGE_PAGE, HostMemory, default_threads
from ..storage.host_sizing import read_limits
from ..storage.pinning import CudaRegistrar
from ..units import GiB, gib, parse_size


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvdist bench pin", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default=None, help="comma-separated sizes (default 8GiB,32GiB with CUDA, "
                   "256MiB,1GiB without)")
    p.add_argument("--chunk", default="1GiB", help="registration chunk (cache.host.chunk_bytes)")
    p.add_argument("--threads", type=int, default=0, help="prefault threads (0: one per core, at most 16)")
    p.add_argument("--no-huge-pages", action="store_true", help="do not madvise(MADV_HUGEPAGE)")
    p.add_argument("--repeat", type=int, default=1, help="runs per size; the best of each side is shown")
    p.add_argument("--json", default=None, help="also write the figures to this file")
    p.add_argument("--no-warm", action="store_true",
                   help="skip touching the largest size once before timing (VMs back guest memory "
                        "lazily: whichever side ran first would pay for it)")
    return p


def _empty_host_cache() -> None:
    for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
        fn = getattr(torch._C, name, None)
        if fn is not None:
            fn()
            return


def _h2d_gbps(buf: torch.Tensor, dev: torch.device, n: int) -> float:
    """Copy ``n`` bytes from the start of ``buf`` (for kvdist: inside the first chunk, as
    a DMA copy must stay inside one registration)."""
    src = buf[:n]
    dst = torch.empty(n, dtype=torch.uint8, device=dev)
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize(dev)
    return 3 * n / (time.perf_counter() - t0) / 1e9


def _copy_bytes(n: int) -> int:
    return min(n, GiB)


def _warm(nbytes: int) -> float:
    """Fault ``nbytes`` once and give them back, untimed."""
    t0 = time.perf_counter()
    HostMemory(nbytes, threads=default_threads(), progress=False).close()
    return time.perf_counter() - t0


def _torch_side(n: int, dev: torch.device | None) -> tuple[float, float | None]:
    t0 = time.perf_counter()
    if dev is not None:
        x = torch.empty(n, dtype=torch.uint8, pin_memory=True)
        dt = time.perf_counter() - t0
        assert x.is_pinned()
        bw = _h2d_gbps(x, dev, _copy_bytes(n))
    else:
        x = torch.zeros(n, dtype=torch.uint8)
        dt, bw = time.perf_counter() - t0, None
    del x
    if dev is not None:
        _empty_host_cache()  # the caching host allocator would keep the pinned block
    return dt, bw


def _kvdist_side(n: int, dev: torch.device | None, args) -> tuple[float, float | None, HostMemory, float]:
    registrar = CudaRegistrar(dev) if dev is not None else None
    t0 = time.perf_counter()
    mem = HostMemory(n, registrar=registrar, chunk_bytes=parse_size(args.chunk), align=HUGE_PAGE,
                     threads=args.threads, huge_pages=not args.no_huge_pages, progress=True)
    dt = time.perf_counter() - t0
    bw = None
    if dev is not None:
        assert mem.flat.is_pinned(), "registered memory must read as pinned"
        bw = _h2d_gbps(mem.flat, dev, min(_copy_bytes(n), mem.chunks[0][1]))
    t1 = time.perf_counter()
    timings = mem.timings
    mem.close()
    return dt, bw, timings, time.perf_counter() - t1


def _thp() -> str:
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled", encoding="utf-8") as f:
            return f.read().split("[")[1].split("]")[0]
    except (OSError, IndexError):
        return "n/a"


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else None
    sizes = [parse_size(s) for s in (args.sizes or ("8GiB,32GiB" if cuda else "256MiB,1GiB")).split(",")]
    lim = read_limits()
    threads = args.threads or default_threads()
    print(f"kernel {platform.release()}, THP {_thp()}, {lim.describe()}, page {mmap.PAGESIZE} B, "
          f"prefault threads {threads}, chunk {args.chunk}, "
          f"huge pages {'off' if args.no_huge_pages else 'on'}")
    if cuda:
        torch.cuda.init()
        name = CudaRegistrar(dev).name
        print(f"GPU {torch.cuda.get_device_name(dev)}, registration through {name}; "
              f"baseline: torch.empty(pin_memory=True)")
    else:
        print("no CUDA: nothing is registered; kvdist = mmap + parallel prefault, "
              "baseline = torch.zeros (allocate + fault). Run on a GPU machine for the pinning figures.")
    if not args.no_warm:
        print(f"warming: faulting {gib(max(sizes), 1)} once, untimed ... ", end="", flush=True)
        print(f"{_warm(max(sizes)):.2f} s")
    rows, figures = [], []
    for n in sizes:
        best_t = best_k = None
        for r in range(args.repeat):
            # Alternate who goes first, so neither side always inherits the other's freed pages.
            order = ("torch", "kvdist") if r % 2 == 0 else ("kvdist", "torch")
            for side in order:
                try:
                    if side == "torch":
                        res = _torch_side(n, dev)
                        best_t = res if best_t is None or res[0] < best_t[0] else best_t
                    else:
                        res = _kvdist_side(n, dev, args)
                        best_k = res if best_k is None or res[0] < best_k[0] else best_k
                except (HostTierUnavailable, RuntimeError) as e:
                    print(f"{gib(n, 1)} {side}: {e}")
        if best_t is None or best_k is None:
            continue
        (tt, tbw), (kt, kbw, tm, close_s) = best_t, best_k
        gb = n / 1e9
        figures.append({"bytes": n, "torch_s": tt, "kvdist_s": kt, "speedup": tt / kt, "cuda": cuda})
        rows.append([f"{n / GiB:g} GiB", f"{tt:.2f}", f"{gb / tt:.2f}", f"{kt:.2f}", f"{gb / kt:.2f}",
                     f"{tt / kt:.1f}x", tm.method, tm.chunks, f"{tm.longest_call_s * 1e3:.0f}",
                     f"{tm.register_s:.2f}", f"{close_s:.2f}",
                     "-" if tbw is None else f"{tbw:.1f}", "-" if kbw is None else f"{kbw:.1f}"])
    base = "torch.empty(pin)" if cuda else "torch.zeros"
    print(tabulate(rows, headers=["size", f"{base} s", "GB/s", "kvdist s", "GB/s", "speedup",
                                  "prefault", "chunks", "longest call ms", "register s", "teardown s",
                                  "H2D torch GB/s", "H2D kvdist GB/s"]))
    print("goal: kvdist >= 4x torch.empty(pin_memory=True), end to end "
          "(allocation + prefault + registration)")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"sizes": figures}, f, indent=1)
    return 0

