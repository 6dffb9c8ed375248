"""Where does the engine lose bandwidth at small blocks? (issue 3, H200 only)

For one block size, 2,048 scattered blocks each way, every variant timed in interleaved
rounds (so host noise hits all alike), GB/s of wall time and host microseconds a call:

  raw        one cudaMemcpyBatchAsync per call on the offload/onboard stream
  raw/N      the same split into calls of N entries
  pingpong   raw plus the engine's GPU-side barriers (copy waits compute, compute waits copy)
  engine     a cache step: begin_step, copy_many, before_compute (what bench transfer times)
  engine-S2  the same with S4/S5 off (no cross-stream barriers)
  engine/N   the engine with the copier's sub_batch = N
  engine-nohint  the engine without cudaMemcpyFlagPreferOverlapWithCompute

Usage: python3 gpu/transfer_diag.py [128KiB|512KiB|2MiB] [rounds] [seconds]"""

from __future__ import annotations

import statistics
import sys
import time

import numpy as np
import torch

import kvdist
from kvdist.bench.transfer import MODEL, SIZES


def rate(fn, nbytes: int, seconds: float) -> tuple[float, float]:
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    reps = max(5, int(seconds / max(time.perf_counter() - t0, 1e-6)))
    host = 0.0
    t0 = time.perf_counter()
    for _ in range(reps):
        h0 = time.perf_counter()
        fn()
        host += time.perf_counter() - h0
    torch.cuda.synchronize()
    wall = time.perf_counter() - t0
    return nbytes * reps / wall / 1e9, host / reps * 1e6


def main() -> None:
    label = sys.argv[1] if len(sys.argv) > 1 else "128KiB"
    rounds = int(sys.argv[2]) if len(sys.argv) > 2 else 3
    seconds = float(sys.argv[3]) if len(sys.argv) > 3 else 0.5
    bpb, n = SIZES[label], 2048
    tpb = bpb // (2 * MODEL["num_layers"] * MODEL["num_kv_heads"] * MODEL["head_dim"] * 2)
    cache = kvdist.create({"model": MODEL, "cache": {
        "tokens_per_block": tpb, "device": "cuda", "gpu": {"blocks": 2 * n},
        "host": {"bytes": 2 * n * bpb}, "enable_reuse": False}})
    ex, engine = cache._local.executor, cache.manager.engine
    cp = ex.copier
    g, h = cache._local.gpu.raw, cache._local.host.raw
    ck = cache._local.host.chunk_blocks
    rng = np.random.default_rng(0)
    gp, hp = rng.permutation(2 * n), rng.permutation(2 * n)
    G = int(engine.space.base[1])
    ga, gb, ha, hb = gp[:n], gp[n:], hp[:n], hp[n:]
    off_moves = (ga.tolist(), (G + ha).tolist())
    on_moves = ((G + hb).tolist(), gb.tolist())
    off, on = ex.streams["offload"], ex.streams["onboard"]
    compute = torch.cuda.current_stream()
    nbytes = n * bpb

    def raw(direction, sub=0):
        def fn():
            cp.sub_batch = sub
            if direction == "d2h":
                cp.copy(off, g, h, ga, ha, dst_chunk=ck)
            else:
                cp.copy(on, h, g, hb, gb, src_chunk=ck)
        return fn

    def pingpong(direction):
        def fn():
            cp.sub_batch = 0
            st = off if direction == "d2h" else on
            ce = torch.cuda.Event()
            ce.record(compute)
            st.wait_event(ce)
            if direction == "d2h":
                cp.copy(st, g, h, ga, ha, dst_chunk=ck)
            else:
                cp.copy(st, h, g, hb, gb, src_chunk=ck)
            ev = torch.cuda.Event()
            ev.record(st)
            compute.wait_event(ev)
        return fn

    def step(direction, sub=0, rules=None, hint=True):
        moves = off_moves if direction == "d2h" else on_moves

        def fn():
            cp.sub_batch = sub
            saved = engine.rules
            if rules is not None:
                engine.rules = rules
            if not hint:
                cp.overlap_hint = False
                cp._batch = cp._find_batch()
            engine.begin_step()
            engine.copy_many(*moves)
            engine.before_compute()
            engine.rules = saved
            if not hint:
                cp.overlap_hint = True
                cp._batch = cp._find_batch()
        return fn

    def both(kind, sub=0):
        def fn():
            cp.sub_batch = sub
            if kind == "raw":
                cp.copy(off, g, h, ga, ha, dst_chunk=ck)
                cp.copy(on, h, g, hb, gb, src_chunk=ck)
            else:
                engine.begin_step()
                engine.copy_many(*off_moves)
                engine.copy_many(*on_moves)
                engine.before_compute()
        return fn

    # The first steps of a fresh engine, one at a time (synchronized): any warm-up cost.
    for name, fn in (("engine d2h", step("d2h")), ("raw d2h", raw("d2h")), ("engine d2h", step("d2h"))):
        times = []
        for _ in range(30):
            t0 = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        print(f"first steps, {name}, ms each:", " ".join(f"{t:.2f}" for t in times), flush=True)

    variants = {}
    variants["raw both"] = both("raw")
    variants["engine both"] = both("engine")
    variants["engine/256 both"] = both("engine", 256)
    for d in ("d2h", "h2d"):
        variants[f"raw {d}"] = raw(d)
        for sub in (128, 256, 512):
            variants[f"raw/{sub} {d}"] = raw(d, sub)
        variants[f"pingpong {d}"] = pingpong(d)
        variants[f"engine {d}"] = step(d)
        variants[f"engine-S2 {d}"] = step(d, rules=frozenset({"S2"}))
        for sub in (128, 256, 512):
            variants[f"engine/{sub} {d}"] = step(d, sub)
        variants[f"engine-nohint {d}"] = step(d, hint=False)

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

    results: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
    for r in range(rounds):
        for k, fn in variants.items():
            results[k].append(rate(fn, 2 * nbytes if "both" in k else nbytes, seconds))
        print(f"round {r + 1}/{rounds} done", flush=True)
    print(f"\n{torch.cuda.get_device_name()}, {label}, {n} blocks, {rounds} rounds x {seconds} s, "
          f"{time.strftime('%Y-%m-%d %H:%M')}")
    print(f"{'variant':22s} {'GB/s per round':36s} {'median':>7s} {'host us/call':>12s}")
    for k, rs in results.items():
        gbs = [x for x, _ in rs]
        host = statistics.median(y for _, y in rs)
        print(f"{k:22s} {' '.join(f'{x:6.1f}' for x in gbs):36s} {statistics.median(gbs):7.1f} {host:12.0f}")
    cache.synchronize()
    cache.close()


if __name__ == "__main__":
    main()
