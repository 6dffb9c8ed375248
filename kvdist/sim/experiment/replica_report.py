"""The results of a replicated job: every run's figures per replica, the one-cache
ceiling replay, the gap isolated → ceiling and how much of it sharing closed; printed
as tables on rank 0 and written to ``runs/<UTC time>/results.json``."""

from __future__ import annotations

import numpy as np
from tabulate import tabulate

from ...blocks import TIER_NAMES
from ...config import CacheConfig
from .ceiling import StepLog, replay
from .options import RunOptions
from .replica_job import ReplicaFigures
from .report import check_lines, human_bytes, percent, publish
from .results import ledger_totals
from .workload import Trace

LOCAL_TIERS = TIER_NAMES


def run_summary(parts: list[ReplicaFigures], replicas: int) -> dict:
    """One run (isolated or sharing) from every rank's figures."""
    rows = []
    for k in range(replicas):
        members = sorted((p for p in parts if p.figures.replica == k), key=lambda p: p.figures.tp_rank)
        lead, lead_gate = members[0].figures, members[0].gate
        ranks = [p.figures for p in members]
        st = lead.stats
        hits = st["hit_tokens"]
        rows.append({
            "replica": k, "requests": lead.finished, "requests_routed": lead.requests,
            "steps": lead.steps, "prompt_tokens": st["prompt_tokens"], "reused_tokens": hits,
            "prefill_tokens_computed": st["prompt_tokens"] - sum(hits.values()),
            "bytes_fetched_remote": sum(f.stats["bytes_fetched_remote"] for f in ranks),
            "remote_misses": st["remote_misses"],  # the replica's verdicts, alike on its ranks
            "prefetched": lead_gate[0], "held_for_prefetch": lead_gate[1],
            "logits": [lead.logits[0], max(f.logits[1] for f in ranks), max(f.logits[2] for f in ranks)],
            "consistency": list(lead.consistency),
            # SPMD inside the replica: its TP ranks reused, moved and stepped alike.
            "tp_identical": all((f.stats["hit_tokens"], f.stats["blocks_moved"], f.steps)
                                == (hits, st["blocks_moved"], lead.steps) for f in ranks),
        })
    figures = [p.figures for p in parts]
    tiers = sorted({t for r in rows for t in r["reused_tokens"]},
                   key=lambda t: (LOCAL_TIERS + ("remote",)).index(t))
    totals = ledger_totals(figures)
    mismatches = totals["mismatched_blocks"]
    summary = {
        "replicas": rows,
        "requests": sum(r["requests"] for r in rows),
        "reused_tokens": {t: sum(r["reused_tokens"].get(t, 0) for r in rows) for t in tiers},
        "prefill_tokens_computed": sum(r["prefill_tokens_computed"] for r in rows),
        "bytes_offloaded": sum(f.stats["bytes_offloaded"] for f in figures),
        "bytes_onboarded": sum(f.stats["bytes_onboarded"] for f in figures),
        "bytes_fetched_remote": sum(r["bytes_fetched_remote"] for r in rows),
        "remote_misses": sum(r["remote_misses"] for r in rows),
        "steps": max(r["steps"] for r in rows),
        # Per step of each rank's own replica, averaged over the ranks.
        "cache_api_us_per_step": 1e6 * _mean(f.cache_api_s / max(f.steps, 1) for f in figures),
        "bookkeeping_us_per_step": 1e6 * _mean(f.stats["bookkeeping_seconds"] / max(f.steps, 1)
                                               for f in figures),
        "model_ms_per_step": 1e3 * _mean(f.model_s / max(f.steps, 1) for f in figures),
        "integrity": {
            **totals,
            "logits_checked": sum(r["logits"][0] for r in rows),
            "logits_failed": sum(r["logits"][1] for r in rows),
            "logits_max_abs_diff": max(r["logits"][2] for r in rows),
            "consistency_checks": sum(r["consistency"][0] for r in rows),
            "consistency_error": next((r["consistency"][1] for r in rows if r["consistency"][1]), None),
        },
    }
    summary["ok"] = (all(r["requests"] == r["requests_routed"] and r["tp_identical"] for r in rows)
                     and mismatches == 0 and summary["integrity"]["logits_failed"] == 0
                     and summary["integrity"]["consistency_error"] is None)
    return summary


def _mean(values) -> float:
    v = list(values)
    return sum(v) / len(v)


def _turns(trace: Trace, routes: np.ndarray, logs: list[StepLog]) -> dict:
    """Follow-up turns, those routed away from their previous turn's replica, and those
    of them admitted before that turn had finished (its blocks could not be anywhere)."""
    admitted, finished = {}, {}
    for log in logs:
        for rec in log.records:
            admitted.update((rid, rec.clock) for rid in rec.prefills)
            finished.update((rid, rec.clock) for rid in rec.finished)
    follow = [r for r in trace.requests if r.after >= 0]
    away = [r for r in follow if routes[r.after] != routes[r.rid]]
    # (A run that stopped early admitted only some: the others ran nowhere.)
    early = [r for r in away
             if r.rid in admitted and admitted[r.rid] <= finished.get(r.after, admitted[r.rid])]
    return {"follow_ups": len(follow), "sent_away": len(away), "ran_before_previous_finished": len(early)}


def assemble(cfg: CacheConfig, trace: Trace, everyone: list[dict[str, ReplicaFigures]], seconds: float,
             solo_comm=None) -> dict:
    """The job's results (rank 0) from every rank's ``{run name: figures}``; replays
    the last run's steps through one cache of the replicas' total capacity
    (``solo_comm``: a one-rank communicator for that cache)."""
    names = list(everyone[0])
    by_run = {name: [e[name] for e in everyone] for name in names}
    last = by_run[names[-1]]
    replicas = 1 + max(p.figures.replica for p in last)
    routes = np.asarray(everyone[0][names[0]].routes)
    runs = {name: run_summary(parts, replicas) for name, parts in by_run.items()}
    leads = sorted((p for p in last if p.figures.tp_rank == 0), key=lambda p: p.figures.replica)
    logs = [StepLog(p.log) for p in leads]
    capacity = {t: n for t, n in last[0].figures.stats["capacity_blocks"].items() if t in LOCAL_TIERS}
    ceiling_hits = replay(cfg, trace, logs, capacity, cfg.workload.priority, comm=solo_comm)
    prompt = trace.prompt_tokens
    computed = {"no reuse": prompt, **{name: runs[name]["prefill_tokens_computed"] for name in names},
                "one cache (ceiling)": prompt - sum(ceiling_hits.values())}
    gap = computed["isolated"] - computed["one cache (ceiling)"]
    closed = computed["isolated"] - computed[names[-1]]
    final = runs[names[-1]]
    integrity = {k: sum(runs[n]["integrity"][k] for n in names)
                 for k in ("blocks_checked", "mismatched_blocks", "unknown_blocks", "recomputed_variants",
                           "logits_checked", "logits_failed", "consistency_checks")}
    integrity.update(
        first_mismatch=next((runs[n]["integrity"]["first_mismatch"] for n in names
                             if runs[n]["integrity"]["first_mismatch"]), None),
        consistency_error=next((runs[n]["integrity"]["consistency_error"] for n in names
                                if runs[n]["integrity"]["consistency_error"]), None),
        logits_max_abs_diff=max(runs[n]["integrity"]["logits_max_abs_diff"] for n in names),
        logits_tolerance=last[0].figures.tolerance,
        tokens_checked=0)
    integrity["tokens_checked"] = integrity["blocks_checked"] * cfg.cache.tokens_per_block
    return {
        "ok": all(r["ok"] for r in runs.values()),
        "world_size": len(last), "replicas": replicas, "tp_size": len(last) // replicas,
        "routing": cfg.workload.routing, "device": ",".join(sorted(set(everyone[0][names[0]].placement))),
        "tiers": last[0].figures.tiers, "runs": runs,
        "requests": final["requests"], "requests_in_trace": len(trace.requests),
        "prompt_tokens": prompt, "reused_tokens": final["reused_tokens"],
        "ceiling": {"reused_tokens": ceiling_hits,
                    "capacity_blocks": {t: replicas * n for t, n in capacity.items()}},
        "prefill_tokens_computed": computed,
        "gap": {"tokens": gap, "closed_tokens": closed, "closed_fraction": closed / gap if gap > 0 else None,
                "isolated_over_ceiling": computed["isolated"] / max(computed["one cache (ceiling)"], 1)},
        "turns": _turns(trace, routes, logs),
        "bytes_offloaded": final["bytes_offloaded"], "bytes_onboarded": final["bytes_onboarded"],
        "bytes_fetched_remote": final["bytes_fetched_remote"], "remote_misses": final["remote_misses"],
        "integrity_mismatches": integrity["mismatched_blocks"], "integrity": integrity,
        "steps": final["steps"], "seconds": seconds, "block_bytes": last[0].figures.stats["block_bytes"],
        "config": cfg.normalized(),
    }


def render(r: dict) -> str:
    """The replicated job's report as text."""
    R, prompt, computed = r["replicas"], r["prompt_tokens"], r["prefill_tokens_computed"]
    out = [f"kvdist run: {r['world_size']} ranks = {R} replicas x TP {r['tp_size']}, {r['device']}, "
           f"tiers {'+'.join(r['tiers'])}, routing {r['routing']}: {r['requests']:,} requests, "
           f"{r['seconds']:.1f} s", ""]
    label = {"isolated": f"{R} replicas isolated (remote tier off)",
             "sharing": f"{R} replicas sharing (remote tier on)",
             "one cache (ceiling)": f"one cache of {R}x the capacity (ceiling, replay)"}
    rows = [[label.get(name, name), prompt - n, n, percent(prompt - n, prompt) if name != "no reuse" else "-"]
            for name, n in computed.items()]
    out.append(tabulate(rows, intfmt=",", colalign=("left", "right", "right", "right"),
                        headers=["on the same trace", "tokens reused", "prefill tokens computed", "saved"]))
    g = r["gap"]
    line = (f"gap isolated -> ceiling: {g['tokens']:,} prefill tokens ({percent(g['tokens'], prompt)} of the "
            f"prompt tokens; isolated replicas compute {g['isolated_over_ceiling']:.2f}x the ceiling's)")
    if "sharing" in computed:
        closed = percent(g["closed_tokens"], g["tokens"])
        line += (f"; sharing closed {g['closed_tokens']:,} of them ({closed})" if g["tokens"] > 0
                 else "; nothing to close")
    out.append(line)
    t = r["turns"]
    out.append(f"turns: {t['follow_ups']:,} follow-ups, {t['sent_away']:,} routed to another replica than "
               f"their previous turn, {t['ran_before_previous_finished']:,} of those admitted before it had "
               "finished")
    per = []
    for name, run in r["runs"].items():
        for row in run["replicas"]:
            hits = row["reused_tokens"]
            per.append([row["replica"], name, row["requests"], row["steps"],
                        *(hits.get(tier, 0) for tier in ("gpu", "host", "remote")),
                        row["prefill_tokens_computed"], human_bytes(row["bytes_fetched_remote"]),
                        row["remote_misses"], row["prefetched"], row["held_for_prefetch"]])
    per.sort(key=lambda x: x[0])
    out.append("")
    out.append(tabulate(per, headers=["replica", "run", "requests", "steps", "reused gpu", "host", "remote",
                                      "computed", "fetched", "remote misses", "prefetched", "held"],
                        intfmt=",", colalign=("right", "left") + ("right",) * 10))
    out.append("(fetched: bytes pulled from other replicas, all TP ranks; remote misses: blocks looked up "
               "that were stale or late; prefetched: requests with blocks to fetch on arrival; held: those "
               "admitted a step or more late for them)")
    for name, run in r["runs"].items():
        out.append(f"per step, {name}: cache bookkeeping {run['bookkeeping_us_per_step']:.0f} µs, all cache "
                   f"calls {run['cache_api_us_per_step']:.0f} µs, model {run['model_ms_per_step']:.1f} ms")
    i = r["integrity"]
    out.append("")
    out.extend(check_lines(i, f"on {r['world_size']} ranks in {len(r['runs'])} runs (blocks from another "
                              "replica against its writes)"))
    identical = all(row["tp_identical"] for run in r["runs"].values() for row in run["replicas"])
    out.append(f"consistency: {i['consistency_checks']} checks; TP ranks "
               + ("identical in every replica" if identical and not i["consistency_error"]
                  else f"DIVERGED: {i['consistency_error'] or 'different figures'}"))
    return "\n".join(out)


def report(results: dict, opts: RunOptions) -> None:
    """Print the report (rank 0) and write ``results.json`` under ``opts.out``."""
    publish(results, opts.out, render)
