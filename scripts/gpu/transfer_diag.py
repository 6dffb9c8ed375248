"""Where does the engine lose bandwidth at small blocks? (CUDA only)

For one block size, 2,048 scattered blocks each way, every variant timed in interleaved
rounds (so host noise hits all alike): GB/s of wall time, and host microseconds of one
call issued to idle streams (the submission cost):

  raw        one cudaMemcpyBatchAsync per call on the offload/onboard stream
  raw both, 2 threads   the two directions' batch calls from two threads at once
  engine     a cache step: begin_step, copy_many, before_compute (what bench transfer times)
  ceiling    contiguous copies of the same bytes

Usage: python3 scripts/gpu/transfer_diag.py [128KiB|512KiB|2MiB] [rounds] [seconds]"""

from __future__ import annotations

import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from kvdist.bench.transfer import MODEL, SIZES, Timer
from kvdist.testing import Seams, create
from kvdist.transfer import OFFLOAD, ONBOARD


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "128KiB"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    bpb, n = SIZES[label], 2048
    tpb = bpb // (2 * MODEL["num_layers"] * MODEL["num_kv_heads"] * MODEL["head_dim"] * 2)
    seams = Seams()
    cache = create({"model": MODEL, "cache": {
        "tokens_per_block": tpb, "device": "cuda", "gpu": {"blocks": 2 * n},
        "host": {"bytes": 2 * n * bpb}, "enable_reuse": False}}, seams)
    ex, engine = seams.executor, seams.engine
    cp = ex.copier
    g, h = seams.gpu.raw, seams.host.raw
    ck = seams.host.chunk_blocks
    rng = np.random.default_rng(0)
    gp, hp = rng.permutation(2 * n), rng.permutation(2 * n)
    G = int(engine.space.base[1])
    ga, gb, ha, hb = gp[:n], gp[n:], hp[:n], hp[n:]
    off_moves = (OFFLOAD, ga.tolist(), (G + ha).tolist())
    on_moves = (ONBOARD, (G + hb).tolist(), gb.tolist())
    off, on = ex.streams["offload"], ex.streams["onboard"]
    nbytes = n * bpb

    def raw(direction):
        def fn():
            if direction == "d2h":
                cp.copy(off, g, h, ga, ha, dst_chunk=ck)
            else:
                cp.copy(on, h, g, hb, gb, src_chunk=ck)
        return fn

    def step(direction):
        moves = off_moves if direction == "d2h" else on_moves

        def fn():
            engine.begin_step()
            engine.copy_many(*moves)
            engine.before_compute()
        return fn

    def both(kind):
        def fn():
            if kind == "threads":
                a = pool.submit(cp.copy, off, g, h, ga, ha, dst_chunk=ck)
                b = pool.submit(cp.copy, on, h, g, hb, gb, src_chunk=ck)
                a.result(), b.result()
            elif kind == "raw":
                cp.copy(off, g, h, ga, ha, dst_chunk=ck)
                cp.copy(on, h, g, hb, gb, src_chunk=ck)
            else:
                engine.begin_step()
                engine.copy_many(*off_moves)
                engine.copy_many(*on_moves)
                engine.before_compute()
        return fn

    pool = ThreadPoolExecutor(2)
    variants = {}
    variants["raw both"] = both("raw")
    variants["engine both"] = both("engine")
    variants["raw both, 2 threads"] = both("threads")
    for d in ("d2h", "h2d"):
        variants[f"raw {d}"] = raw(d)
        variants[f"engine {d}"] = step(d)

    # Contiguous ceiling, as bench transfer measures it.
    def contiguous(direction):
        def fn():
            with torch.cuda.stream(off):
                for a in range(0, n, ck or n):
                    b = min(n, a + (ck or n))
                    if direction == "d2h":
                        h[a:b].copy_(g[a:b], non_blocking=True)
                    else:
                        g[a:b].copy_(h[a:b], non_blocking=True)
        return fn
    variants["ceiling d2h"] = contiguous("d2h")
    variants["ceiling h2d"] = contiguous("h2d")

    def ceiling_both():
        with torch.cuda.stream(off):
            h[:n].copy_(g[:n], non_blocking=True)
        with torch.cuda.stream(on):
            g[n:].copy_(h[n:], non_blocking=True)
    if not ck or ck >= 2 * n:
        variants["ceiling both"] = ceiling_both

    timer = Timer(seconds)
    results: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for r in range(rounds):
        for k, fn in variants.items():
            gbs, host_s = timer.rate(fn, 2 * nbytes if "both" in k else nbytes)
            results[k].append((gbs, host_s * 1e6))
        print(f"round {r + 1}/{rounds} done", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, {label}, {n} blocks, {rounds} rounds x {seconds} s, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'variant':22s} {'GB/s per round':36s} {'median':>7s} {'host us, 1 call':>15s}")
    for k, rs in results.items():
        gbs = [x for x, _ in rs]
        host = statistics.median(y for _, y in rs)
        print(f"{k:22s} {' '.join(f'{x:6.1f}' for x in gbs):36s} {statistics.median(gbs):7.1f} {host:15.0f}")
    cache.synchronize()
    cache.close()


if __name__ == "__main__":
    main()
