"""``run --compare``: the same trace served for real, in real time, once per
configuration, in one job — all tiers, the GPU tier alone (same GPU blocks, no host
or disk tier), no reuse — and the latencies side by side.

Requests arrive open loop at ``workload.request_rate`` per second (``clock``); each
configuration gets a fresh cache and the same model (built once: the weights are
the same, and an untimed warm-up run loads the kernels before the first clock
starts). The
report: TTFT p50/p90/p99, queueing (arrival to admission), time per output token,
requests and prompt tokens per second over the run's span — equal to the offered load
for a configuration that keeps up, so a configuration's capacity is measured with a
rate it cannot keep up with (``--rate``) — and every configuration's integrity
checks; ``ttft_cdf.png`` plots the TTFT distributions."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from tabulate import tabulate

from ...config import CacheConfig
from ...storage.gpu import torch_dtype
from ..engine.model import Decoder, Geometry, compute_dtype_for
from ..engine.parallel import TensorParallel
from .job import solo
from .options import RunOptions
from .placement import placements
from .report import publish

_COLD_OFF = {"host": {"bytes": 0}, "disk": {"bytes": 0}}
CONFIGS: dict[str, dict] = {
    "all-tiers": {},
    # The serial loop for comparison: run next to all-tiers where that runs ahead.
    "all-tiers-serial": {"workload": {"run_ahead": False}},
    "gpu+host": {"cache": {"disk": {"bytes": 0}}},  # not compared by default: isolates the disk tier
    # Not compared by default either, each all-tiers with one default changed: offloads
    # drop host blocks behind the disk instead of waiting for disk writes
    # (cache.disk.drop_behind); a request whose prefix is on disk waits for its prefetched
    # reads before admission (workload.wait_for_disk_reads) instead of its step waiting.
    "all-tiers-dropping": {"cache": {"disk": {"drop_behind": True}}},
    "all-tiers-gated": {"workload": {"wait_for_disk_reads": True}},
    "gpu-only": {"cache": _COLD_OFF},
    "no-reuse": {"cache": {**_COLD_OFF, "enable_reuse": False}},
}


def build_model(cfg: CacheConfig, tp: TensorParallel, comm=None) -> Decoder:
    """The run's model on this rank's device (collective over ``comm``: placement;
    ``tp``, the model's group, may be part of it: a replica's)."""
    me, table = placements(cfg.cache.device, comm)
    device = torch.device(table[me].device)
    w, m = cfg.workload, cfg.model
    model = Decoder(Geometry.from_config(cfg), seed=w.seed, tp=tp, device=device,
                    kv_dtype=torch_dtype(m.dtype), compute_dtype=compute_dtype_for(w.compute_dtype, device),
                    tokens_per_block=cfg.cache.tokens_per_block)
    if w.cuda_graphs and model.can_capture():
        model.capture_graphs()
    return model


WARM_UP_REQUESTS = 48


def _warm_up(cfg: CacheConfig, opts: RunOptions, comm, model: Decoder) -> None:
    """Serve the trace's first requests once, untimed (collective): kernels load,
    libraries pick their algorithms and the allocator grows to the step's sizes before
    any configuration's clock runs, so the first one measured pays no start-up."""
    n = min(WARM_UP_REQUESTS, cfg.workload.requests)
    sim = solo(cfg.replace(workload={"requests": n}, **CONFIGS["gpu-only"]),
               replace(opts, requests=None, out=None, progress=False), comm, model=model, realtime=True,
               label="warm-up")
    try:
        sim.run()
    finally:
        sim.close()


def run_compare(cfg: CacheConfig, opts: RunOptions, comm=None) -> dict:
    """Every configuration of CONFIGS on every rank of ``comm`` (collective)."""
    if opts.requests is not None:
        cfg = cfg.replace(workload={"requests": opts.requests})
    tp = TensorParallel.of(cfg, comm)
    runs: dict[str, dict] = {}
    try:
        model = build_model(cfg, tp, comm)
        _warm_up(cfg, opts, comm, model)
        for name in configurations(cfg, opts.configs, model.device):
            over = CONFIGS[name]
            sim = solo(cfg.replace(**over) if over else cfg, opts, comm, model=model, realtime=True,
                       label=name)
            try:
                runs[name] = sim.run()
            finally:
                sim.close()  # its GPU tier returns to the allocator, for the next one's
            if tp.rank == 0:
                print(_one_line(name, runs[name]), flush=True)
    finally:
        tp.free()
    results = _assemble(cfg, runs)
    if tp.rank == 0:
        _write(results, opts)
    return results


def configurations(cfg: CacheConfig, names: tuple[str, ...], device: torch.device) -> list[str]:
    """``names`` in order, with the serial loop next to all tiers where all tiers runs
    ahead (``workload.run_ahead``; by default on CUDA)."""
    out = list(names)
    ahead = cfg.workload.run_ahead if cfg.workload.run_ahead is not None else device.type == "cuda"
    if ahead and "all-tiers" in out and "all-tiers-serial" not in out:
        out.insert(out.index("all-tiers") + 1, "all-tiers-serial")
    return out


def _one_line(name: str, r: dict) -> str:
    lat = r["latency"]
    return (f"[{name}] {r['requests']:,} requests in {lat['span_s']:.1f} s, TTFT p50 "
            f"{lat['ttft_ms']['p50']:.0f} ms, queue p99 {lat['queue_ms']['p99']:.0f} ms, "
            f"{r['integrity_mismatches']} mismatched blocks, "
            f"{r['integrity']['logits_failed']}/{r['integrity']['logits_checked']} logits outside tolerance")


def _ratio(a: float, b: float) -> float | None:
    return a / b if b else None


def _assemble(cfg: CacheConfig, runs: dict[str, dict]) -> dict:
    lat = {name: r["latency"] for name, r in runs.items()}
    first = runs[next(iter(runs))]
    out = {
        "ok": all(r["ok"] for r in runs.values()),
        "request_rate": cfg.workload.request_rate,
        "latency": lat,
        "runs": runs,
        # The keys every results.json has, from the first configuration's run.
        **{k: first[k] for k in ("world_size", "requests", "prompt_tokens", "reused_tokens",
                                 "integrity_mismatches", "bytes_offloaded", "bytes_onboarded", "steps",
                                 "seconds")},
    }
    if "all-tiers" in lat and "all-tiers-serial" in lat:
        ahead, serial = lat["all-tiers"], lat["all-tiers-serial"]
        out["run_ahead_vs_serial"] = {
            "ttft_p50": _ratio(ahead["ttft_ms"]["p50"], serial["ttft_ms"]["p50"]),
            "prompt_tokens_per_s": _ratio(ahead["prompt_tokens_per_s"], serial["prompt_tokens_per_s"]),
        }
    if "all-tiers" in lat and "gpu-only" in lat:
        tiers, gpu = lat["all-tiers"], lat["gpu-only"]
        out["all_tiers_vs_gpu_only"] = {
            "ttft_p50": _ratio(tiers["ttft_ms"]["p50"], gpu["ttft_ms"]["p50"]),
            "ttft_p90": _ratio(tiers["ttft_ms"]["p90"], gpu["ttft_ms"]["p90"]),
            "ttft_p99": _ratio(tiers["ttft_ms"]["p99"], gpu["ttft_ms"]["p99"]),
            "prompt_tokens_per_s": _ratio(tiers["prompt_tokens_per_s"], gpu["prompt_tokens_per_s"]),
        }
    return out


def render(results: dict) -> str:
    rows = []
    for name, r in results["runs"].items():
        lat, t = r["latency"], r["latency"]["ttft_ms"]
        prompt = r["prompt_tokens"]
        computed = r["prefill_tokens_computed"]["this run"]
        rows.append([name, f"{t['p50']:.0f}", f"{t['p90']:.0f}", f"{t['p99']:.0f}",
                     f"{lat['queue_ms']['p50']:.0f}/{lat['queue_ms']['p99']:.0f}",
                     f"{lat['tpot_ms']['mean']:.1f}", f"{lat['requests_per_s']:.2f}",
                     f"{lat['prompt_tokens_per_s']:,.0f}", f"{100 * (prompt - computed) / prompt:.1f}%",
                     f"{r['model_ms_per_step']:.1f}", f"{r['cache_api_us_per_step'] / 1e3:.1f}",
                     f"{r['compute_wait_us_per_step'] / 1e3:.2f}", *_critical(r["critical_path"]),
                     f"{r['integrity_mismatches']}/{r['integrity']['logits_failed']}"])
    head = ["configuration", "TTFT p50 ms", "p90", "p99", "queue p50/p99", "TPOT ms", "req/s", "prompt tok/s",
            "reused", "model ms/step", "cache ms/step", "copy wait ms/step", "GPU idle/step",
            "cache on path ms", "bad blocks/logits"]
    lines = [f"open loop at {results['request_rate']:g} requests/s, the same trace for every configuration",
             tabulate(rows, headers=head, colalign=("left",) + ("right",) * (len(head) - 1))]
    timers = {r["critical_path"]["timers"] for r in results["runs"].values()}
    lines.append("GPU idle/step: the step's wall time less the GPU's in its forward pass; cache on path: the "
                 "cache's host time the GPU waited for (" + ", ".join(sorted(timers)) + "); a run that runs "
                 "ahead is marked >")
    q = results.get("run_ahead_vs_serial")
    if q is not None:
        fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        lines.append(f"all tiers running ahead vs serial: TTFT p50 {fmt(q['ttft_p50'])}; prompt tokens per "
                     f"second {fmt(q['prompt_tokens_per_s'])}")
    q = results.get("all_tiers_vs_gpu_only")
    if q is not None:
        fmt = lambda v: "-" if v is None else f"{v:.2f}x"  # noqa: E731
        lines.append(f"all tiers vs gpu only: TTFT p50 {fmt(q['ttft_p50'])}, p90 {fmt(q['ttft_p90'])}, "
                     f"p99 {fmt(q['ttft_p99'])}; prompt tokens per second {fmt(q['prompt_tokens_per_s'])}")
    return "\n".join(lines)


def _critical(c: dict) -> list[str]:
    """The critical path's two columns (GPU idle per step, cache on the path)."""
    mark = ">" if c["run_ahead"] else ""
    return [f"{mark}{c['gpu_idle_ms']:.1f} ms ({100 * c['gpu_idle_fraction']:.0f}%)",
            f"{c['cache_on_critical_path_us'] / 1e3:.2f}"]


def _write(results: dict, opts: RunOptions) -> None:
    def plot(run_dir: Path) -> list[str]:
        try:
            from .plots import ttft_cdf

            return [ttft_cdf(run_dir, {name: r["latency"]["ttft_s"] for name, r in results["runs"].items()},
                             results["request_rate"]).name]
        except ImportError:  # matplotlib is the optional `sim` extra
            return ["no plot: matplotlib is not installed"]

    publish(results, opts.out, render, plot)
