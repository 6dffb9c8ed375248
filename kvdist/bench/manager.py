"""``python -m kvdist bench manager``: the bookkeeping cost of a serving trace, kvdist's
:class:`~kvdist.manager.CacheManager` side by side with a straightforward pure-Python
block manager (:mod:`kvdist.bench.baseline`) on the same trace and GPU capacity.
Then the cost per block of each call of a step that moves many blocks, block by block
and in runs (``BlockPool.batch_moves``), side by side (``breakdown``): by default 8,192
one-token blocks, bench layerwise's 1 GiB step of 128 KiB blocks; ``block_table`` is
``KVCache.block_table``'s host work (the rows, rule S4's marks, S5's submission).

The trace: requests whose prompts are one of a handful of system prompts plus a user
turn (some continue an earlier conversation), 32-token blocks, batches of 16 that are
prefilled in one step and then decode 48 steps (one token per sequence per step, a
block table every step), then released. Only bookkeeping is measured: the caches hold
no tensors and no copy runs (kvdist's transfer engine still orders and batches every
tier move it would make)."""

from __future__ import annotations

import argparse
import gc
import time
from dataclasses import dataclass

import numpy as np
from tabulate import tabulate
from tqdm import tqdm

from ..layout import KVLayout
from ..manager import CacheManager
from ..transfer.executors import NullExecutor
from .baseline import BaselineBlockManager

VOCAB = 32_000


@dataclass(slots=True)
class Batch:
    prompts: list[tuple[int, list[int]]]  # (seq_id, prompt tokens)
    decode: list[list[tuple[int, list[int]]]]  # per step: (seq_id, [token])


@dataclass(slots=True)
class Trace:
    batches: list[Batch]
    requests: int
    prompt_tokens: int
    block_ops: int  # blocks taken plus blocks given back over the whole trace
    steps: int


def make_trace(requests: int, *, batch: int = 16, decode_steps: int = 48, block_size: int = 32,
               system_prompts: int = 6, follow_up: float = 0.25, seed: int = 0) -> Trace:
    """A deterministic serving trace (see the module docstring)."""
    rng = np.random.default_rng(seed)
    systems = [rng.integers(0, VOCAB, int(n)).tolist()
               for n in rng.integers(256, 2049, system_prompts)]
    popularity = 1.0 / np.arange(1, system_prompts + 1)
    popularity /= popularity.sum()
    finished: list[list[int]] = []  # whole conversations so far, for follow-ups
    batches, prompt_tokens, block_ops = [], 0, 0
    for first in range(0, requests, batch):
        ids = range(first, min(first + batch, requests))
        prompts = []
        for r in ids:
            if finished and rng.random() < follow_up:
                head = finished[int(rng.integers(len(finished)))]
                user = rng.integers(0, VOCAB, int(rng.integers(32, 257))).tolist()
            else:
                head = systems[int(rng.choice(system_prompts, p=popularity))]
                user = rng.integers(0, VOCAB, int(rng.integers(64, 1537))).tolist()
            prompts.append((r, head + user))
        out = {r: rng.integers(0, VOCAB, decode_steps).tolist() for r in ids}
        decode = [[(r, [out[r][t]]) for r in ids] for t in range(decode_steps)]
        for r, p in prompts:
            finished.append(p + out[r])
            prompt_tokens += len(p)
            block_ops += 2 * -(-(len(p) + decode_steps) // block_size)
        batches.append(Batch(prompts, decode))
    return Trace(batches, requests, prompt_tokens, block_ops, len(batches) * (decode_steps + 1))


def _noop() -> None:
    pass


@dataclass(slots=True)
class Run:
    name: str
    prefill: np.ndarray  # seconds of each batch's prefill step
    decode: np.ndarray  # seconds of each batch's 48 decode steps (and its releases)
    hit_tokens: int = 0
    evictions: int = 0

    @property
    def prefill_s(self) -> float:
        return float(self.prefill.sum())

    @property
    def decode_s(self) -> float:
        return float(self.decode.sum())

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


def replay(trace: Trace, m, begin_step=_noop, before_compute=_noop) -> tuple[np.ndarray, np.ndarray]:
    """Drive manager ``m`` through the trace; seconds of each batch's prefill step and
    of its decode steps. Releases are timed with the step that ends the batch."""
    clock = time.perf_counter
    prefill, decode = [], []
    for b in trace.batches:
        ids = [r for r, _ in b.prompts]
        t0 = clock()
        begin_step()
        for r, p in b.prompts:
            m.add_sequence(r, p)
        m.table_rows(ids)
        before_compute()
        m.end_step()
        t1 = clock()
        for step in b.decode:
            begin_step()
            for r, tok in step:
                m.append_tokens(r, tok)
            m.table_rows(ids)
            before_compute()
            m.end_step()
        for r in ids:
            m.release(r)
        t2 = clock()
        prefill.append(t1 - t0)
        decode.append(t2 - t1)
    return np.array(prefill), np.array(decode)


def run_kvdist(trace: Trace, gpu_blocks: int, host_blocks: int, block_size: int) -> Run:
    layout = KVLayout(1, 1, 1, "float16", block_size)
    m = CacheManager(layout, (gpu_blocks, host_blocks, 0), NullExecutor())
    gc.collect()
    p, d = replay(trace, m, m.begin_step, m.before_compute)
    name = "kvdist gpu" if not host_blocks else f"kvdist gpu + host ({host_blocks:,})"
    return Run(name, p, d, sum(m.counters.hit_tokens), m.counters.evictions[0])


def run_baseline(trace: Trace, gpu_blocks: int, block_size: int) -> Run:
    layout = KVLayout(1, 1, 1, "float16", block_size)
    m = BaselineBlockManager(gpu_blocks, block_size, salt=layout.hash_salt())
    gc.collect()
    p, d = replay(trace, m)
    return Run("baseline (deque + dict)", p, d, m.hit_tokens, m.evictions)


def best(runs: list[Run]) -> Run:
    """Each batch's fastest time over the repeats (every repeat does the same work in
    the same state, so this filters out what other processes did to the clock)."""
    r = runs[0]
    return Run(r.name, np.min([x.prefill for x in runs], axis=0),
               np.min([x.decode for x in runs], axis=0), r.hit_tokens, r.evictions)


@dataclass(slots=True)
class Breakdown:
    """Seconds of each call of the measured steps (``CALLS``)."""

    mode: str
    calls: dict[str, list[float]]
    moved: int  # blocks onboarded plus offloaded a step


CALLS = ("plan", "commit", "block_table", "end_step", "release")


def breakdown(blocks: int, *, batch_moves: bool, steps: int = 5) -> Breakdown:
    """bench layerwise's admission on the bookkeeping alone: three prompts of ``blocks``
    one-token blocks take turns on a GPU tier that holds two, so every step onboards a
    whole prompt from the host tier and offloads as many blocks to it."""
    layout = KVLayout(1, 1, 1, "float16", 1)
    m = CacheManager(layout, (2 * blocks + 8, 3 * blocks + 8, 0), NullExecutor())
    m.pool.batch_moves = batch_moves
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, VOCAB, blocks + 1).tolist() for _ in range(3)]
    calls: dict[str, list[float]] = {c: [] for c in CALLS}
    clock = time.perf_counter
    moved0 = 0
    gc.collect()
    for i in range(6 + steps):  # two rounds fill the tiers
        if i == 6:
            moved0 = sum(m.counters.blocks_moved.values())
        m.begin_step()
        t0 = clock()
        plan = m.plan(i, prompts[i % 3])
        t1 = clock()
        m.commit(plan)
        t2 = clock()
        # KVCache.block_table's host work: the rows, S4's marks, S5 (every copy submitted).
        m.engine.compute_uses(m.table_rows([i]))
        m.before_compute()
        t3 = clock()
        m.end_step()
        t4 = clock()
        if i:
            m.release(i - 1)
        t5 = clock()
        if i >= 6:
            for c, t in zip(CALLS, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                calls[c].append(t)
    moved = (sum(m.counters.blocks_moved.values()) - moved0) // steps
    return Breakdown("runs at once" if batch_moves else "block by block", calls, moved)


def print_breakdown(blocks: int, repeat: int) -> None:
    """Both modes, interleaved ``repeat`` times; each call's best step, in µs a block."""
    runs: dict[bool, list[Breakdown]] = {False: [], True: []}
    for _ in range(repeat):
        for batch in (False, True):
            runs[batch].append(breakdown(blocks, batch_moves=batch))
    rows = []
    for batch in (False, True):
        best_of = {c: min(min(r.calls[c]) for r in runs[batch]) for c in CALLS}
        per = lambda t: f"{t / blocks * 1e6:.2f}"  # noqa: E731
        rows.append([runs[batch][0].mode, *(per(best_of[c]) for c in CALLS), per(sum(best_of.values())),
                     f"{runs[batch][0].moved:,}"])
    what = " (bench layerwise's 1 GiB step of 128 KiB blocks)" if blocks == 8192 else ""
    print(f"\na step admitting a prompt of {blocks:,} blocks from the host tier (offloading as many){what}: "
          f"µs a block of each call, best of {repeat} x 5 steps")
    print(tabulate(rows, headers=["moves", *CALLS, "step", "blocks moved a step"], disable_numparse=True))


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdist bench manager", description=__doc__)
    ap.add_argument("--requests", type=int, default=2000)
    ap.add_argument("--gpu-blocks", default="4096,32768",
                    help="comma-separated GPU capacities in blocks, one table each")
    ap.add_argument("--host-ratio", type=int, default=4,
                    help="the extra kvdist run has a host tier of this many times the GPU blocks")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=3,
                    help="runs of each; each batch counts with its fastest time")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--onboard-blocks", type=int, default=8192,
                    help="blocks a step onboards in the per-call breakdown (bench layerwise's 1 GiB of "
                         "128 KiB blocks); 0 skips it")
    args = ap.parse_args(argv)

    trace = make_trace(args.requests, block_size=args.block_size, seed=args.seed)
    steps, ops = trace.steps, trace.block_ops
    print(f"trace: {trace.requests} requests, {trace.prompt_tokens:,} prompt tokens, "
          f"{len(trace.batches)} batches of 16 x (1 prefill + 48 decode steps) = {steps:,} steps, "
          f"{ops:,} block operations (each block taken and given back), "
          f"{args.block_size}-token blocks")
    capacities = [int(x) for x in args.gpu_blocks.split(",")]
    jobs = [(g, kind) for g in capacities for kind in ("baseline", "gpu", "host")]
    results: dict[tuple[int, str], list[Run]] = {j: [] for j in jobs}
    with tqdm(total=len(jobs) * args.repeat, desc="replaying", leave=False) as bar:
        for _ in range(args.repeat):
            for g, kind in jobs:  # interleaved, so drift hits every contender alike
                if kind == "baseline":
                    r = run_baseline(trace, g, args.block_size)
                else:
                    r = run_kvdist(trace, g, g * args.host_ratio if kind == "host" else 0,
                                   args.block_size)
                results[g, kind].append(r)
                bar.update()
    n_prefill, n_decode = len(trace.batches), steps - len(trace.batches)
    for g in capacities:
        base = best(results[g, "baseline"])
        rows = []
        for kind in ("baseline", "gpu", "host"):
            r = best(results[g, kind])
            rows.append([r.name, f"{r.total_s / steps * 1e6:.1f}", f"{r.prefill_s / n_prefill * 1e6:.0f}",
                         f"{r.decode_s / n_decode * 1e6:.1f}", f"{r.total_s / ops * 1e6:.2f}",
                         f"{r.hit_tokens:,}", f"{r.evictions:,}", f"{base.total_s / r.total_s:.2f}x"])
        print(f"\nGPU capacity {g:,} blocks (best of {args.repeat})")
        print(tabulate(rows, headers=["manager", "µs/step", "µs/prefill step", "µs/decode step",
                                      "µs/block op", "hit tokens", "gpu evictions", "speedup"],
                       disable_numparse=True))
        same = best(results[g, "gpu"])
        if (same.hit_tokens, same.evictions) != (base.hit_tokens, base.evictions):
            print("WARNING: kvdist (gpu only) and the baseline disagree on hits or evictions")
            return 1
        print("kvdist (gpu only) and the baseline made the same hits and evictions.")
    if args.onboard_blocks:
        print_breakdown(args.onboard_blocks, args.repeat)
    return 0
