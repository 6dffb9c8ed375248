"""``python -m kvdist bench scale``: metadata that scales to millions of blocks.

Builds on CPU a cache of 65,536 GPU + 1,048,576 host blocks of tiny blocks (1 layer,
1 head, head_dim 2, float16, 16 tokens: 128 bytes, so the tiers' own bytes are small
and known) and one 16x smaller, fills both to 90% of each tier with cached,
unreferenced blocks through the ordinary API (add, block table, end_step, release),
and prints:

* ``create()`` time of the large cache;
* Python-side memory per block beyond the tiers' own bytes, empty and 90% full,
  measured two ways: tracemalloc (live bytes allocated through Python's allocators
  and numpy, which reports its arrays there, touched or not; the tiers are torch/mmap
  memory, which it does not see) and the process's resident set (VmRSS growth since
  before create() minus the tiers' bytes, after gc and malloc_trim; both tiers are
  resident after create: the host tier is prefaulted, the GPU pool zero-filled). The
  fill runs untraced unless ``--trace-fill`` (tracemalloc slows it about 8x), so by
  default the full state is measured by RSS alone;
* the cost of a short step (add a 64-token sequence, take its block table, end the
  step, release it) at 90% full, large vs small cache, steps of the two caches
  interleaved so that other load on the machine hits both alike; then the same step
  once the GPU tier is full (each step offloads 4 blocks gpu -> host) and once both
  tiers are full (each step also drops 4 host blocks)."""

from __future__ import annotations

import argparse
import ctypes
import gc
import time
import tracemalloc
from dataclasses import dataclass

import numpy as np
import torch
from tabulate import tabulate
from tqdm import tqdm

from ..cache import KVCache, create
from ..layout import KVLayout

LARGE = (65_536, 1_048_576)
SHRINK = 16
MODEL = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 2, "dtype": "float16"}
TOKENS_PER_BLOCK = 16
FILL = 0.9
SEQ_BLOCKS = 256  # blocks per fill sequence
STEP_TOKENS = 64


def config(gpu_blocks: int, host_blocks: int) -> dict:
    bpb = KVLayout(**MODEL, tokens_per_block=TOKENS_PER_BLOCK).bytes_per_block
    return {"model": dict(MODEL),
            "cache": {"tokens_per_block": TOKENS_PER_BLOCK, "device": "cpu",
                      "gpu": {"blocks": gpu_blocks}, "host": {"bytes": host_blocks * bpb}}}


def rss_bytes() -> int:
    with open("/proc/self/status", encoding="utf-8") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def tier_bytes(cache: KVCache) -> int:
    return cache.layout.bytes_per_block * sum(cache.stats()["capacity_blocks"].values())


class Tokens:
    """Fresh random token ids, so that no two blocks share a hash."""

    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def take(self, n: int) -> list[int]:
        return self.rng.integers(0, 2**31 - 1, n, dtype=np.int32).tolist()


def fill(cache: KVCache, tokens: Tokens, label: str) -> None:
    """Leave ``FILL`` of each tier holding cached, unreferenced blocks, the rest free.

    Fresh full blocks are cached on the GPU tier and pushed down to the host tier as
    later ones need their slots; once the GPU tier's blocks plus ``FILL`` of the host
    tier exist, one-token sequences take the last tenth of the GPU slots (pushing that
    many more blocks down) and are released, which frees those slots."""
    capacity = cache.stats()["capacity_blocks"]
    gpu, host = capacity["gpu"], capacity["host"]
    gpu_free = gpu - int(FILL * gpu)
    host_target = int(FILL * host)
    total = gpu + host_target - gpu_free  # full blocks to create
    per_step = max(1, min(16, gpu // (4 * SEQ_BLOCKS)))  # sequences per step
    made, seq = 0, 0
    with tqdm(total=total, desc=f"filling {label}", unit="block", unit_scale=True, leave=False) as bar:
        while made < total:
            cache.begin_step()
            ids = []
            for _ in range(per_step):
                n = min(SEQ_BLOCKS, total - made)
                if n == 0:
                    break
                cache.add_sequence(("fill", seq), tokens.take(n * TOKENS_PER_BLOCK))
                ids.append(("fill", seq))
                seq += 1
                made += n
                bar.update(n)
            cache.block_table(ids)
            cache.end_step()
            for sid in ids:
                cache.release(sid)
    # Held at once, so that each takes a distinct slot; not in a block table (they are
    # a device to free slots, not work: thousands of table rows would be scheduler
    # state no serving step has).
    cache.begin_step()
    ids = [("free", i) for i in range(gpu_free)]
    for sid in ids:
        cache.add_sequence(sid, tokens.take(1))
    cache.end_step()
    for sid in ids:
        cache.release(sid)
    cache.synchronize()
    stats = cache.stats()
    used = stats["blocks_used"]
    assert used == {"gpu": gpu - gpu_free, "host": host_target}, f"fill left {used}"
    # No sequence holds a block, so every used one is cached and evictable.
    assert stats["sequences"] == 0, "a filled block is referenced"


def short_step(cache: KVCache, sid: object, tokens: list[int]) -> float:
    """Seconds of one short step: add, block table, end_step, release."""
    t0 = time.perf_counter()
    cache.begin_step()
    cache.add_sequence(sid, tokens)
    cache.block_table([sid])
    cache.end_step()
    cache.release(sid)
    return time.perf_counter() - t0


def interleaved_steps(caches: list[KVCache], n: int, tokens: Tokens, tag: str) -> list[np.ndarray]:
    """Per-step seconds of ``n`` short steps on each cache, alternating between them."""
    times = [np.empty(n) for _ in caches]
    order = list(range(len(caches)))
    for i in range(n):
        toks = tokens.take(STEP_TOKENS)
        for k in order:
            times[k][i] = short_step(caches[k], (tag, i), toks)
        order.reverse()  # neither cache always runs right after the other
    return times


def run_until(cache: KVCache, tokens: Tokens, tag: str, done) -> int:
    """Short steps (untimed) until ``done(cache.stats())``; returns how many."""
    i = 0
    while not done(cache.stats()):
        short_step(cache, (tag, i), tokens.take(STEP_TOKENS))
        i += 1
    return i


@dataclass(slots=True)
class Memory:
    traced_empty: int
    traced_full: int | None
    rss_empty: int
    rss_full: int
    fill_s: float


def settled_rss() -> int:
    """VmRSS after a full garbage collection and returning free heap pages to the OS."""
    gc.collect()
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # not glibc
        pass
    return rss_bytes()


def build_and_fill(gpu: int, host: int, tokens: Tokens, label: str,
                   trace_fill: bool) -> tuple[KVCache, Memory]:
    """Create (traced) and fill a cache; memory beyond the tiers, empty and full."""
    rss0 = settled_rss()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = create(config(gpu, host))
    tiers = tier_bytes(cache)
    traced_empty = tracemalloc.get_traced_memory()[0] - base
    if not trace_fill:
        tracemalloc.stop()
    rss_empty = settled_rss() - rss0 - tiers - tracemalloc.get_tracemalloc_memory()
    t0 = time.perf_counter()
    fill(cache, tokens, label)
    fill_s = time.perf_counter() - t0
    traced_full = None
    if trace_fill:
        gc.collect()
        traced_full = tracemalloc.get_traced_memory()[0] - base
        tracemalloc.stop()
    rss_full = settled_rss() - rss0 - tiers
    return cache, Memory(traced_empty, traced_full, rss_empty, rss_full, fill_s)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdist bench scale", description=__doc__)
    ap.add_argument("--steps", type=int, default=100, help="timed short steps per regime")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--trace-fill", action="store_true",
                    help="keep tracemalloc on through the fill (about 8x slower) to measure the "
                         "full state with it too")
    args = ap.parse_args(argv)
    # The copies here are of a few 128-byte blocks; OpenMP worker threads spinning on
    # a loaded machine made them 50x slower than one thread does.
    torch.set_num_threads(1)
    tokens = Tokens(args.seed)
    large = LARGE
    small = (LARGE[0] // SHRINK, LARGE[1] // SHRINK)

    # create() alone, timed without tracemalloc (which slows allocation down).
    t0 = time.perf_counter()
    cache = create(config(*large))
    create_s = time.perf_counter() - t0
    cache.close()
    del cache

    big, mem = build_and_fill(*large, tokens, "large", args.trace_fill)
    blocks = sum(large)
    small_cache, small_mem = build_and_fill(*small, tokens, "small", args.trace_fill)
    print(f"large cache: {large[0]:,} GPU + {large[1]:,} host blocks of {big.layout.bytes_per_block} "
          f"bytes ({tier_bytes(big) / 2**20:.0f} MiB of tiers); small cache: {small[0]:,} + {small[1]:,}")
    print(f"create() of the large cache: {create_s:.2f} s (goal < 3 s); fill to 90% (setup): "
          f"{mem.fill_s:.1f} s large, {small_mem.fill_s:.1f} s small\n")

    def per(x: int | None, n: int) -> str:
        return "-" if x is None else f"{x / n:.1f}"

    rows = [["empty", per(mem.traced_empty, blocks), per(mem.rss_empty, blocks), "64"],
            ["90% full", per(mem.traced_full, blocks), per(mem.rss_full, blocks), "128"]]
    print("Python-side memory beyond the tiers' own bytes, large cache, bytes per block")
    print(tabulate(rows, headers=["state", "tracemalloc", "RSS growth", "goal <="], disable_numparse=True))
    arrays = big.stats()["metadata_bytes"] / blocks
    print(f"(per-slot arrays of the manager and transfer engine: {arrays:.1f} B per block; small cache: "
          f"{per(small_mem.traced_empty, sum(small))} empty by tracemalloc, "
          f"{per(small_mem.rss_full, sum(small))} full by RSS)\n")

    caches = [big, small_cache]
    n = min(args.steps, (small[0] - int(FILL * small[0])) // (STEP_TOKENS // TOKENS_PER_BLOCK))
    regimes = [(f"90% full ({n} steps, free GPU slots)", interleaved_steps(caches, n, tokens, "a"))]
    # The GPU tier full: every step now offloads its 4 blocks' worth of victims.
    for c, tag in zip(caches, "bc"):
        run_until(c, tokens, tag, lambda s: s["blocks_free"]["gpu"] == 0)
    regimes.append((f"GPU full ({args.steps} steps, offload 4 gpu->host)",
                    interleaved_steps(caches, args.steps, tokens, "d")))
    for c, tag in zip(caches, "ef"):
        run_until(c, tokens, tag, lambda s: s["blocks_free"]["host"] == 0)
    regimes.append((f"both tiers full ({args.steps} steps, offload 4, drop 4)",
                    interleaved_steps(caches, args.steps, tokens, "g")))
    rows = []
    for name, (t_large, t_small) in regimes:
        ratio = np.median(t_large) / np.median(t_small)
        rows.append([name, f"{np.median(t_large) * 1e6:.0f}", f"{np.median(t_small) * 1e6:.0f}",
                     f"{ratio:.2f}"])
    print(f"short step (add {STEP_TOKENS} tokens, block table, end_step, release), median µs")
    print(tabulate(rows, headers=["regime", "large", "small", "large/small (goal < 1.5)"],
                   disable_numparse=True))
    for c in caches:
        c.check_invariants()
        c.close()
    return 0
