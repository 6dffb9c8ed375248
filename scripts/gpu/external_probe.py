"""The KV connector's worker path on the GPU (issue 28.4): kvdist's host tier and the
engine's own paged KV tensors, laid out as vLLM 0.33 lays them out, at 16-token blocks
of Llama-3-8B (32 layers, 128 head dim, bf16) at TP 1 (8 KV heads: 64 KiB a layer, 2
MiB a block) and TP 8 (1 KV head: 8 KiB a layer, 256 KiB a block).

    python3 scripts/gpu/external_probe.py [--gib 1] [--tp 1,8] [--gather auto,direct]
        [--alloc one,per-layer,blocks] [--groups auto,32] [--submit 64,0] [--rounds 3]
        [--json FILE]

Per configuration, ``--gib`` of blocks a direction, engine block ids drawn at random
from tensors of twice that many blocks, through exactly what a connector calls:
``ExternalPlanner.plan_save`` / ``plan_load`` / ``take`` on the scheduler's side,
``ExternalCache.start`` / ``wait_layer`` / ``save`` / ``synchronize`` on the worker's:

* saves alone: prompts' blocks saved out of the engine's blocks, two steps' ``save`` back
  to back, until every copy is complete (the host may run ahead, as in ``bench transfer``);
* loads alone: a prompt loaded into other engine blocks, two steps back to back, each with
  ``wait_layer(l)`` for every layer and an event on the compute stream after each; and
  one step alone: ms until layer 0's event, the last layer's (the layer-wise wait);
* both, one call: a new prompt saved while the last one loads, one ``start``; with the ms
  of host time in it and until the loads' and the saves' last copies (which direction
  trails);
* both, vLLM steps: as the connector issues them, a step's loads (``start_load_kv``), its
  saves (``wait_for_save``), the next step's loads and saves; step 1's saves and step 2's
  loads both wait for step 1's loads (S4: the forward between reads them) and then run
  at once: their bytes over the time from the end of step 1's loads to the later end.

Side by side: the contiguous pinned copy of the same bytes (the ceiling, as ``bench
transfer`` measures it) and ``bench transfer``'s batched offload / onboard / both ways of
scattered whole blocks of the same size (kvdist's own GPU tier), run here (``--no-bench``
skips it). The goal (issue 28): >= 90% of ``bench transfer``'s figures.

``--gather``: how a block moves (``kvdist/external/cuda.py``): ``direct``, an entry a
piece (a layer's) in one cudaMemcpyBatchAsync, 32 entries a block; ``staged``, whole
blocks through a device staging buffer, then one kernel a layer group scatters the
pieces; ``rows``, whole blocks straight (only where a block's layers are adjacent:
``--alloc blocks``); ``auto`` (the default of a cache): ``rows`` where it can, else
``staged`` for pieces under 32 KiB, else ``direct``. ``--alloc``: the engine's layers in
``one`` LBNHC buffer, an allocation ``per-layer`` (vLLM's default), or ``blocks``: vLLM's
cross-layer BLNHC buffer. ``--submit``: MiB a batch ``ExternalCache`` hands the transfer
engine (``kvdist/external/submit.py``); 0 = one batch a route, as before it."""

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
    p.add_argument("--alloc", default="one,per-layer,blocks",
                   help="one: layers in one LBNHC buffer; per-layer: vLLM's default; "
                        "blocks: cross-layer BLNHC")
    p.add_argument("--groups", default="auto", help="cache.layer_groups values, e.g. auto,32")
    p.add_argument("--submit", default="64",
                   help="MiB a batch handed to the transfer engine (kvdist/external/submit.py), e.g. 64,0; "
                        "0: one batch a route, as before")
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
        row = json.load(open(f.name, encoding="utf-8"))["sizes"][0]
    return {k: row[k] for k in ("offload", "onboard", "both", "ceiling D2H", "ceiling H2D", "ceiling both")}


def _one(tp: int, alloc: str, gather: str, groups: str, submit: int, args) -> dict:
    from kvdist.external import ExternalPlanner, create
    from kvdist.external import cache as external_cache

    # Batches handed to the transfer engine (kvdist/external/submit.py); 0: one a route
    external_cache.SUBMIT_BYTES = (submit << 20) if submit else 1 << 62
    heads = HEADS // tp
    bpb = L * 2 * T * heads * D * 2
    n = max(1, int(args.gib * (1 << 30)) // bpb)
    cfg = {"model": {"num_layers": L, "num_kv_heads": heads, "head_dim": D, "dtype": "bfloat16"},
           "cache": {"tokens_per_block": T, "device": DEVICE, "gpu": "external",
                     "host": {"bytes": 4 * n * bpb},
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

        def timed(stream) -> torch.cuda.Event:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            return ev

        def run(calls: list) -> dict:
            """Issue ``calls`` (``("start" | "save", Transfers)``) back to back as an engine
            would: ``start`` (loads, or loads and saves), then ``wait_layer`` for every layer
            with an event on the compute stream after each (the first start's); ``save``
            (saves behind the forward). After each call, an event on the copy stream of its
            copies. Then wait for all: wall and host seconds, ms from the first call until
            layer 0's and the last layer's event and until each call's stream event."""
            torch.cuda.synchronize()
            begin = timed(compute)
            t0 = time.perf_counter()
            layers, marks = [], []
            for kind, step in calls:
                if kind == "save":
                    worker.save(step)
                    marks.append(timed(ex.streams["offload"]))
                    continue
                worker.start(step)
                names = {r.stream for r in step.routes()}
                marks.append({name: timed(ex.streams[name]) for name in sorted(names)})
                for layer in range(L):
                    worker.wait_layer(layer)
                    if len(layers) < L:
                        layers.append(timed(compute))
            host = time.perf_counter() - t0
            compute.synchronize()
            worker.synchronize()
            wall = time.perf_counter() - t0

            def ms(m):
                return {k: begin.elapsed_time(e) for k, e in m.items()} if isinstance(m, dict) else \
                    begin.elapsed_time(m)
            return {"wall": wall, "host": host, "marks": [ms(m) for m in marks],
                    "layers": [begin.elapsed_time(e) for e in layers[:1] + layers[-1:]]}

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

        def load(last: list[int], b: list[int]):
            got = planner.plan_load("l", last, b)
            assert len(got.blocks) == n and not got.failed, got
            return planner.take()

        def mixed(last: list[int], b: list[int], a: list[int]):
            """A new prompt saved out of ``a`` while ``last`` lands in ``b``: one Transfers."""
            assert len(planner.plan_save("s", prompt(), a).blocks) == n
            return load(last, b)

        runs: dict[str, list] = {"offload": [], "onboard": [], "latency": [], "both": [], "steps": []}
        run([("save", t) for t in saves(1, ids()[0])])  # warm-up: staging buffers, kernels
        last, a, b = saved_prompt()
        run([("start", load(last, b))])
        for _ in range(args.rounds):
            runs["offload"].append(run([("save", t) for t in saves(2, ids()[0])]))
            last, a, b = saved_prompt()
            runs["latency"].append(run([("start", load(last, b))]))  # one step, idle streams
            runs["onboard"].append(run([("start", load(last, b)), ("start", load(last, b))]))
            last, a, b = saved_prompt()
            runs["both"].append(run([("start", mixed(last, b, a))]))
            # vLLM's order: a step's loads (start_load_kv), its saves (wait_for_save), the
            # next step's loads: step 1's saves and step 2's loads both follow step 1's
            # loads (S4: the forward between waits for them) and run at once.
            last, a, b = saved_prompt()
            s1, s2 = saves(2, a)
            runs["steps"].append(run([("start", load(last, b)), ("save", s1), ("start", load(last, b)),
                                      ("save", s2)]))
        nbytes = n * bpb
        st = ex.stats()
        lay = worker.layout
        res = {"tp": tp, "alloc": alloc, "gather": st.get("gather"), "stacked": st.get("stacked"),
               "groups": lay.groups_for(cfg["cache"]["layer_groups"], worker.config.cache.min_copy_piece),
               "submit_mib": submit, "block_bytes": bpb, "blocks": n, "copy_path": st["path"]}
        med = statistics.median
        res["offload"] = med(2 * nbytes / r["wall"] / 1e9 for r in runs["offload"])
        res["onboard"] = med(2 * nbytes / r["wall"] / 1e9 for r in runs["onboard"])
        res["both"] = med(2 * nbytes / r["wall"] / 1e9 for r in runs["both"])
        # step 1's saves and step 2's loads, from the end of step 1's loads to the later end
        res["both_steps"] = med(2 * nbytes / 1e6 / max(1e-3, max(r["marks"][1], r["marks"][2]["onboard"])
                                                        - r["marks"][0]["onboard"]) for r in runs["steps"])
        res["both_host_ms"] = med(1e3 * r["host"] for r in runs["both"])
        res["both_ends_ms"] = {k: med(r["marks"][0][k] for r in runs["both"]) for k in ("onboard", "offload")}
        res["latency_ms"] = med(1e3 * r["wall"] for r in runs["latency"])
        res["layer0_ms"] = med(r["layers"][0] for r in runs["latency"])
        res["last_layer_ms"] = med(r["layers"][1] for r in runs["latency"])
        res["rounds"] = {k: [round(r["wall"], 4) for r in v] for k, v in runs.items()}
        res["transfer"] = {k: v for k, v in ex.stats().items() if k in ("batches_by_path", "copy_entries",
                                                                          "index_uploads")}
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
                if gather == "rows" and alloc != "blocks":
                    continue  # a block's layers are adjacent only in the cross-layer layout
                for groups in args.groups.split(","):
                    for submit in (int(x) for x in args.submit.split(",")):
                        r = _one(tp, alloc, gather, groups, submit, args)
                        r["ceiling"] = ceil
                        rows.append(r)
                        print(json.dumps(r), flush=True)
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, {time.strftime('%Y-%m-%d %H:%M')}; "
          f"{args.gib} GiB a direction, medians of {args.rounds} rounds")
    head = (f"{'TP':>2} {'block':>7} {'alloc':>9} {'gather':>6} {'grp':>3} {'MiB':>4}  {'saves alone':>15}  "
            f"{'loads alone':>15}  {'both, one call':>15}  {'both, vLLM steps':>16}  "
            f"{'host / load end / save end':>26}  {'one load: layer 0 / last / done':>31}")
    print(head)
    for r in rows:
        b = bench.get(r["tp"])

        def pct(key: str, ref: str, r=r, b=b) -> str:
            return f"{r[key]:5.1f}" + (f" ({100 * r[key] / b[ref]:3.0f}%)" if b else "")
        ends = r["both_ends_ms"]
        print(f"{r['tp']:>2} {r['block_bytes'] >> 10:>5}Ki {r['alloc']:>9} {r['gather']!s:>6} "
              f"{r['groups']:>3} {r['submit_mib'] or '-':>4}  {pct('offload', 'offload'):>15}  "
              f"{pct('onboard', 'onboard'):>15}  {pct('both', 'both'):>15}  {pct('both_steps', 'both'):>16}  "
              f"{r['both_host_ms']:7.1f} / {ends['onboard']:6.1f} / {ends['offload']:6.1f}  "
              f"{r['layer0_ms']:9.2f} / {r['last_layer_ms']:7.2f} / {r['latency_ms']:7.2f}")
    for tp, b in bench.items():
        print(f"bench transfer at TP {tp}'s block size: offload {b['offload']:.1f}, "
              f"onboard {b['onboard']:.1f}, "
              f"both {b['both']:.1f} GB/s (ceilings {b['ceiling D2H']:.1f} / {b['ceiling H2D']:.1f} / "
              f"{b['ceiling both']:.1f})")
    print("GB/s, (% of bench transfer's offload / onboard / both ways at this block size; goal >= 90%). "
          "saves alone: two steps' saves (ExternalCache.save) back to back; loads alone: two steps' loads "
          "(start, wait_layer for every layer); both, one call: one start() holding --gib of saves and --gib "
          "of loads; both, vLLM steps: a step's loads, its saves, the next step's loads, its saves (as the "
          "connector issues them), GB/s of step 1's saves and step 2's loads from the end of step 1's loads. "
          "MiB: kvdist/external/submit.py's batch (- : one a route). host / load end / save end: ms of host "
          "time in the one-call start(), and from its beginning until the loads' and the saves' last copy. "
          "One load: a step alone on idle streams, ms until the compute stream passed layer 0's wait, the "
          "last layer's, and the host saw it done.")
    if args.json:
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows, "bench_transfer": bench}, f,
                      indent=1, default=str)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
