"""The run's results as one dict (results.json): rank 0 assembles every rank's figures."""

from __future__ import annotations

from dataclasses import dataclass

from .checks import CheckCounts


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


def _sum(everyone: list[dict], key: str) -> float:
    return sum(e["stats"][key] for e in everyone)


def _per_step_by_key(everyone: list[dict], key: str, rank_steps: int) -> dict[str, float]:
    """µs per step and rank of each entry of the per-rank dicts of seconds ``key``."""
    names = sorted({name for e in everyone for name in e["stats"][key]})
    return {n: 1e6 * sum(e["stats"][key].get(n, 0.0) for e in everyone) / rank_steps for n in names}


def _integrity(f: RunFacts, everyone: list[dict]) -> dict:
    ledgers = [e["ledger"] for e in everyone]
    logits = [e["logits"] for e in everyone]
    return {
        "blocks_checked": sum(x[0] for x in ledgers),
        "tokens_checked": sum(x[0] for x in ledgers) * f.tokens_per_block,
        "mismatched_blocks": sum(x[1] for x in ledgers),
        "unknown_blocks": sum(x[2] for x in ledgers),
        "recomputed_variants": sum(x[3] for x in ledgers),
        "first_mismatch": next((x[4] for x in ledgers if x[4]), None),
        "logits_checked": logits[0][0],
        "logits_failed": max(x[1] for x in logits),
        "logits_max_abs_diff": max(x[2] for x in logits),
        "logits_tolerance": f.tolerance,
        "consistency": {"checks": f.checks.consistency_checks, "error": f.checks.consistency_error},
    }


def assemble(f: RunFacts, everyone: list[dict]) -> dict:
    world, steps = f.world, max(f.steps, 1)
    first = everyone[0]["stats"]
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
        "fetch_policy": first["fetch_policy"],
        "transfer_path": first["transfer_path"],
        "transfer_gb_per_s": moved / seconds_moving / 1e9 if seconds_moving else 0.0,
        "bookkeeping_us_per_step": 1e6 * _sum(everyone, "bookkeeping_seconds") / world / steps,
        "host_wait_us_per_step": 1e6 * _sum(everyone, "host_wait_seconds") / world / steps,
        "host_wait_reads_us_per_step": 1e6 * _sum(everyone, "host_wait_read_seconds") / world / steps,
        "host_waits_on_disk": _sum(everyone, "host_waits_on_disk"),
        "compute_wait_us_per_step": 1e6 * max(e["stats"]["compute_wait_seconds"] for e in everyone) / steps,
        "cache_api_us_per_step": 1e6 * sum(e["clock"][0] for e in everyone) / world / steps,
        "cache_calls_us_per_step": {name: 1e6 * sum(e["calls"][name] for e in everyone) / world / steps
                                    for name in everyone[0]["calls"]},
        # The CUDA executor's host time handing copies to the driver, by route, and the
        # copies handed over (a run of blocks, or one layer group of a block, each).
        "copy_submit_us_per_step": _per_step_by_key(everyone, "submit_seconds", world * steps),
        "copy_entries_per_step": _sum(everyone, "copy_entries") / world / steps,
        "model_ms_per_step": 1e3 * sum(e["clock"][1] for e in everyone) / world / steps,
        "integrity_mismatches": mismatches,
        "integrity": integrity,
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
