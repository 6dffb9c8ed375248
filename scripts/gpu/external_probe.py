"""The KV connector's worker path on the GPU (issue 28.4): kvdist's host tier and the
engine's own paged KV tensors, laid out as vLLM 0.33 lays them out, at 16-token blocks
of Llama-3-8B (32 layers, 128 head dim, bf16) at TP 1 (8 KV heads: 64 KiB a layer, 2
MiB a block) and TP 8 (1 KV head: 8 KiB a layer, 256 KiB a block).

    python3 scripts/gpu/external_probe.py [--gib 1] [--tp 1,8] [--gather auto,direct]
        [--alloc one,per-layer,blocks] [--groups auto,32] [--rounds 3] [--json FILE]

Per configuration, ``--gib`` of blocks a direction, engine block ids drawn at random
from tensors of twice that many blocks, through exactly what a connector calls:
``ExternalPlanner.plan_save`` / ``plan_load`` / ``take`` on the scheduler's side,
``ExternalCache.start`` / ``wait_layer`` / ``synchronize`` on the worker's:

* offload: prompts' blocks saved out of the engine's blocks, two steps' ``start`` back to
  back, until every copy is complete (the host may run ahead, as in ``bench transfer``);
* onboard: a prompt loaded into other engine blocks, two steps back to back, each with
  ``wait_layer(l)`` for every layer and an event on the compute stream after each; and
  one step alone: ms until layer 0's event, the last layer's (the layer-wise wait);
* both: a new prompt saved while the last one loads, one ``start``.

Side by side: the contiguous pinned copy of the same bytes (the ceiling, as ``bench
transfer`` measures it) and ``bench transfer``'s batched offload / onboard of scattered
whole blocks of the same size (kvdist's own GPU tier), run here (``--no-bench`` skips
it). The goal (issue 28): >= 90% of ``bench transfer``'s figures.

``--gather``: how a block moves (``kvdist/external/cuda.py``): ``direct``, an entry a
piece (a layer's) in one cudaMemcpyBatchAsync, 32 entries a block; ``staged``, whole
blocks through a device staging buffer, then one kernel a layer group scatters the
pieces; ``rows``, whole blocks straight (only where a block's layers are adjacent);
``auto`` (the default of a cache): ``rows`` where it can, else ``staged`` for pieces
under 256 KiB. ``--alloc``: the engine's layers in ``one`` LBNHC buffer (one kernel moves
every layer of a group), an allocation ``per-layer``, or ``blocks``: vLLM's cross-layer
BLNHC buffer, where a block's layers are adjacent."""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time

import numpy as np
import torch

L, D, T, HEADS = 32, 128, 16, 8
DEVICE = "cuda"  # the engine's tensors (a dry run of the calls on CPU sets "cpu")


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--gib", type=float, default=1.0, help="bytes moved a direction (GiB)")
    p.add_argument("--tp", default="1,8")
    p.add_argument("--gather", default="auto,direct",
                   help="auto: rows where the layout allows (--alloc blocks), else staged or direct")
    p.add_argument("--alloc", default="one,per-layer,blocks")
    p.add_argument("--groups", default="auto", help="cache.layer_groups values, e.g. auto,32")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--no-bench", action="store_true", help="skip bench transfer's figures")
    p.add_argument("--json", default=None)
    return p.parse_args()


def _engine_kv(n_blocks: int, heads: int, alloc: str) -> list[torch.Tensor]:
    """vLLM 0.33's per-layer views [blocks, heads, tokens, 2*D]: LBNHC in ``one`` buffer or
    an allocation ``per-layer``; ``blocks``: BLNHC, vLLM's cross-layer layout (a block's
    layers adjacent)."""
    shape = (n_blocks, T, heads, 2 * D)
    if alloc == "blocks":
        flat = torch.empty((n_blocks, L, T, heads, 2 * D), dtype=torch.bfloat16, device=DEVICE)
        return [flat[:, i].permute(0, 2, 1, 3) for i in range(L)]
    if alloc == "one":
        flat = torch.empty((L, *shape), dtype=torch.bfloat16, device=DEVICE)
        return [flat[i].permute(0, 2, 1, 3) for i in range(L)]
    return [torch.empty(shape, dtype=torch.bfloat16, device=DEVICE).permute(0, 2, 1, 3) for _ in range(L)]


def _ceiling(nbytes: int) -> tuple[float, float]:
    """Contiguous pinned copies of ``nbytes`` (GB/s D2H, H2D), best of three."""
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    g = torch.empty(nbytes, dtype=torch.uint8, device=DEVICE)
    side = torch.cuda.Stream()
    out = []
    for direction in ("d2h", "h2d"):
        best = 0.0
        for _ in range(4):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            with torch.cuda.stream(side):
                (h.copy_(g, non_blocking=True) if direction == "d2h" else g.copy_(h, non_blocking=True))
            side.synchronize()
            best = max(best, nbytes / (time.perf_counter() - t0) / 1e9)
        out.append(best)
    return out[0], out[1]


def _bench_transfer(label: str, n: int, rounds: int) -> dict:
    """bench transfer's (c) offload and (d) onboard for ``n`` blocks of this size."""
    from kvdist.bench import transfer

    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        transfer.main(["--sizes", label, "--blocks", str(n), "--rounds", str(rounds), "--json", f.name])
        row = json.load(open(f.name))["sizes"][0]
    return {k: row[k] for k in ("offload", "onboard", "both", "ceiling D2H", "ceiling H2D", "ceiling both")}


def _one(tp: int, alloc: str, gather: str, groups: str, args) -> dict:
    from kvdist.external import ExternalPlanner, create

    heads = HEADS // tp
    bpb = L * 2 * T * heads * D * 2
    n = max(1, int(args.gib * (1 << 30)) // bpb)
    cfg = {"model": {"num_layers": L, "num_kv_heads": heads, "head_dim": D, "dtype": "bfloat16"},
           "cache": {"tokens_per_block": T, "device": DEVICE, "gpu": "external",
                     "host": {"bytes": 3 * n * bpb},
                     "layer_groups": groups if groups == "auto" else int(groups)}}
    device = torch.device(DEVICE, torch.cuda.current_device()) if DEVICE == "cuda" else torch.device(DEVICE)
    worker = create(cfg, device=device)
    try:
        kv = _engine_kv(2 * n, heads, alloc)
        worker.register({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(kv)}, gather=gather)
        ex = worker.executor
        planner = ExternalPlanner(cfg, worker.tier_plan)
        rng = np.random.default_rng(0)
        compute = torch.cuda.current_stream()
        serial = [0]

        def prompt() -> list[int]:
            serial[0] += 1
            base = serial[0] * (n * T + 1)
            return list(range(base, base + n * T + 1))

        def ids() -> tuple[list[int], list[int]]:
            perm = rng.permutation(2 * n)
            return perm[:n].tolist(), perm[n:].tolist()

        def run(steps: list, layered: bool) -> tuple[float, list[float]]:
            """Issue ``steps`` (each a step's Transfers) back to back as an engine would
            (``start``, then ``wait_layer`` for every layer with an event on the compute
            stream after each when ``layered``), then wait for all: (seconds, [ms until
            layer 0's and the last layer's event of the first step])."""
            torch.cuda.synchronize()
            begin = torch.cuda.Event(enable_timing=True)
            begin.record(compute)
            t0 = time.perf_counter()
            first = []
            for step in steps:
                worker.start(step)
                if layered:
                    for layer in range(L):
                        worker.wait_layer(layer)
                        if len(first) < L:
                            ev = torch.cuda.Event(enable_timing=True)
                            ev.record(compute)
                            first.append(ev)
            torch.cuda.current_stream().synchronize()
            worker.synchronize()
            wall = time.perf_counter() - t0
            return wall, [begin.elapsed_time(m) for m in (first[0], first[-1])] if first else []

        def saves(k: int, a: list[int]) -> list:
            out = []
            for _ in range(k):
                assert len(planner.plan_save("s", prompt(), a).blocks) == n
                out.append(planner.take())
            return out

        def saved_prompt() -> tuple[list[int], list[int], list[int]]:
            a, b = ids()
            last = prompt()
            planner.plan_save("s", last, a)
            worker.start(planner.take())
            worker.synchronize()
            return last, a, b

        def loads(k: int, last: list[int], b: list[int], a: list[int] | None = None) -> list:
            out = []
            for _ in range(k):
                if a is not None:  # a new prompt saved out of a while the last one lands in b
                    assert len(planner.plan_save("s", prompt(), a).blocks) == n
                load = planner.plan_load("l", last, b)
                assert len(load.blocks) == n and not load.failed, load
                out.append(planner.take())
            return out

        reps = 2  # steps back to back (the host tier holds three prompts)
        runs: dict[str, list] = {"offload": [], "onboard": [], "both": [], "latency": []}
        run(saves(1, ids()[0]), False)  # warm-up: staging buffers, kernels
        last, a, b = saved_prompt()
        run(loads(1, last, b), True)
        for _ in range(args.rounds):
            runs["offload"].append(run(saves(reps, ids()[0]), False))
            last, a, b = saved_prompt()
            runs["latency"].append(run(loads(1, last, b), True))  # one step, idle streams
            runs["onboard"].append(run(loads(reps, last, b), True))
            last, a, b = saved_prompt()
            runs["both"].append(run(loads(reps // 2 or 1, last, b, a), True))
        nbytes = n * bpb
        st = ex.stats()
        lay = worker.layout
        res = {"tp": tp, "alloc": alloc, "gather": st.get("gather"), "stacked": st.get("stacked"),
               "groups": lay.groups_for(cfg["cache"]["layer_groups"], worker.config.cache.min_copy_piece),
               "block_bytes": bpb, "blocks": n, "copy_path": st["path"]}
        moved = {"offload": reps * nbytes, "onboard": reps * nbytes, "both": 2 * (reps // 2 or 1) * nbytes}
        for k, v in moved.items():
            res[k] = statistics.median(v / sec / 1e9 for sec, _ in runs[k])
        res["latency_ms"] = statistics.median(1e3 * sec for sec, _ in runs["latency"])
        res["layer0_ms"] = statistics.median(m[0] for _, m in runs["latency"])
        res["last_layer_ms"] = statistics.median(m[1] for _, m in runs["latency"])
        res["rounds"] = {k: [round(s, 4) for s, _ in v] for k, v in runs.items()}
        res["transfer"] = {k: v for k, v in ex.stats().items() if k in ("batches_by_path", "copy_entries")}
        return res
    finally:
        worker.close()


def main() -> int:
    args = _args()
    if not torch.cuda.is_available():
        print("external_probe needs CUDA; nothing measured")
        return 0
    rows, bench = [], {}
    for tp in (int(x) for x in args.tp.split(",")):
        bpb = L * 2 * T * (HEADS // tp) * D * 2
        n = max(1, int(args.gib * (1 << 30)) // bpb)
        ceil = _ceiling(n * bpb)
        label = {256 << 10: "256KiB", 2 << 20: "2MiB", 512 << 10: "512KiB", 128 << 10: "128KiB"}.get(bpb)
        if not args.no_bench and label is not None:
            bench[tp] = _bench_transfer(label, n, args.rounds)
        for alloc in args.alloc.split(","):
            for gather in args.gather.split(","):
                for groups in args.groups.split(","):
                    r = _one(tp, alloc, gather, groups, args)
                    r["ceiling"] = ceil
                    rows.append(r)
                    print(json.dumps(r), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; "
          f"{args.gib} GiB a direction, medians of {args.rounds} rounds")
    head = (f"{'TP':>2} {'block':>7} {'alloc':>9} {'gather':>6} {'grp':>3}  {'offload GB/s':>22}  "
            f"{'onboard GB/s':>22}  {'both GB/s':>16}  {'one load: layer 0 / last / done (ms)':>36}")
    print(head)
    for r in rows:
        b = bench.get(r["tp"])
        d2h, h2d = r["ceiling"]

        def pct(key: str, ceiling: float | None, ref: str, r=r, b=b) -> str:
            s = f"{r[key]:5.1f} (" + (f"{100 * r[key] / ceiling:3.0f}% ceil" if ceiling else "")
            if b:
                s += f"{', ' if ceiling else ''}{100 * r[key] / b[ref]:3.0f}% bt"
            return s + ")" if s[-1] != "(" else s[:-2]
        print(f"{r['tp']:>2} {r['block_bytes'] >> 10:>5}Ki {r['alloc']:>9} {r['gather']!s:>6} "
              f"{r['groups']:>3}  "
              f"{pct('offload', d2h, 'offload'):>22}  {pct('onboard', h2d, 'onboard'):>22}  "
              f"{pct('both', None, 'both'):>16}  {r['layer0_ms']:10.2f} / {r['last_layer_ms']:7.2f} / "
              f"{r['latency_ms']:7.2f}")
    for tp, b in bench.items():
        print(f"bench transfer at TP {tp}'s block size: offload {b['offload']:.1f}, "
              f"onboard {b['onboard']:.1f}, "
              f"both {b['both']:.1f} GB/s (ceilings {b['ceiling D2H']:.1f} / {b['ceiling H2D']:.1f} / "
              f"{b['ceiling both']:.1f})")
    print("GB/s: two steps issued back to back (one for both), start to the last copy; ceil: a contiguous "
          "pinned copy of the same bytes; bt: bench transfer's batched copies of whole blocks of this size "
          "(kvdist's own GPU tier). Goal: >= 90% of bt. One load: a step alone on idle streams, ms from "
          "start until the compute stream passed layer 0's wait, the last layer's, and the host saw it done.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "bench_transfer": bench}, f,
                      indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
