"""The run's results: the final tables printed on rank 0, and ``runs/<UTC time>/``
with ``results.json`` (plus the plots) and the ``runs/latest`` symlink."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path

from tabulate import tabulate

REQUIRED_KEYS = ("world_size", "requests", "prompt_tokens", "reused_tokens", "integrity_mismatches",
                 "bytes_offloaded", "bytes_onboarded", "steps", "seconds")


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def percent(part: float, whole: float) -> str:
    """``part`` of ``whole`` as a percentage with one decimal, "-" of nothing."""
    return f"{100 * part / whole:.1f}%" if whole else "-"


def render(r: dict) -> str:
    """The final report as text (tables and integrity lines)."""
    out = []
    tiers = r["tiers"]
    out.append(f"kvdist run: {r['world_size']} ranks on {r['nodes']} node(s), {r['device']}, "
               f"tiers {'+'.join(tiers)}: {r['requests']:,} requests, {r['steps']:,} steps, "
               f"{r['seconds']:.1f} s")
    prompt = r["prompt_tokens"]
    total_reused = sum(r["reused_tokens"].values())
    computed = r["prefill_tokens_computed"]
    rows = [
        ["no reuse", 0, computed["no reuse"], "-"],
        ["gpu only", r["reused_tokens_gpu_only"], computed["gpu-only"],
         percent(prompt - computed["gpu-only"], prompt)],
        [f"{' + '.join(tiers)} (this run)", total_reused, computed["this run"],
         percent(prompt - computed["this run"], prompt)],
    ]
    out.append("")
    out.append(tabulate(rows, headers=["reuse on the same trace", "tokens reused",
                                       "prefill tokens computed", "saved"],
                        intfmt=",", colalign=("left", "right", "right", "right")))
    saved = r["prefill_tokens_saved"]
    out.append(f"prompt tokens {prompt:,}; this run saves {saved['vs no reuse']:,} prefill tokens vs no "
               f"reuse and {saved['vs gpu-only']:,} vs gpu-only reuse "
               f"({percent(saved['vs gpu-only'], computed['gpu-only'])} of gpu-only's prefill)")
    per_tier = []
    for t in tiers:
        per_tier.append([t, r["capacity_blocks"][t], human_bytes(r["capacity_blocks"][t] * r["block_bytes"]),
                         r["reused_tokens"][t], percent(r["reused_tokens"][t], prompt),
                         r["evictions_by_tier"].get(t, 0)])
    out.append("")
    out.append(tabulate(per_tier, headers=["tier", "blocks/rank", "size/rank", "tokens reused",
                                           "of prompt", "evictions/rank"],
                        intfmt=",", colalign=("left", "right", "right", "right", "right", "right")))
    moves = [[m, n, human_bytes(n * r["block_bytes"] * r["world_size"])]
             for m, n in r["blocks_moved_per_rank"].items() if n]
    out.append("")
    out.append(tabulate(moves, headers=["copies", "blocks/rank", "bytes, all ranks"], intfmt=",",
                        colalign=("left", "right", "right")) if moves else "no copies between tiers")
    out.append(f"offloaded {human_bytes(r['bytes_offloaded'])}, "
               f"onboarded {human_bytes(r['bytes_onboarded'])}, "
               f"demoted {human_bytes(r['bytes_demoted'])} (all ranks); copies at "
               f"{r['transfer_gb_per_s']:.2f} GB/s per rank ({r['transfer_path']})")
    out.append(f"per step: cache bookkeeping {r['bookkeeping_us_per_step']:.0f} µs, all cache calls "
               f"{r['cache_api_us_per_step']:.0f} µs (of which waiting for disk work "
               f"{r.get('host_wait_us_per_step', 0.0):.0f} µs), model {r['model_ms_per_step']:.1f} ms")
    c = r.get("critical_path")
    if c is not None:
        how = "running ahead" if c["run_ahead"] else "serial"
        out.append(f"critical path per step ({how}, {c['timers']}): {c['step_ms']:.1f} ms, GPU busy "
                   f"{c['gpu_busy_ms']:.1f} ms, idle {c['gpu_idle_ms']:.1f} ms "
                   f"({100 * c['gpu_idle_fraction']:.0f}%), cache on the critical path "
                   f"{c['cache_on_critical_path_us']:.0f} µs")
    calls = r.get("cache_calls_us_per_step", {})
    out.append("cache calls per step: " + ", ".join(f"{name} {us:.0f} µs" for name, us in calls.items()))
    if r.get("copy_entries_per_step"):  # the CUDA executor
        out.append(f"copies per step: {r['copy_entries_per_step']:.0f} handed to the driver, submitted in "
                   + ", ".join(f"{route} {us:.0f} µs" for route, us in r["copy_submit_us_per_step"].items()))
    out.extend(event_lines(r.get("events", [])))
    i = r["integrity"]
    out.append("")
    out.extend(check_lines(i, f"on {r['world_size']} ranks"))
    cons = i["consistency"]
    out.append(f"consistency: {cons['checks']} checks, "
               + ("ranks identical" if cons["error"] is None else f"FAILED: {cons['error']}"))
    return "\n".join(out)


def event_lines(events: list[dict]) -> list[str]:
    """A line per KV cache events publisher (the results' ``events``)."""
    return [f"KV cache events of replica {e['replica']} (rank {e['rank']}) on {e['endpoint']}"
            + (f" (replay {e['replay_endpoint']})" if e["replay_endpoint"] else "")
            + f": {e['submitted']:,} steps with block changes, {e['published']:,} published by the run's "
            f"end, {e['dropped']} dropped, {e['replays']} replays" for e in events]


def check_lines(i: dict, where: str) -> list[str]:
    """The integrity and logits lines of a report (``i``: the results' ``integrity``)."""
    verdict = "OK" if i["mismatched_blocks"] == 0 else "MISMATCH"
    out = [f"integrity {verdict}: {i['blocks_checked']:,} reused blocks ({i['tokens_checked']:,} tokens) "
           f"checked {where}, {i['mismatched_blocks']} mismatched"
           + (f" (first: {i['first_mismatch']})" if i["first_mismatch"] else "")]
    if i["logits_checked"]:
        out.append(f"logits: {i['logits_checked']} requests with reuse vs a from-scratch recompute, "
                   f"max |diff| {i['logits_max_abs_diff']:.2e} (tolerance {i['logits_tolerance']:.0e} "
                   f"× max(1, |logit|)), {i['logits_failed']} outside")
    return out


def new_run_dir(out: str | os.PathLike) -> Path:
    """``out/<UTC time>`` (made unique), created."""
    base = Path(out)
    base.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    path = base / stamp
    n = 1
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            n += 1
            path = base / f"{stamp}-{n}"


def point_latest(run_dir: Path) -> None:
    """``<out>/latest`` -> the run directory (relative, replaced atomically; the
    preflight made sure ``latest`` is no directory). Leaves no temporary link."""
    link = run_dir.parent / "latest"
    tmp = run_dir.parent / f".latest-{os.getpid()}"
    if tmp.is_symlink():
        tmp.unlink()
    tmp.symlink_to(run_dir.name)
    try:
        os.replace(tmp, link)
    except BaseException:
        tmp.unlink()
        raise


def write_results(run_dir: Path, results: dict) -> Path:
    missing = [k for k in REQUIRED_KEYS if k not in results]
    assert not missing, f"results lack {missing}"
    path = run_dir / "results.json"
    path.write_text(json.dumps(results, indent=1, sort_keys=True) + "\n", encoding="utf-8")
    return path


def publish(results: dict, out: str | os.PathLike | None, render: Callable[[dict], str],
            extras: Callable[[Path], list[str]] | None = None) -> None:
    """Rank 0's end of every kind of run: ``results.json`` (and what ``extras`` writes
    next to it, returning the names) in a new ``out/<UTC time>`` that ``out/latest``
    then points to, and the report ``render`` makes printed. ``out`` None: print only."""
    names: list[str] = []
    if out is not None:
        run_dir = new_run_dir(out)
        results["run_dir"] = str(run_dir)
        write_results(run_dir, results)
        names = extras(run_dir) if extras is not None else []
        point_latest(run_dir)
    print("\n" + render(results), flush=True)
    if out is not None:
        more = f" (+ {', '.join(names)})" if names else ""
        print(f"results: {results['run_dir']}/results.json{more}; {Path(out) / 'latest'} points there",
              flush=True)
