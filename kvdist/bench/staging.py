"""``python -m kvdist bench staging``: what staging a step's block table costs (rule S3)
next to the step's bookkeeping, in one run, on the same batch.

The batch: 256 sequences of 128 blocks decode together, one token each per step, a
block table every step; then they are released and a new batch is prefilled. Per decode
step it times, on the host:

* bookkeeping: ``begin_step``, 256 ``append_tokens``, S5 (``before_compute``), ``end_step``;
* staging: the rows brought up to date and looked up, the gather of the table into a
  ring slot, the host->device copy queued with its event (``block_table`` minus S5);
* for reference, the table as it was built before the stager (``np.full``, a row at a
  time, a pageable copy).

On CUDA a stand-in forward pass (a GPU spin of ``--forward-us``) follows each table and
the engine waits for step N-1's forward before preparing step N+1, so step N's copy is
still queued when step N+1 is staged: the overlap S3 is about. It counts the pinned
allocations, ring waits and host synchronizations of the stager, and CUDA calls that
synchronize (torch's sync debug mode), in steady state (after the warm-up round)."""

from __future__ import annotations

import argparse
import time
import warnings

import numpy as np
import torch
from tabulate import tabulate
from tqdm import tqdm

from ..candidate import select_device
from ..testing import Seams, create


def _old_table(manager, ids: list, device: torch.device) -> torch.Tensor:
    """block_table before the stager: a fresh array filled a row at a time, copied from
    pageable memory (a copy that is done on return: a hidden host wait on CUDA)."""
    seqs = [manager.seqs[i] for i in ids]
    width = max(len(s.slots) for s in seqs)
    table = np.full((len(seqs), width), -1, dtype=np.int32)
    for row, seq in zip(table, seqs):
        row[: len(seq.slots)] = seq.slots
    out = torch.from_numpy(table)
    return out.to(device) if device.type != "cpu" else out


def _spin_cycles(us: float) -> int:
    return int(us * torch.cuda.get_device_properties(torch.cuda.current_device()).clock_rate / 1000)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="python -m kvdist bench staging", description=__doc__)
    ap.add_argument("--seqs", type=int, default=256)
    ap.add_argument("--blocks", type=int, default=128, help="blocks per sequence at prefill")
    ap.add_argument("--tokens-per-block", type=int, default=16)
    ap.add_argument("--decode-steps", type=int, default=64, help="decode steps per round")
    ap.add_argument("--rounds", type=int, default=4, help="rounds; the first one is warm-up")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--forward-us", type=float, default=5000.0,
                    help="CUDA: the stand-in forward pass after each table (GPU spin)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    device = select_device(args.device)
    tpb = args.tokens_per_block
    growth = -(-args.decode_steps // tpb) + 2
    seams = Seams()  # the stages of block_table are timed one by one
    cache = create({"model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8, "dtype": "float16"},
                    "cache": {"tokens_per_block": tpb, "device": str(device),
                              "gpu": {"blocks": args.seqs * (args.blocks + growth)},
                              "host": {"bytes": 0}, "enable_reuse": True}}, seams)
    try:
        return _run(cache, seams, args, device)
    finally:
        cache.close()


def _run(cache, seams: Seams, args, device: torch.device) -> int:
    m, stager, host_table = seams.manager, seams.stager, seams.manager.host_table
    cuda = device.type == "cuda"
    clock = time.perf_counter
    rng = np.random.default_rng(args.seed)
    prompt_len = args.blocks * args.tokens_per_block - args.tokens_per_block // 2
    spin = _spin_cycles(args.forward_us) if cuda and args.forward_us > 0 else 0
    side = torch.cuda.Stream(device) if cuda else None  # the reference path, kept off compute
    names = ("bookkeeping", "rows", "gather", "copy", "staging", "old table")
    decode: dict[str, list[float]] = {n: [] for n in names}
    prefill: dict[str, list[float]] = {"bookkeeping": [], "staging": []}
    syncs = dict.fromkeys(("staging", "bookkeeping", "old table"), 0)
    in_flight: list[int] = []
    steady_from: dict = {}
    forwards: list[torch.cuda.Event] = []

    def forward() -> None:
        """The stand-in forward pass; the engine keeps two in flight (it prepares step N+1
        while step N-1 may still run), waiting for the oldest: its wait, not the stager's."""
        if not spin:
            return
        torch.cuda._sleep(spin)
        ev = torch.cuda.Event()
        ev.record()
        forwards.append(ev)
        if len(forwards) > 2:
            forwards.pop(0).synchronize()

    def old_table() -> None:
        if side is None:
            _old_table(m, ids, device)
        else:
            with torch.cuda.stream(side):
                _old_table(m, ids, device)

    bar = tqdm(total=args.rounds * (args.decode_steps + 1), desc="steps", leave=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rnd in range(args.rounds):
            if rnd == 1:  # warm-up done: from here on everything counts
                if cuda:
                    torch.cuda.synchronize()
                    torch.cuda.set_sync_debug_mode("warn")
                steady_from = dict(stager.stats())
            ids = list(range(rnd * args.seqs, (rnd + 1) * args.seqs))
            prompts = [rng.integers(0, 32000, prompt_len).tolist() for _ in ids]
            t0 = clock()
            cache.begin_step()
            for i, p in zip(ids, prompts):
                cache.add_sequence(i, p)
            t1 = clock()
            stager.upload_buffer(m.table_rows(ids, stager.host_buffer))
            t2 = clock()
            m.before_compute()
            cache.end_step()
            t3 = clock()
            forward()
            bar.update()
            if rnd:
                prefill["bookkeeping"].append(t1 - t0 + t3 - t2)
                prefill["staging"].append(t2 - t1)
            for step in range(args.decode_steps):
                tok = [step]
                w0 = len(caught)
                t0 = clock()
                cache.begin_step()
                for i in ids:
                    m.append_tokens(i, tok)
                t1 = clock()
                w1 = len(caught)
                in_flight.append(stager.in_flight())
                t1s = clock()
                rows, width = host_table.rows_for(ids, m.seqs)
                t2 = clock()
                buf = host_table.gather(rows, width, stager.host_buffer((len(rows), width), np.int32))
                t3 = clock()
                stager.upload_buffer(buf)
                t4 = clock()
                w2 = len(caught)
                m.before_compute()
                cache.end_step()
                t5 = clock()
                w3 = len(caught)
                old_table()
                t6 = clock()
                w4 = len(caught)
                forward()
                bar.update()
                if rnd:
                    times = (t1 - t0 + t5 - t4, t2 - t1s, t3 - t2, t4 - t3, t4 - t1s, t6 - t5)
                    for n, v in zip(names, times):
                        decode[n].append(v)
                    syncs["staging"] += w2 - w1
                    syncs["bookkeeping"] += (w1 - w0) + (w3 - w2)
                    syncs["old table"] += w4 - w3
                else:
                    in_flight.pop()
            for i in ids:
                cache.release(i)
        bar.close()
        if cuda:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize()
    end = stager.stats()
    _report(args, device, decode, prefill, steady_from, end, in_flight, syncs, spin)
    return 0


def _us(xs: list[float], q: float) -> float:
    return float(np.quantile(np.asarray(xs), q)) * 1e6


def _report(args, device, decode, prefill, start, end, in_flight, syncs, spin) -> None:
    cuda = device.type == "cuda"
    batch = f"{args.seqs} sequences x {args.blocks}+ blocks"
    print(f"bench staging: {batch}, {args.tokens_per_block}-token blocks, device {device}, "
          f"{args.rounds - 1} measured rounds of 1 prefill + {args.decode_steps} decode steps "
          f"(1 warm-up round), ring of {end['slots']} slots, upload path {end['path']}")
    if not end["pinned"]:
        print("pinned memory: unavailable (no CUDA); the ring is plain host memory, its allocations "
              "are counted all the same")
    if cuda and spin:
        print(f"GPU: a {args.forward_us:.0f} us stand-in forward pass per step; the engine prepares "
              f"step N+1 while step N-1 may still run (it waits for the forward pass of N-1 only then)")
    rows = [
        ["decode: bookkeeping (begin, appends, S5, end)", _us(decode["bookkeeping"], .5),
         _us(decode["bookkeeping"], .9)],
        ["decode: staging (total)", _us(decode["staging"], .5), _us(decode["staging"], .9)],
        ["  rows brought up to date + looked up", _us(decode["rows"], .5), _us(decode["rows"], .9)],
        ["  gather into the ring slot", _us(decode["gather"], .5), _us(decode["gather"], .9)],
        ["  copy queued + event", _us(decode["copy"], .5), _us(decode["copy"], .9)],
        ["decode: the table before the stager (reference)", _us(decode["old table"], .5),
         _us(decode["old table"], .9)],
        ["prefill: bookkeeping (begin, 256 adds, S5, end)", _us(prefill["bookkeeping"], .5),
         _us(prefill["bookkeeping"], .9)],
        ["prefill: staging", _us(prefill["staging"], .5), _us(prefill["staging"], .9)],
    ]
    print(tabulate(rows, headers=["per step", "median us", "p90 us"], floatfmt=".1f"))
    steady = {k: end[k] - start[k] for k in ("pinned_allocs", "ring_waits", "host_syncs", "stages")}
    counts = [
        ["staged copies (measured rounds)", steady["stages"]],
        ["pinned allocations in steady state", steady["pinned_allocs"]],
        ["ring waits in steady state", steady["ring_waits"]],
        ["stager host syncs in steady state", steady["host_syncs"]],
        ["synchronizing CUDA calls in staging (torch sync debug)", syncs["staging"] if cuda else "n/a"],
        ["... in bookkeeping", syncs["bookkeeping"] if cuda else "n/a"],
        ["... in the table before the stager (reference)", syncs["old table"] if cuda else "n/a"],
        ["copies in flight when the next table was staged (mean)", f"{np.mean(in_flight):.2f}"],
        ["ring allocations in warm-up", start["pinned_allocs"]],
        ["ring bytes", end["pinned_bytes"]],
    ]
    print(tabulate(counts, headers=["steady state", "count"]))
    stage, book = _us(decode["staging"], .5), _us(decode["bookkeeping"], .5)
    ok = stage <= book and not steady["pinned_allocs"] and not steady["host_syncs"] and not syncs["staging"]
    print(f"goal (staging <= bookkeeping, no pinned allocation, no host sync in steady state): "
          f"{'met' if ok else 'NOT met'} — staging {stage:.1f} us vs bookkeeping {book:.1f} us "
          f"per decode step")
