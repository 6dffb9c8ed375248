"""How fast host<->GPU copies move a block cut into layer-group pieces, three ways, and
what each costs a matmul running beside it (issue 24: every copy hidden at any block size).

    python3 scripts/gpu/piece_probe.py [--gib 1] [--sizes 128KiB,512KiB,2MiB]

For each block size and piece size (block / groups), 1 GiB of scattered blocks per
direction (slots drawn at random from tiers twice that size), medians of 3 repetitions:

* ce: the copy engines, one cudaMemcpyBatchAsync per group (kvdist's BatchCopier), as the
  CUDA executor issues a layer-grouped batch: onboard, offload, both at once;
* sm: a Triton gather kernel on a side stream reading pinned host memory through its
  device mapping (UVA), ``--programs`` programs (so at most that many SMs), onboard only;
* a bf16 matmul loop on the compute stream, alone and while each of the above runs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from kvdist.transfer.batchcopy import BatchCopier

SIZES = {"128KiB": 128 << 10, "512KiB": 512 << 10, "2MiB": 2 << 20}


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0)
    p.add_argument("--sizes", default="128KiB,512KiB,2MiB")
    p.add_argument("--groups", default="1,2,4,8,16,32")
    p.add_argument("--programs", default="16,32,64")
    p.add_argument("--reps", type=int, default=3)
    return p.parse_args()


class _Uva:
    """A CUDA view of pinned host memory (same address under UVA)."""

    def __init__(self, t: torch.Tensor):
        self.__cuda_array_interface__ = {"shape": tuple(t.shape), "typestr": "<i8",
                                         "data": (t.data_ptr(), False), "version": 3,
                                         "strides": tuple(s * 8 for s in t.stride())}


def _gather_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def gather(src, dst, sidx, didx, n, words, spitch, dpitch, lo, nprog, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        for p in range(pid, n, nprog):
            s = tl.load(sidx + p).to(tl.int64)
            d = tl.load(didx + p).to(tl.int64)
            for off in range(0, words, BLOCK):
                o = off + tl.arange(0, BLOCK)
                m = o < words
                v = tl.load(src + s * spitch + lo + o, mask=m, cache_modifier=".cg")
                tl.store(dst + d * dpitch + lo + o, v, mask=m)

    return gather


def _timed(stream: torch.cuda.Stream, fn) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record(stream)
    fn()
    b.record(stream)
    b.synchronize()
    return a.elapsed_time(b) / 1e3


class _Matmul:
    def __init__(self):
        self.x = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
        self.w = torch.randn(4096, 14336, device="cuda", dtype=torch.bfloat16)

    def run(self, n: int = 40) -> None:
        for _ in range(n):
            self.x[:, :4096].copy_((self.x @ self.w)[:, :4096] * 1e-3)


def main() -> None:
    args = _args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    copier = BatchCopier(dev)
    print(copier.describe(), flush=True)
    gather = _gather_kernel()
    mm = _Matmul()
    compute = torch.cuda.current_stream()
    side_a, side_b = torch.cuda.Stream(), torch.cuda.Stream()
    mm.run(10)
    torch.cuda.synchronize()
    alone = statistics.median(_timed(compute, mm.run) for _ in range(5))
    print(f"matmul loop alone: {alone * 1e3:.2f} ms", flush=True)
    rows = []
    for name in args.sizes.split(","):
        rows += _size(args, name, copier, gather, mm, alone, compute, side_a, side_b)
        torch.cuda.empty_cache()
    heads = ["block", "groups", "piece KiB", "ce onboard GB/s", "ce offload", "ce both",
             "matmul +% (ce both)"]
    heads += [f"sm {p} progs GB/s / matmul +%" for p in args.programs.split(",")]
    print("| " + " | ".join(heads) + " |")
    print("|" + "---|" * len(heads))
    for r in rows:
        print("| " + " | ".join(str(c) for c in r) + " |")


def _size(args, name, copier, gather, mm, alone, compute, side_a, side_b) -> list:
    dev = torch.device("cuda")
    rng = np.random.default_rng(0)
    rows = []
    bsize = SIZES[name]
    n = int(args.gib * (1 << 30)) // bsize
    gpu = torch.empty((2 * n, bsize), dtype=torch.uint8, device=dev)
    host = torch.empty((2 * n, bsize), dtype=torch.uint8, pin_memory=True)
    host.view(torch.int64).fill_(7)
    hdev = torch.as_tensor(_Uva(host.view(torch.int64)), device=dev)
    src = rng.permutation(2 * n)[:n].astype(np.int64)
    dst = rng.permutation(2 * n)[:n].astype(np.int64)
    src2 = rng.permutation(2 * n)[:n].astype(np.int64)
    dst2 = np.setdiff1d(np.arange(2 * n), dst)[:n]  # offload reads blocks the onboard does not write
    sidx, didx = torch.from_numpy(src).to(dev), torch.from_numpy(dst).to(dev)
    gbytes = n * bsize / 1e9
    for groups in [int(g) for g in args.groups.split(",")]:
        piece = bsize // groups
        if piece < 4096:
            continue
        spans = [(g * piece, (g + 1) * piece) for g in range(groups)]

        def ce(st, a, b, s, d, spans=spans):
            def go():
                for lo, hi in spans:
                    copier.copy(st, a[:, lo:hi], b[:, lo:hi], s, d)
            return go

        on = ce(side_a, host, gpu, src, dst)
        off = ce(side_b, gpu, host, dst2, src2)
        t_on = statistics.median(_timed(side_a, on) for _ in range(args.reps))
        t_off = statistics.median(_timed(side_b, off) for _ in range(args.reps))
        both = []
        for _ in range(args.reps):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            on()
            off()
            torch.cuda.synchronize()
            both.append(time.perf_counter() - t0)
        # the matmul while copies in both directions run
        torch.cuda.synchronize()
        on()
        off()
        with_ce = _timed(compute, mm.run)
        torch.cuda.synchronize()
        row = [name, groups, piece >> 10, f"{gbytes / t_on:.1f}", f"{gbytes / t_off:.1f}",
               f"{2 * gbytes / statistics.median(both):.1f}", f"{100 * (with_ce / alone - 1):+.1f}%"]
        for nprog in [int(p) for p in args.programs.split(",")]:
            words = piece // 8

            def sm(nprog=nprog, words=words, spans=spans):
                with torch.cuda.stream(side_a):
                    for lo, _ in spans:
                        gather[(nprog,)](hdev, gpu.view(torch.int64), sidx, didx, n, words,
                                         bsize // 8, bsize // 8, lo // 8, nprog, BLOCK=1024)

            sm()
            torch.cuda.synchronize()
            t_sm = statistics.median(_timed(side_a, sm) for _ in range(args.reps))
            torch.cuda.synchronize()
            sm()
            with_sm = _timed(compute, mm.run)
            torch.cuda.synchronize()
            ok = bool(torch.equal(gpu[dst[:4]], host[src[:4]].to(dev)))
            bad = "" if ok else " WRONG"
            row.append(f"{gbytes / t_sm:.1f} / {100 * (with_sm / alone - 1):+.1f}%{bad}")
        rows.append(row)
        print(" | ".join(str(c) for c in row), flush=True)
    return rows


if __name__ == "__main__":
    main()
