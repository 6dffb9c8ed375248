"""Where a forward step's time goes when the scheduler runs ahead, with and without the
next step's copies in flight (bench layerwise's loop, 2 MiB blocks, 1 GiB a step):
the profiler's busiest GPU operations and the compute stream's busy time per step.

    python3 scripts/gpu/runahead_probe.py [--block 2MiB] [--steps 4]
"""

from __future__ import annotations

import argparse

import torch
from torch.profiler import ProfilerActivity, profile

from kvdist.bench.layerwise import TOKEN_BYTES, _cache, _forward, _Layers
from kvdist.units import parse_size


def _loop(copies: bool, block: int, steps: int, groups, trace: str | None = None) -> None:
    n = (1 << 30) // block
    tpb = block // TOKEN_BYTES
    prompts = [list(range(k * 10**6, k * 10**6 + n * tpb)) + [7] for k in range(3)]
    cache = _cache(block, n, groups, (2 if copies else 3) * (n + 1) + 2)
    try:
        layers, stream = _Layers(2048, cache.device), torch.cuda.current_stream()
        last = None

        def step(i: int) -> None:
            nonlocal last
            cache.begin_step()
            reused = cache.add_sequence(i, prompts[i % 3])
            table = cache.block_table([i])
            _forward(cache, layers, table, reused // tpb)
            end = torch.cuda.Event()
            end.record(stream)
            cache.end_step()
            if i:
                cache.release(i - 1)
            if last is not None:
                last.synchronize()
            last = end

        for i in range(9):
            step(i)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            for i in range(9, 9 + steps):
                step(i)
            torch.cuda.synchronize()
        label = f"{'copies' if copies else 'no copies'}, groups {groups}"
        if trace:
            prof.export_chrome_trace(f"{trace}-{'copies' if copies else 'none'}-{groups}.json")
        events = prof.key_averages()
        total = sum(e.device_time_total for e in events if e.device_type.name == "CUDA")
        print(f"== {label}: GPU op time {total / 1e3 / steps:.1f} ms a step (all streams)")
        print(events.table(sort_by="device_time_total", row_limit=8, max_name_column_width=60))
        print(events.table(sort_by="self_cpu_time_total", row_limit=16, max_name_column_width=60))
    finally:
        cache.close()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--block", default="2MiB")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--trace", default=None, help="also write chrome traces to this path prefix")
    args = p.parse_args()
    block = parse_size(args.block)
    _loop(False, block, args.steps, "auto", args.trace)
    _loop(True, block, args.steps, "auto", args.trace)


if __name__ == "__main__":
    main()
