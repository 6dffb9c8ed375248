"""``run --compare`` for a job of replicas: the same trace served in real time by R
replicas x TP T, once per configuration, in one job, on CPU as on CUDA
(:mod:`kvdist.sim.experiment.replica_time`).

Requests arrive open loop at ``workload.request_rate`` per second and are routed as
they arrive by rank 0's router. The configurations (``REPLICA_CONFIGS``):

- ``isolated``: round-robin, no remote tier — each replica reuses only what it computed;
- ``sharing``: round-robin, the remote tier on — a replica fetches what a peer holds;
- ``prefix-aware`` / ``prefix-aware+sharing``: the router sends each request where
  the replicas' KV events say its longest prefix is, balanced against load
  (:class:`~kvdist.sim.experiment.kv_router.KvAware`), the remote tier off / on;
- ``one-cache``: the ceiling in time — ONE replica (replica 0's ranks) with R times a
  replica's capacity in every tier and R times its batch limits serves the whole
  trace; the others idle. Every block computed is visible to every request and none
  is held twice. On one GPU shared by the replicas it has the same compute as they
  have together; with a GPU per replica it has one R-th of theirs (a ceiling of
  reuse, pessimistic on time);
- ``one-cache-same-batch`` (on request, ``--configs``): the same with a replica's
  batch limits. On one GPU the replicas' passes time-share it while ``one-cache``
  runs one process with twice the batch: this ceiling takes the batch away from it,
  so what is left between it and the replicas is the cache (and the time-sharing).

The model is built once per replica and shared by the configurations; an untimed
warm-up serves the trace's first requests before any clock starts. Per configuration:
TTFT p50/p90/p99, queueing, time per output token, requests and prompt tokens per
second, reuse by tier, bytes fetched from other replicas and the requests held for
their fetches, the integrity checks; the gap in computed prefill isolated -> one
cache, with how much of it each configuration closed; and the goals' ratios
(``GOALS``) between the configurations that ran."""

from __future__ import annotations

import time
from dataclasses import replace

from tabulate import tabulate

from ... import process
from ...config import CacheConfig
from ..engine.parallel import TensorParallel
from .clock import Latencies
from .compare import build_model
from .kv_router import OneReplica, RoundRobin
from .options import RunOptions
from .replica_job import ReplicaFigures
from .replica_report import LOCAL_TIERS, run_summary
from .replica_time import PolicyMaker, timed_replica
from .report import check_lines, human_bytes, percent, publish
from .workload import generate

__all__ = ["GOALS", "REPLICA_CONFIGS", "ceiling_config", "goal_ratios", "render", "run_replica_compare"]

# name -> (routing, remote tier on, R x a replica's capacity, R x its batch limits)
REPLICA_CONFIGS: dict[str, tuple[str, bool, bool, bool]] = {
    "isolated": ("round_robin", False, False, False),
    "sharing": ("round_robin", True, False, False),
    "prefix-aware": ("kv", False, False, False),
    "prefix-aware+sharing": ("kv", True, False, False),
    "one-cache": ("one", False, True, True),
    "one-cache-same-batch": ("one", False, True, False),
}
DEFAULT = ("isolated", "sharing", "prefix-aware", "prefix-aware+sharing", "one-cache")
# The goals of issues 25 and 26 as ratios of two configurations' figures:
# (what, numerator, denominator, figure, "<=" or ">=", goal)
GOALS: tuple[tuple[str, str, str, str, str, float], ...] = (
    ("TTFT p50 sharing / isolated", "sharing", "isolated", "ttft_p50", "<=", 0.6),
    ("TTFT p50 sharing / one-cache", "sharing", "one-cache", "ttft_p50", "<=", 1.15),
    ("TTFT p50 sharing / one-cache-same-batch", "sharing", "one-cache-same-batch", "ttft_p50", "<=", 1.15),
    ("prompt tok/s sharing / isolated", "sharing", "isolated", "prompt_tokens_per_s", ">=", 1.2),
    ("TTFT p50 prefix-aware+sharing / isolated", "prefix-aware+sharing", "isolated", "ttft_p50", "<=", 0.5),
)
WARM_UP_REQUESTS = 24
_ANY_PORT = "tcp://127.0.0.1:0"  # events published on loopback, on ports the system picks


def _policy(routing: str) -> PolicyMaker:
    def make(cfg: CacheConfig, replicas: int, events: list[tuple[str, str | None]]):
        if routing == "round_robin":
            return RoundRobin(replicas), None
        if routing == "one":
            return OneReplica(), None
        from .kv_events_index import kv_aware  # the `events` extra

        return kv_aware(cfg, replicas, events)
    return make


def ceiling_config(cfg: CacheConfig, replicas: int, capacity: dict[str, int], block_bytes: int,
                   batch: bool) -> CacheConfig:
    """``cfg`` with R times a replica's blocks (``capacity``, per tier) in every tier,
    and R times its batch limits when ``batch``."""
    w = cfg.workload
    scaled = cfg.replace(
        cache={"gpu": {"blocks": replicas * capacity["gpu"], "bytes": None, "memory_fraction": None},
               "host": {"bytes": replicas * capacity.get("host", 0) * block_bytes},
               "disk": {"bytes": replicas * capacity.get("disk", 0) * block_bytes}})
    if not batch:
        return scaled
    return scaled.replace(workload={"max_batch": replicas * w.max_batch,
                                    "max_prefill_tokens": replicas * w.max_prefill_tokens})


def _timed(cfg: CacheConfig, name: str, opts: RunOptions, comm, world: TensorParallel, trace, model
           ) -> ReplicaFigures:
    routing, remote = REPLICA_CONFIGS.get(name, REPLICA_CONFIGS["isolated"])[:2]
    run_cfg = cfg.replace(distributed={"remote": {"enabled": remote}})
    if routing == "kv" and not cfg.cache.events.enabled:  # the router subscribes to every replica's events
        run_cfg = run_cfg.replace(cache={"events": {"enabled": True, "endpoint": _ANY_PORT,
                                                    "replay_endpoint": _ANY_PORT}})
    sim = timed_replica(run_cfg, opts, comm, world=world, trace=trace, phase=name, model=model,
                        policy=_policy(routing),
                        think_s=cfg.workload.think_steps * cfg.workload.step_ms / 1e3)
    try:
        return sim.run()
    finally:
        sim.close()


def run_replica_compare(cfg: CacheConfig, opts: RunOptions, comm=None) -> dict:
    """Every configuration of ``opts.configs`` (else all) on every rank (collective)."""
    if opts.requests is not None:
        cfg = cfg.replace(workload={"requests": opts.requests})
    names = [n for n in (opts.configs or DEFAULT)]
    world = TensorParallel.of(cfg, comm)
    world.stop_waiting_on_notice(lambda notices: process.decode_stop(max(notices, default=0)))
    started = time.perf_counter()
    group_tp = None
    try:
        group = world.mpi.Split(world.rank // cfg.distributed.tp_size, world.rank) \
            if world.mpi is not None else None
        try:
            group_tp = TensorParallel.of(cfg, group)
        finally:
            if group is not None:
                group.Free()
        replicas = world.size // cfg.distributed.tp_size
        model = build_model(cfg, group_tp, comm)
        warm = min(WARM_UP_REQUESTS, cfg.workload.requests)
        warm_cfg = cfg.replace(workload={"requests": warm})
        quiet = replace(opts, out=None, progress=False)
        first = _timed(warm_cfg, "warm-up", quiet, comm, world, generate(warm_cfg.workload), model)
        trace = generate(cfg.workload)
        parts: dict[str, ReplicaFigures] = {}
        stats = first.figures.stats
        for name in names:
            _, _, scaled, batch = REPLICA_CONFIGS[name]
            run_cfg = ceiling_config(cfg, replicas, stats["capacity_blocks"], stats["block_bytes"], batch) \
                if scaled else cfg
            parts[name] = _timed(run_cfg, name, opts, comm, world, trace, model)
            line = world.gather(parts[name], "the configuration's figures")
            if world.rank == 0:
                print(_one_line(name, _run(line, replicas)), flush=True)
        everyone = world.gather(parts)
        results = None
        if world.rank == 0:
            results = assemble(cfg, trace, everyone, time.perf_counter() - started)
            publish(results, opts.out, render)
        return world.bcast(results)
    finally:
        if group_tp is not None:
            group_tp.free()
        world.free()


def _latency(parts: list[ReplicaFigures]) -> dict:
    """One latency summary over every replica's requests (one clock: the job's start)."""
    merged = Latencies()
    for p in parts:
        if p.latency is None:
            continue
        for k in ("arrival", "admit", "first", "finish", "outputs", "prompt"):
            getattr(merged, k).update(getattr(p.latency, k))
        merged.busy_s += p.latency.busy_s
    return merged.summary()


def _run(parts: list[ReplicaFigures], replicas: int) -> dict:
    s = run_summary(parts, replicas)
    s["latency"] = _latency(parts)
    lead = next(p for p in parts if p.routes is not None)
    s["routed"] = [lead.routes.count(k) for k in range(replicas)]
    s["router"] = lead.router
    s["held_for_fetch"] = sum(r["held_for_prefetch"] for r in s["replicas"])
    s["ok"] = s["ok"] and s["latency"]["requests"] == len(lead.routes)
    return s


def assemble(cfg: CacheConfig, trace, everyone: list[dict[str, ReplicaFigures]], seconds: float) -> dict:
    """The job's results (rank 0) from every rank's ``{configuration: figures}``."""
    names = list(everyone[0])
    replicas = len({e[names[0]].figures.replica for e in everyone})
    runs = {name: _run([e[name] for e in everyone], replicas) for name in names}
    prompt = trace.prompt_tokens
    computed = {name: r["prefill_tokens_computed"] for name, r in runs.items()}
    gap = None
    if "isolated" in computed and "one-cache" in computed:
        tokens = computed["isolated"] - computed["one-cache"]
        gap = {"tokens": tokens, "closed_fraction": {
            n: (computed["isolated"] - c) / tokens if tokens > 0 else None for n, c in computed.items()}}
    integrity = {k: sum(r["integrity"][k] for r in runs.values())
                 for k in ("blocks_checked", "mismatched_blocks", "unknown_blocks", "recomputed_variants",
                           "logits_checked", "logits_failed", "consistency_checks")}
    integrity.update(
        first_mismatch=next((r["integrity"]["first_mismatch"] for r in runs.values()
                             if r["integrity"]["first_mismatch"]), None),
        consistency_error=next((r["integrity"]["consistency_error"] for r in runs.values()
                                if r["integrity"]["consistency_error"]), None),
        logits_max_abs_diff=max(r["integrity"]["logits_max_abs_diff"] for r in runs.values()),
        logits_tolerance=next(iter(everyone[0].values())).figures.tolerance,
        tokens_checked=0)
    integrity["tokens_checked"] = integrity["blocks_checked"] * cfg.cache.tokens_per_block
    first = runs[names[0]]
    lead = next(p for p in everyone[0].values())
    goals = goal_ratios(runs)
    return {
        "ok": all(r["ok"] for r in runs.values()),
        "world_size": len(everyone), "replicas": replicas, "tp_size": len(everyone) // replicas,
        "device": ",".join(sorted(set(lead.placement or []))), "request_rate": cfg.workload.request_rate,
        "requests": first["requests"], "requests_in_trace": len(trace.requests), "prompt_tokens": prompt,
        "runs": runs, "latency": {n: r["latency"] for n, r in runs.items()},
        "prefill_tokens_computed": computed, "gap": gap, "goals": goals,
        "reused_tokens": first["reused_tokens"], "integrity_mismatches": integrity["mismatched_blocks"],
        "integrity": integrity, "bytes_offloaded": first["bytes_offloaded"],
        "bytes_onboarded": first["bytes_onboarded"], "steps": first["steps"], "seconds": seconds,
        "config": cfg.normalized(),
    }


def goal_ratios(runs: dict[str, dict]) -> list[dict]:
    """Each goal of ``GOALS`` whose two configurations ran: its ratio and whether it is met."""
    out = []
    for what, num, den, figure, sense, goal in GOALS:
        if num not in runs or den not in runs:
            continue
        a, b = (_figure(runs[n]["latency"], figure) for n in (num, den))
        ratio = a / b if b > 0 else float("nan")
        out.append({"what": what, "ratio": ratio, "goal": f"{sense} {goal:g}",
                    "met": ratio <= goal if sense == "<=" else ratio >= goal})
    return out


def _figure(latency: dict, figure: str) -> float:
    return latency["ttft_ms"]["p50"] if figure == "ttft_p50" else latency[figure]


def _one_line(name: str, r: dict) -> str:
    lat = r["latency"]
    return (f"[{name}] {lat['requests']:,} requests in {lat['span_s']:.1f} s, TTFT p50 "
            f"{lat['ttft_ms']['p50']:.0f} ms, prefill computed {r['prefill_tokens_computed']:,} tokens, "
            f"routed {'/'.join(map(str, r['routed']))}, "
            f"{r['integrity']['mismatched_blocks']} mismatched blocks")


def render(results: dict) -> str:
    R, prompt = results["replicas"], results["prompt_tokens"]
    rows = []
    closed = (results["gap"] or {}).get("closed_fraction", {})
    for name, r in results["runs"].items():
        lat, t = r["latency"], r["latency"]["ttft_ms"]
        hits = r["reused_tokens"]
        gap = closed.get(name)
        rows.append([name, f"{t['p50']:.0f}", f"{t['p90']:.0f}", f"{t['p99']:.0f}",
                     f"{lat['queue_ms']['p50']:.0f}/{lat['queue_ms']['p99']:.0f}",
                     f"{lat['tpot_ms']['mean']:.1f}",
                     f"{lat['requests_per_s']:.2f}", f"{lat['prompt_tokens_per_s']:,.0f}",
                     "/".join(f"{100 * hits.get(t, 0) / prompt:.0f}" for t in (*LOCAL_TIERS[:2], "remote")),
                     f"{r['prefill_tokens_computed']:,}", "-" if gap is None else f"{100 * gap:.0f}%",
                     human_bytes(r["bytes_fetched_remote"]), f"{r['held_for_fetch']}/{r['remote_misses']}",
                     "/".join(map(str, r["routed"])),
                     f"{r['integrity']['mismatched_blocks']}/{r['integrity']['logits_failed']}"])
    head = ["configuration", "TTFT p50 ms", "p90", "p99", "queue p50/p99", "TPOT ms", "req/s", "prompt tok/s",
            "reused % gpu/host/remote", "prefill computed", "gap closed", "fetched", "held/missed",
            "routed", "bad blocks/logits"]
    lines = [f"kvdist run --compare: {results['world_size']} ranks = {R} replicas x TP {results['tp_size']}, "
             f"{results['device']}, open loop at {results['request_rate']:g} requests/s, the same trace "
             f"({results['requests_in_trace']:,} requests, {prompt:,} prompt tokens) for every configuration",
             tabulate(rows, headers=head, colalign=("left",) + ("right",) * (len(head) - 1))]
    g = results["gap"]
    if g is not None:
        lines.append(f"gap isolated -> one cache: {g['tokens']:,} prefill tokens "
                     f"({percent(g['tokens'], prompt)} of the prompt tokens); gap closed: the share of it "
                     "each configuration computes less than isolated")
    away = [f"{name} {r['router']['routed_away']} ({r['router']['away_blocks']:,} blocks)"
            for name, r in results["runs"].items() if "routed_away" in (r.get("router") or {})]
    if away:
        lines.append("routed away from a longer cached prefix (the load outweighed it; the blocks the "
                     "chosen replica held fewer): " + ", ".join(away))
    lines.append("held/missed: requests admitted a step or more late for their fetches / blocks looked up "
                 "that were stale or late; one-cache: one replica with R x the capacity and batch serves "
                 "everything (one-cache-same-batch: with a replica's batch limits)")
    if results.get("goals"):
        lines.append(tabulate([[g["what"], f"{g['ratio']:.2f}x", g["goal"], "met" if g["met"] else "MISSED"]
                               for g in results["goals"]], headers=["goal", "ratio", "wanted", ""],
                              colalign=("left", "right", "left", "left")))
        lines.append("prompt tok/s below saturation is the rate offered in every configuration: the "
                     "throughput goal shows only at a rate the isolated replicas cannot keep up with")
    lines.extend(check_lines(results["integrity"], f"in {len(results['runs'])} configurations"))
    return "\n".join(lines)
