"""Where a step's fixed cost goes, and what paged decodes and piecewise CUDA graphs take
off it. From the
repo root of a CUDA machine:

    python3 scripts/gpu/step_probe.py

Llama-3-8B's geometry over a stand-in paged pool (2 MiB blocks), one step of each
shape below run three ways side by side: eagerly with the decodes' keys gathered out of
the pool (kvdist before 2026-12-01, later), eagerly with the decodes read in place
(``paged_decode``), and with the per-token work also replayed from CUDA graphs
(``Decoder.capture_graphs``): the host's time to issue the step, the whole step (to the
synchronize), and how far the logits differ. Then the profiler's busiest host ops of one
step, eager and graphed."""

from __future__ import annotations

import time

import numpy as np
import torch

from kvdist.sim.engine.model import Decoder, Geometry, Segment
from kvdist.sim.engine.parallel import TensorParallel

SHAPES = [  # (prefills, prefill tokens, decodes), context 3,800
    (0, 0, 6), (0, 0, 32), (1, 600, 6), (1, 2000, 6), (3, 600, 22)]


class PoolCache:
    def __init__(self, pool: torch.Tensor):
        self.pool = pool

    def kv_pool(self, layer: int) -> torch.Tensor:
        return self.pool[:, layer]


def step(model, cache, table, segs) -> tuple[float, float, tuple]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.forward_cached(cache, table, segs)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return t1 - t0, time.perf_counter() - t0, out


def main() -> None:
    dev = torch.device("cuda:0")
    print("torch", torch.__version__, torch.cuda.get_device_name(0))
    try:
        import triton
        print("triton", triton.__version__)
    except ImportError as e:
        print("no triton:", e)
    L, H, D, tpb, ctx, blocks = 32, 8, 128, 16, 3800, 6144
    pool = torch.randn(blocks, L, 2, tpb, H, D, device=dev, dtype=torch.bfloat16)
    cache = PoolCache(pool)
    g = Geometry(L, H, D, 4, 4096, 14336, 128256)
    model = Decoder(g, seed=0, tp=TensorParallel(None), device=dev, kv_dtype=torch.bfloat16,
                    compute_dtype=torch.bfloat16, tokens_per_block=tpb)
    rng = np.random.default_rng(0)
    cases = []
    for p, pt, d in SHAPES:
        starts = [ctx - pt] * p + [ctx] * d
        lens = [pt] * p + [1] * d
        width = -(-max(s + q for s, q in zip(starts, lens)) // tpb)
        table = torch.from_numpy(rng.integers(0, blocks, (p + d, width)).astype(np.int32)).to(dev)
        segs = [Segment(i, s, rng.integers(0, g.vocab, q).astype(np.int32)) for i, (s, q) in
                enumerate(zip(starts, lens))]
        cases.append((f"{p} x {pt} + {d} decodes ({sum(lens)} tokens)", table, segs))
    t = time.perf_counter()
    model.capture_graphs()
    torch.cuda.synchronize()
    took, graphs = time.perf_counter() - t, model.graphs
    print(f"captured {len(graphs.buckets)} buckets x {L + 1} graphs in {took:.1f} s; "
          f"memory allocated {torch.cuda.memory_allocated() / 2**30:.1f} GiB, "
          f"reserved {torch.cuda.memory_reserved() / 2**30:.1f} GiB")
    modes = [("eager, decodes gathered", None, False), ("eager, decodes paged", None, True),
             ("graphs, decodes paged", graphs, True)]
    results = {}
    for mode, g_, paged in modes:
        model.graphs, model.attention.paged_decodes = g_, paged
        for name, table, segs in cases:
            step(model, cache, table, segs)
            runs = [step(model, cache, table, segs) for _ in range(10)]
            results[mode, name] = (np.median([r[0] for r in runs]), np.median([r[1] for r in runs]),
                                   runs[-1][2])
    print(f"{'step':38s}" + "".join(f" {m:>26s}" for m, _, _ in modes) + f" {'max|dlogit|/max':>16s}")
    for name, _, _ in cases:
        base = results[modes[0][0], name]
        line = f"{name:38s}"
        for mode, _, _ in modes:
            hi, tot, _ = results[mode, name]
            line += f"   {hi * 1e3:6.1f} / {tot * 1e3:6.1f} ms {base[1] / tot:4.2f}x"
        lg, elg = results[modes[-1][0], name][2][0], base[2][0]
        print(line + f" {float((lg - elg).abs().max() / elg.abs().max()):16.1e}")
    print("(each: host time to issue the step / whole step; speed-up against the first)")
    model.attention.paged_decodes = True
    graphs, model.graphs = model.graphs, None
    name, table, segs = cases[1]
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, cache, table, segs)
    print(f"eager step {name}: busiest host ops")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))
    model.graphs = graphs
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        step(model, cache, table, segs)
    print(f"graphed step {name}: busiest host ops")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14))


if __name__ == "__main__":
    main()
