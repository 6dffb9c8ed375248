"""The run's results: every rank's figures as one typed value (``RankFigures``,
gathered by every kind of run: the main job, each configuration of a comparison,
each run of a job of replicas), and rank 0's results dict (results.json) assembled
from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...cache import KVCache
from .checks import CheckCounts
from .integrity import BlockLedger
from .timing import StepTimes

__all__ = ["RankFigures", "RunFacts", "STAT_KEYS", "assemble", "critical_path", "ledger_totals"]

# The cache's statistics a rank reports (``KVCache.stats()``; the remote tier's two
# are 0 without one).
STAT_KEYS = ("hit_tokens", "prompt_tokens", "bytes_offloaded", "bytes_onboarded", "bytes_demoted",
             "blocks_moved", "evictions_by_tier", "transfer_seconds", "bookkeeping_seconds",
             "host_wait_seconds", "host_wait_read_seconds", "host_waits_on_disk", "compute_wait_seconds",
             "recompute_policy", "transfer_path", "capacity_blocks", "block_bytes", "bytes_fetched_remote",
             "remote_misses", "disk_loads")


@dataclass(slots=True)
class RankFigures:
    """One rank's figures of one run, gathered to rank 0."""

    rank: int
    replica: int
    tp_rank: int
    tiers: list[str]
    stats: dict  # STAT_KEYS of the cache's stats, and the CUDA executor's copy_entries, submit_seconds
    requests: int  # in the trace this rank served (a replica's share)
    finished: int
    steps: int
    ledger: tuple[int, int, int, int, str | None]  # checked, mismatched, unknown, variants, first mismatch
    logits: tuple[int, int, float]  # checked, failed, max |diff|
    consistency: tuple[int, str | None]  # checks, error
    cache_api_s: float
    model_s: float
    calls_s: dict[str, float] = field(default_factory=dict)
    tolerance: float = 0.0
    # The critical path: steps that ran a batch, their wall time (less the checks), the
    # device's time in their forward passes, the cache's host time the device waited for.
    critical: tuple[int, float, float, float] = (0, 0.0, 0.0, 0.0)
    # The KV cache events' publisher of this rank (TP rank 0 of a replica, cache.events
    # on; else empty): its endpoints and figures (EVENT_KEYS of stats()["events"]).
    events: dict = field(default_factory=dict)

    @classmethod
    def collect(cls, cache: KVCache, *, requests: int, finished: int, steps: int, ledger: BlockLedger,
                checks: CheckCounts, times: StepTimes, tolerance: float) -> RankFigures:
        s = cache.stats()
        t = s["transfer"]  # the CUDA executor's submission counters (absent elsewhere)
        stats = {k: s.get(k, 0) for k in STAT_KEYS} | {"copy_entries": t.get("copy_entries", 0),
                                                      "submit_seconds": t.get("submit_seconds", {})}
        return cls(rank=cache.rank, replica=cache.replica, tp_rank=cache.tp_rank, tiers=list(cache.tiers),
                   stats=stats, requests=requests, finished=finished, steps=steps,
                   ledger=(ledger.checked_blocks, ledger.mismatched_blocks, ledger.unknown_blocks,
                           ledger.variants, ledger.first_mismatch),
                   logits=(checks.logits_checked, checks.logits_failed, checks.logits_max_abs_diff),
                   consistency=(checks.consistency_checks, checks.consistency_error),
                   cache_api_s=times.cache_api, model_s=times.model, calls_s=dict(times.calls),
                   tolerance=tolerance,
                   critical=(times.steps_run, times.step_wall, times.gpu_busy, times.cache_critical),
                   events={k: s["events"][k] for k in EVENT_KEYS if k in s["events"]})


# What the results keep of a publisher's figures (``KVCache.stats()["events"]``): where it
# publishes; steps with block changes handed to it, published by the run's end (the
# publisher runs behind the step by up to its period), dropped (it was gone or stalled);
# replays served to late subscribers.
EVENT_KEYS = ("endpoint", "replay_endpoint", "submitted", "published", "dropped", "replays")


def ledger_totals(figures: list[RankFigures]) -> dict:
    """The integrity ledgers of ``figures`` summed (the first mismatch found)."""
    ledgers = [f.ledger for f in figures]
    return {
        "blocks_checked": sum(x[0] for x in ledgers),
        "mismatched_blocks": sum(x[1] for x in ledgers),
        "unknown_blocks": sum(x[2] for x in ledgers),
        "recomputed_variants": sum(x[3] for x in ledgers),
        "first_mismatch": next((x[4] for x in ledgers if x[4]), None),
    }


@dataclass(slots=True)
class RunFacts:
    """What rank 0's simulation knows about the run as a whole."""

    world: int
    steps: int
    finished: int
    complete: bool
    placement: list[dict]
    tiers: list[str]
    requests_in_trace: int
    shadow: dict[str, int] | None  # the replays' reused tokens (step-time runs)
    working_set: int
    tokens_per_block: int
    tolerance: float
    checks: CheckCounts
    seconds: float
    config: dict
    latency: dict | None  # Latencies.summary() of a real-time run
    run_ahead: bool = False  # the host prepared step N+1 while step N's forward pass ran


def _sum(everyone: list[RankFigures], key: str) -> float:
    return sum(e.stats[key] for e in everyone)


def _per_step_by_key(everyone: list[RankFigures], key: str, rank_steps: int) -> dict[str, float]:
    """µs per step and rank of each entry of the per-rank dicts of seconds ``key``."""
    names = sorted({name for e in everyone for name in e.stats[key]})
    return {n: 1e6 * sum(e.stats[key].get(n, 0.0) for e in everyone) / rank_steps for n in names}


def _integrity(f: RunFacts, everyone: list[RankFigures]) -> dict:
    totals = ledger_totals(everyone)
    logits = [e.logits for e in everyone]
    return {
        "blocks_checked": totals["blocks_checked"],
        "tokens_checked": totals["blocks_checked"] * f.tokens_per_block,
        "mismatched_blocks": totals["mismatched_blocks"],
        "unknown_blocks": totals["unknown_blocks"],
        "recomputed_variants": totals["recomputed_variants"],
        "first_mismatch": totals["first_mismatch"],
        "logits_checked": logits[0][0],
        "logits_failed": max(x[1] for x in logits),
        "logits_max_abs_diff": max(x[2] for x in logits),
        "logits_tolerance": f.tolerance,
        "consistency": {"checks": f.checks.consistency_checks, "error": f.checks.consistency_error},
    }


def critical_path(everyone: list[RankFigures], run_ahead: bool, device: str) -> dict:
    """Per step that ran a batch, averaged over the ranks: its wall time (less the
    checks' pause), the GPU's busy time in the forward pass (CUDA events around it; on
    CPU the host's time in it: ``timers``), the GPU's idle time and fraction, and the
    cache's host time the GPU waited for (serially all of it; running ahead, what the
    next step's preparation took past the end of the pass)."""
    steps, wall, busy, cache = (sum(e.critical[i] for e in everyone) for i in range(4))
    per = max(steps, 1)
    return {
        "run_ahead": run_ahead,
        "timers": "cuda events" if device.startswith("cuda") else "host timers",
        "steps": steps // max(len(everyone), 1),
        "step_ms": 1e3 * wall / per,
        "gpu_busy_ms": 1e3 * busy / per,
        "gpu_idle_ms": 1e3 * max(0.0, wall - busy) / per,
        "gpu_idle_fraction": max(0.0, wall - busy) / wall if wall > 0 else 0.0,
        "cache_on_critical_path_us": 1e6 * cache / per,
    }


def assemble(f: RunFacts, everyone: list[RankFigures]) -> dict:
    world, steps = f.world, max(f.steps, 1)
    first = everyone[0].stats
    prompt = first["prompt_tokens"]
    reused = dict(first["hit_tokens"])
    computed = {"this run": prompt - sum(reused.values())}
    if f.shadow is not None:
        computed |= {"gpu-only": prompt - f.shadow["gpu-only"], "no reuse": prompt - f.shadow["no reuse"]}
    moved = sum(_sum(everyone, k) for k in ("bytes_offloaded", "bytes_onboarded", "bytes_demoted"))
    seconds_moving = _sum(everyone, "transfer_seconds")
    integrity = _integrity(f, everyone)
    mismatches = integrity["mismatched_blocks"]
    ok = (mismatches == 0 and integrity["logits_failed"] == 0 and f.checks.consistency_error is None
          and f.complete)
    out = {
        "ok": ok,
        "world_size": world,
        "nodes": len({p["node"] for p in f.placement}),
        "placement": f.placement,
        "device": ",".join(sorted({p["device"] for p in f.placement})),
        "tiers": f.tiers,
        "requests": f.finished,
        "requests_in_trace": f.requests_in_trace,
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "prefill_tokens_computed": computed,
        "working_set_blocks": f.working_set,
        "capacity_blocks": first["capacity_blocks"],
        "block_bytes": first["block_bytes"],
        "evictions_by_tier": first["evictions_by_tier"],
        "blocks_moved_per_rank": first["blocks_moved"],
        "bytes_offloaded": _sum(everyone, "bytes_offloaded"),
        "bytes_onboarded": _sum(everyone, "bytes_onboarded"),
        "bytes_demoted": _sum(everyone, "bytes_demoted"),
        "recompute_policy": first["recompute_policy"],
        "transfer_path": first["transfer_path"],
        "transfer_gb_per_s": moved / seconds_moving / 1e9 if seconds_moving else 0.0,
        "bookkeeping_us_per_step": 1e6 * _sum(everyone, "bookkeeping_seconds") / world / steps,
        "host_wait_us_per_step": 1e6 * _sum(everyone, "host_wait_seconds") / world / steps,
        "host_wait_reads_us_per_step": 1e6 * _sum(everyone, "host_wait_read_seconds") / world / steps,
        "host_waits_on_disk": _sum(everyone, "host_waits_on_disk"),
        # Prefetches whose disk reads admission waited for instead of the step (rank 0's:
        # the TP group agrees them): sequences, and step boundaries that found one not landed.
        "disk_loads": first["disk_loads"] or {},
        "compute_wait_us_per_step": 1e6 * max(e.stats["compute_wait_seconds"] for e in everyone) / steps,
        "cache_api_us_per_step": 1e6 * sum(e.cache_api_s for e in everyone) / world / steps,
        "cache_calls_us_per_step": {name: 1e6 * sum(e.calls_s[name] for e in everyone) / world / steps
                                    for name in everyone[0].calls_s},
        # The CUDA executor's host time handing copies to the driver, by route, and the
        # copies handed over (a run of blocks, or one layer group of a block, each).
        "copy_submit_us_per_step": _per_step_by_key(everyone, "submit_seconds", world * steps),
        "copy_entries_per_step": _sum(everyone, "copy_entries") / world / steps,
        "model_ms_per_step": 1e3 * sum(e.model_s for e in everyone) / world / steps,
        "critical_path": critical_path(everyone, f.run_ahead, f.placement[0]["device"]),
        "integrity_mismatches": mismatches,
        "integrity": integrity,
        "events": [{"rank": e.rank, "replica": e.replica, **e.events} for e in everyone if e.events],
        "steps": f.steps,
        "seconds": f.seconds,
        "config": f.config,
    }
    if f.shadow is not None:
        out["reused_tokens_gpu_only"] = f.shadow["gpu-only"]
        out["prefill_tokens_saved"] = {"vs no reuse": computed["no reuse"] - computed["this run"],
                                       "vs gpu-only": computed["gpu-only"] - computed["this run"]}
    if f.latency is not None:
        out["latency"] = f.latency
    return out
