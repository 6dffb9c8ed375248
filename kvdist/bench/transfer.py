"""``python -m kvdist bench transfer``: host<->GPU block transfers against the hardware.

For each block size, 2,048 blocks scattered over a GPU tier and a pinned host tier
of twice that many blocks (slots drawn at random, so no two are neighbours by
design), side by side in one run:

  (a) one contiguous pinned copy of the same bytes, each way: the ceiling;
  (b) a per-block copy loop (``tensor[i].copy_``, one call per block): the naive design;
  one cudaMemcpyBatchAsync per call on the same memory, no engine (the mechanism alone);
  (c) kvdist offload and (d) kvdist onboard: the cache's transfer engine (ordering,
      S4/S5 barriers, batching) and CUDA executor, one step per repetition, fed with
      ``copy_many``, and again block by block with ``copy`` (as the manager does);
  (e) both at once (disjoint blocks, offload and onboard streams concurrently),
      against the contiguous both-ways ceiling measured the same way;
  and a matmul loop on the compute stream, timed alone and while (e) runs.

GB/s count the bytes of one direction (both directions' bytes for (e)). Without
CUDA it prints that it needs CUDA and exits 0."""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
from tabulate import tabulate
from tqdm import tqdm

SIZES = {"128KiB": 128 << 10, "256KiB": 256 << 10, "512KiB": 512 << 10, "2MiB": 2 << 20}
MODEL = {"num_layers": 8, "num_kv_heads": 8, "head_dim": 128, "dtype": "float16"}  # 32 KiB a token


def _args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m kvdist bench transfer", description=__doc__.splitlines()[0])
    p.add_argument("--blocks", type=int, default=2048, help="blocks moved per direction (default 2048)")
    p.add_argument("--sizes", default="128KiB,512KiB,2MiB", help=f"block sizes, from {', '.join(SIZES)}")
    p.add_argument("--seconds", type=float, default=0.25, help="time per measurement (default 0.25)")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds; figures are medians (3)")
    p.add_argument("--json", default=None, help="also write every round's figures to this file")
    p.add_argument("--path", default=None, help="force the copy path (memcpy-batch, runs, per-block)")
    return p.parse_args(argv)


class Timer:
    """Repeats ``fn`` for about ``seconds`` after a warm-up; GB/s of ``nbytes`` a call.
    The host runs ahead of the GPU, so this is the device-side rate whenever the host
    side of one call is shorter than its transfer."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def rate(self, fn, nbytes: int) -> tuple[float, float]:
        """(GB/s, host seconds of one call issued to idle streams). The second is the
        submission cost alone: in the timed loop the host soon runs a queue's depth
        ahead and then waits for the GPU, so its time there is the GPU's."""
        fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        host_one = time.perf_counter() - t0
        torch.cuda.synchronize()
        one = max(time.perf_counter() - t0, 1e-6)
        reps = max(3, int(self.seconds / one))
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        return nbytes * reps / wall / 1e9, host_one


def _pieces(lo: int, hi: int, chunk: int) -> list[tuple[int, int]]:
    """[lo, hi) cut at the multiples of ``chunk``."""
    out = []
    while lo < hi:
        end = min(hi, (lo // chunk + 1) * chunk)
        out.append((lo, end))
        lo = end
    return out


def _matmul_time(a: torch.Tensor, iters: int) -> float:
    """Seconds for ``iters`` chained matmuls on the current (compute) stream."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    x = a
    for _ in range(iters):
        x = torch.matmul(x, a)
        x = x * (1.0 / 64)  # keep the values finite
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3


def _one_size(label: str, bpb: int, n: int, timer: Timer, path: str | None, rounds: int) -> dict:
    from ..testing import Seams, create
    from ..transfer import OFFLOAD, ONBOARD

    tpb = bpb // (2 * MODEL["num_layers"] * MODEL["num_kv_heads"] * MODEL["head_dim"] * 2)
    cfg = {"model": MODEL, "cache": {"tokens_per_block": tpb, "device": "cuda", "gpu": {"blocks": 2 * n},
                                     "host": {"bytes": 2 * n * bpb}, "enable_reuse": False}}
    seams = Seams(copy_path=path)  # the engine and the copier are timed on their own too
    cache = create(cfg, seams)
    try:
        assert cache.layout.bytes_per_block == bpb, (cache.layout.bytes_per_block, bpb)
        ex, engine = seams.executor, seams.engine
        g, h = seams.gpu.raw, seams.host.raw
        g.view(torch.uint8).fill_(7)
        rng = np.random.default_rng(0)
        g_perm, h_perm = rng.permutation(2 * n), rng.permutation(2 * n)
        G = int(engine.space.base[1])  # global id of host slot 0
        gpu_a, gpu_b = g_perm[:n].tolist(), g_perm[n:].tolist()
        host_a, host_b = (G + h_perm[:n]).tolist(), (G + h_perm[n:]).tolist()
        nbytes = n * bpb
        side = torch.cuda.Stream()
        other = torch.cuda.Stream()
        # The host tier is registered with CUDA in chunks and one DMA copy must stay
        # inside one: the "contiguous" ceiling is one copy per chunk (>= 1 GiB each).
        chunk = seams.host.chunk_blocks or 2 * n
        pieces, pieces_b = _pieces(0, n, chunk), _pieces(n, 2 * n, chunk)

        def contiguous(direction: str):
            with torch.cuda.stream(side):
                for a, b in pieces:
                    if direction == "d2h":
                        h[a:b].copy_(g[a:b], non_blocking=True)
                    else:
                        g[a:b].copy_(h[a:b], non_blocking=True)

        def both_contiguous():
            with torch.cuda.stream(side):
                for a, b in pieces:
                    h[a:b].copy_(g[a:b], non_blocking=True)
            with torch.cuda.stream(other):
                for a, b in pieces_b:
                    g[a:b].copy_(h[a:b], non_blocking=True)

        pairs = list(zip(g_perm[:n].tolist(), h_perm[:n].tolist()))

        def per_block_loop():
            with torch.cuda.stream(side):
                for gs, hs in pairs:
                    h[hs].copy_(g[gs], non_blocking=True)

        def kvdist_step(moves, bulk: bool):
            engine.begin_step()
            for route, srcs, dsts in moves:
                if bulk:
                    engine.copy_many(route, srcs, dsts)
                else:
                    for s, d in zip(srcs, dsts):
                        engine.copy(route, s, d)
            engine.before_compute()

        # Every variant once per round, rounds interleaved, so a slow phase of the host
        # or the link hits all of them alike; a figure is the median over the rounds.
        ga, ha = np.asarray(gpu_a), h_perm[:n]
        hb, gb = h_perm[n:], np.asarray(gpu_b)
        ck = seams.host.chunk_blocks
        off, on = [(OFFLOAD, gpu_a, host_a)], [(ONBOARD, host_b, gpu_b)]
        variants = {
            "ceiling D2H": (lambda: contiguous("d2h"), nbytes),
            "ceiling H2D": (lambda: contiguous("h2d"), nbytes),
            "ceiling both": (both_contiguous, 2 * nbytes),
            "per-block loop": (per_block_loop, nbytes),
            # The copy mechanism alone on the same memory: one batch per call, no engine.
            "raw D2H": (lambda: ex.copier.copy(side, g, h, ga, ha, dst_chunk=ck), nbytes),
            "raw H2D": (lambda: ex.copier.copy(side, h, g, hb, gb, src_chunk=ck), nbytes),
        }
        for api, bulk in (("", True), ("per-copy ", False)):
            variants[api + "offload"] = (lambda m=off, b=bulk: kvdist_step(m, b), nbytes)
            variants[api + "onboard"] = (lambda m=on, b=bulk: kvdist_step(m, b), nbytes)
            variants[api + "both"] = (lambda m=off + on, b=bulk: kvdist_step(m, b), 2 * nbytes)
        runs: dict[str, list[tuple[float, float]]] = {k: [] for k in variants}
        for _ in range(rounds):
            for key, (fn, nb) in variants.items():
                runs[key].append(timer.rate(fn, nb))
        res = {"block": label, "rounds": {k: [round(r, 2) for r, _ in v] for k, v in runs.items()}}
        for key, v in runs.items():
            res[key] = statistics.median(r for r, _ in v)
            res["host " + key] = statistics.median(t for _, t in v)
        for api in ("", "per-copy "):
            host_s = res["host " + api + "offload"] + res["host " + api + "onboard"]
            res[api + "us/block"] = host_s / 2 / n * 1e6
        res["path"] = ex.stats()["batches_by_path"]
        res["copier"] = ex.copier.describe()  # the path as measured (after --path or a fallback)
        res["slowdown"] = _compute_slowdown(ex, g, h, ga, ha, hb, gb, timer, ck)
        cache.synchronize()
        return res
    finally:
        cache.close()


def _compute_slowdown(ex, g, h, ga: np.ndarray, ha: np.ndarray, hb: np.ndarray, gb: np.ndarray,
                      timer: Timer, chunk: int) -> tuple[float, float]:
    """(compute slowdown %, GB/s moved meanwhile): a bf16 matmul loop on the compute
    stream alone, then while both copy streams move blocks back and forth."""
    a = torch.randn(4096, 4096, device=g.device, dtype=torch.bfloat16)
    _matmul_time(a, 20)
    iters = 20
    while _matmul_time(a, iters) < timer.seconds:
        iters *= 2
    alone = min(_matmul_time(a, iters) for _ in range(3))
    off, on = ex.streams["offload"], ex.streams["onboard"]
    # Queue enough copies to outlast the compute loop (the copy streams never wait for it).
    t0 = time.perf_counter()
    ex.copier.copy(off, g, h, ga, ha, dst_chunk=chunk)
    ex.copier.copy(on, h, g, hb, gb, src_chunk=chunk)
    torch.cuda.synchronize()
    per_round = time.perf_counter() - t0
    rounds = int(1.5 * alone / per_round) + 2
    start = time.perf_counter()
    for _ in range(rounds):
        ex.copier.copy(off, g, h, ga, ha, dst_chunk=chunk)
        ex.copier.copy(on, h, g, hb, gb, src_chunk=chunk)
    busy = _matmul_time(a, iters)
    torch.cuda.synchronize()
    moved = rounds * 2 * len(ga) * g.shape[1] / (time.perf_counter() - start) / 1e9
    return 100.0 * (busy / alone - 1.0), moved


def _pct(r: dict, key: str, ceiling: str) -> str:
    return f"{r[key]:.1f} ({100 * r[key] / r[ceiling]:.0f}%)"


def main(argv: list[str]) -> int:
    args = _args(argv)
    if not torch.cuda.is_available():
        print("bench transfer needs CUDA (a GPU tier in device memory and a pinned host tier); "
              "no GPU here, nothing measured")
        return 0
    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        print(f"bench transfer: unknown block size(s) {unknown}; use {', '.join(SIZES)}")
        return 2
    timer = Timer(args.seconds)
    rows = []
    for label in tqdm(sizes, desc="block sizes", unit="size"):
        rows.append(_one_size(label, SIZES[label], args.blocks, timer, args.path, args.rounds))
    path = rows[0]["copier"]
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.blocks} scattered blocks "
          f"per direction, {time.strftime('%Y-%m-%d')}; copy path: {path}")
    table = []
    for r in rows:
        slow, moved = r["slowdown"]
        table.append([r["block"], f"{r['ceiling D2H']:.1f} / {r['ceiling H2D']:.1f}",
                      f"{r['per-block loop']:.1f}", f"{r['raw D2H']:.1f} / {r['raw H2D']:.1f}",
                      _pct(r, "offload", "ceiling D2H"),
                      _pct(r, "onboard", "ceiling H2D"),
                      _pct(r, "both", "ceiling both") + f" of {r['ceiling both']:.1f}",
                      f"{slow:+.1f}% ({moved:.0f} GB/s)",
                      f"{r['per-copy offload']:.1f} / {r['per-copy onboard']:.1f} / {r['per-copy both']:.1f}",
                      f"{r['us/block']:.2f} / {r['per-copy us/block']:.2f}", r["path"]])
    print(tabulate(table, headers=["block", "(a) ceiling D2H / H2D GB/s", "(b) per-block loop",
                                   "one batch call D2H / H2D (no engine)", "(c) offload", "(d) onboard",
                                   "(e) both ways",
                                   "compute slowdown (copies meanwhile)",
                                   "(c) / (d) / (e) via engine.copy per block",
                                   "host us/block of one step (idle streams): copy_many / copy",
                                   "batches by path"]))
    for r in rows:
        keys = ("ceiling D2H", "ceiling H2D", "ceiling both", "offload", "onboard", "both")
        spread = "; ".join(f"{k} {' / '.join(f'{x:.1f}' for x in r['rounds'][k])}" for k in keys)
        print(f"{r['block']} per round: {spread}")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "date": time.strftime("%Y-%m-%d %H:%M"),
                       "blocks": args.blocks, "copy_path": path, "sizes": rows}, f, indent=1, default=str)
    print("(c)-(e): the cache's transfer engine (S2/S4/S5 bookkeeping, one step per repetition) fed "
          "with copy_many; the next column feeds it block by block, as the manager does today.")
    print(f"Figures: medians of {args.rounds} interleaved rounds (every variant once a round).")
    print("Goals: (c), (d) >= 95% of (a); (e) >= 90% of the both-ways ceiling (101.5 GB/s on an "
          "H200, docs/results.md); compute slowdown < 5%.")
    return 0
